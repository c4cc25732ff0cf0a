"""The V-shaped schedules: two model chunks per rank, rank r holding stages r and 2*pp-1-r, so a
microbatch runs down the ranks on its first chunk and back up on its second (actions.py).

ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): with the backward split
into B (input gradient) and W (weight gradient), the V lets the last rank turn a microbatch
around at once and W fills what would be the warm-up and cool-down bubbles; with F = B = W the
pipeline has no bubble at all, and it holds 1F1B's peak of activations.

DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 Technical Report section 3.2.1, in the V-shaped form of
deepseek-ai/DualPipe's dualpipev.py that torch ships as ScheduleDualPipeV): DualPipe's
bidirectional pipeline cut in half, so that each rank holds two chunks of one copy of the model
rather than one chunk of each of two copies (no duplicated parameters, no extra gradient
all-reduce). Its steady state pairs the forward of one microbatch's chunk with the backward of
another's; in DeepSeek's kernels the pair runs as one unit, and each half's expert all-to-all
and pipeline sends run while the other half computes. Backwards of the pairs are whole (W right
after its B); only the cool-down splits them, to fill its bubbles with W's.

Both follow torch 2.13's ScheduleZBVZeroBubble / ScheduleDualPipeV order for order (tests compare
them), with B for torch's BACKWARD_INPUT and B followed by W for its FULL_BACKWARD.
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.schedules.actions import Action

ComputeOrder = list[list[Action]]
Pairs = tuple[tuple[tuple[Action, Action], ...], ...]


def zero_bubble_v(pp: int, microbatches: int, vpp: int = 2) -> ComputeOrder:
    """ZB-V: warm-up forwards down chunk 0 and up chunk 1, a steady state of F B W on each
    chunk in turn, and a cool-down of B's whose W's fill the tail. Built for max(2pp-1, m)
    microbatches (enough to fill the V) with the extra ones then dropped, as torch does."""
    filled = _filled_v(pp, max(2 * pp - 1, microbatches))
    return [[a for a in actions if a.microbatch < microbatches] for actions in filled]


@lru_cache(maxsize=64)
def _filled_v(pp: int, total: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-V's lists for `total` microbatches; every m up to 2pp-1 keeps a part of the same
    lists, so the planner's many microbatch counts share one build."""
    order = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank
        counts = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
        actions: list[Action] = []

        def add(kind: str, chunk: int, counter: str | None = None) -> None:
            key = counter or f"{kind}{chunk}"
            actions.append(Action(kind, (down, up)[chunk], counts[key]))
            counts[key] += 1

        for _ in range(2 * (pp - rank) - 1):
            add("F", 0)
        for _ in range(rank):
            add("F", 1)
            add("F", 0)
        for _ in range(pp - rank):
            add("F", 1)
            actions.append(Action("B", up, counts["B1"]))
            add("W", 1, "B1")
        while counts["F1"] < counts["F0"] or counts["F0"] < total:
            if counts["F0"] < total:
                add("F", 0)
            actions.append(Action("B", down, counts["B0"]))
            add("W", 0, "B0")
            add("F", 1)
            actions.append(Action("B", up, counts["B1"]))
            add("W", 1, "B1")
        weights = {0: counts["B0"], 1: counts["B1"]}
        for _ in range(rank):
            add("B", 0)
            add("B", 1)
        for _ in range(pp - rank):
            add("B", 0)
            actions.append(Action("W", down, weights[0]))
            weights[0] += 1
        for chunk in (1, 0):
            stage = (down, up)[chunk]
            while weights[chunk] < counts[f"B{chunk}"]:
                actions.append(Action("W", stage, weights[chunk]))
                weights[chunk] += 1
        order.append(tuple(actions))
    return tuple(order)


def dualpipe_v(pp: int, microbatches: int, vpp: int = 2) -> tuple[ComputeOrder, Pairs]:
    """DualPipeV's compute order and, per rank, its overlapped (F, B) pairs. Needs
    microbatches >= 2 * pp (check_arguments says so)."""
    order, pairs = [], []
    for rank in range(pp):
        rank_order, rank_pairs = _DualPipeRank(pp, rank).build(microbatches)
        order.append(rank_order)
        pairs.append(tuple(rank_pairs))
    return order, tuple(pairs)


class _DualPipeRank:
    """One rank's list, built in DualPipeV's eight steps (deepseek-ai/DualPipe dualpipev.py)."""

    def __init__(self, pp: int, rank: int):
        self.pp, self.rank = pp, rank
        self.stages = (rank, 2 * pp - 1 - rank)
        self.next = {(kind, chunk): 0 for kind in ("F", "B") for chunk in (0, 1)}
        self.weights: list[Action] = []  # W's of split backwards, oldest first
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []

    def forward(self, chunk: int) -> Action:
        action = Action("F", self.stages[chunk], self.next["F", chunk])
        self.next["F", chunk] += 1
        self.actions.append(action)
        return action

    def backward(self, chunk: int, whole: bool) -> Action:
        """B, then at once its W when the backward is whole; otherwise W waits in the queue."""
        action = Action("B", self.stages[chunk], self.next["B", chunk])
        self.next["B", chunk] += 1
        self.actions.append(action)
        weight = Action("W", action.stage, action.microbatch)
        if whole:
            self.actions.append(weight)
        else:
            self.weights.append(weight)
        return action

    def pending_weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.pop(0))

    def overlapped(self, forward_chunk: int) -> None:
        self.pairs.append((self.forward(forward_chunk), self.backward(1 - forward_chunk, True)))

    def build(self, microbatches: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
        pp, rank = self.pp, self.rank
        for _ in range(2 * (pp - rank - 1)):  # 1: chunk 0 forwards
            self.forward(0)
        for _ in range(rank + 1):  # 2: both chunks' forwards
            self.forward(0)
            self.forward(1)
        for _ in range(pp - rank - 1):  # 3: zero bubble on chunk 1
            self.backward(1, False)
            self.pending_weight()
            self.forward(1)
        for step in range(microbatches - 2 * pp + rank + 1):  # 4: the overlapped steady state
            if step == 0 and rank == pp - 1:  # the turn of the V: not overlapped, less bubble
                self.forward(0)
                self.backward(1, True)
            else:
                self.overlapped(0)
            self.overlapped(1)
        for _ in range(pp - rank - 1):  # 5
            self.backward(1, True)
            self.overlapped(1)
        split = False
        for step in range(rank + 1):  # 6: the second half of the backwards split
            split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
            self.backward(1, not split)
            split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
            self.backward(0, not split)
        for _ in range(pp - rank - 1):  # 7
            self.pending_weight()
            self.backward(0, not split)
        for _ in range(rank + 1):  # 8
            self.pending_weight()
        return self.actions, self.pairs
