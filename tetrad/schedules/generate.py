"""One function per pipeline schedule, each returning the compute order of every rank.

The generators only order F / B / W; `build_schedule` checks the arguments, calls one of them
and adds the send / receive actions (tetrad.schedules.communication). No torch here.
"""

from __future__ import annotations

from typing import Callable

from tetrad.errors import ConfigError
from tetrad.schedules.actions import Action, Schedule
from tetrad.schedules.communication import add_communication
from tetrad.schedules.v_shape import dualpipe_v, zero_bubble_v

ComputeOrder = list[list[Action]]  # [rank][position]


def naive(pp: int, microbatches: int, vpp: int) -> ComputeOrder:
    """One microbatch at a time: rank 0 starts microbatch i+1 only after its backward of i,
    which is the last thing that happens to microbatch i."""
    return [[Action(kind, rank, mb) for mb in range(microbatches) for kind in ("F", "B")]
            for rank in range(pp)]


def gpipe(pp: int, microbatches: int, vpp: int) -> ComputeOrder:
    """GPipe (Huang et al. 2019): every forward, then every backward; all m microbatches'
    activations are alive at the turn."""
    return [[Action("F", rank, mb) for mb in range(microbatches)]
            + [Action("B", rank, mb) for mb in range(microbatches)] for rank in range(pp)]


def one_f_one_b(pp: int, microbatches: int, vpp: int) -> ComputeOrder:
    """PipeDream-flush (Narayanan et al. 2021): rank r runs pp-r-1 warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards. At most pp-r
    microbatches are alive on rank r."""
    order = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        actions = [Action("F", rank, mb) for mb in range(warmup)]
        for mb in range(microbatches - warmup):
            actions += [Action("F", rank, warmup + mb), Action("B", rank, mb)]
        actions += [Action("B", rank, mb) for mb in range(microbatches - warmup, microbatches)]
        order.append(actions)
    return order


def interleaved(pp: int, microbatches: int, vpp: int) -> ComputeOrder:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): rank r holds stages
    r, r+pp, ..., and runs the forwards of pp microbatches through one chunk before moving to
    its next chunk (backwards run the chunks in reverse). Warm-up is (vpp-1)*pp forwards plus two
    per hop to the last rank, as Megatron's forward_backward_pipelining_with_interleaving."""
    per_group = pp * vpp  # forward k of a rank: chunk (k % per_group) // pp

    def microbatch(k: int) -> int:
        return (k // per_group) * pp + k % pp

    def forward(rank: int, k: int) -> Action:
        return Action("F", ((k % per_group) // pp) * pp + rank, microbatch(k))

    def backward(rank: int, k: int) -> Action:
        return Action("B", (vpp - 1 - (k % per_group) // pp) * pp + rank, microbatch(k))

    total = microbatches * vpp
    order = []
    for rank in range(pp):
        warmup = min(total, (vpp - 1) * pp + 2 * (pp - rank - 1))
        actions = [forward(rank, k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(rank, warmup + k), backward(rank, k)]
        actions += [backward(rank, k) for k in range(total - warmup, total)]
        order.append(actions)
    return order


def zero_bubble_h1(pp: int, microbatches: int, vpp: int) -> ComputeOrder:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B (gradient of the input, on
    the critical path between stages) and W (gradient of the weights, needed by nobody
    downstream). Rank r holds back its first r W's and runs them in the cool-down, where 1F1B
    leaves rank r idle; so microbatches whose W is pending never exceed pp on any rank, the peak
    1F1B has on rank 0. Same order as torch's ScheduleInterleavedZeroBubble with one chunk."""
    order = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        actions = [Action("F", rank, mb) for mb in range(warmup)]
        weights_done = 0
        for mb in range(microbatches):
            if warmup + mb < microbatches:
                actions.append(Action("F", rank, warmup + mb))
            actions.append(Action("B", rank, mb))
            if mb >= rank:
                actions.append(Action("W", rank, weights_done))
                weights_done += 1
        actions += [Action("W", rank, mb) for mb in range(weights_done, microbatches)]
        order.append(actions)
    return order


SCHEDULES: dict[str, Callable[[int, int, int], ComputeOrder]] = {
    "naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
    "zb": zero_bubble_h1, "zbv": zero_bubble_v, "dualpipe": lambda *shape: dualpipe_v(*shape)[0]}
V_SHAPED = {"zbv", "dualpipe"}  # two chunks per rank in the V placement (actions.py)
SPLIT_BACKWARD = {"zb"} | V_SHAPED


def check_arguments(name: str, pp: int, microbatches: int, vpp: int) -> None:
    """Raise ConfigError saying what to change when the schedule cannot be built."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    for flag, value in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if value < 1:
            raise ConfigError(f"--{flag} must be >= 1, got {value}")
    if name in V_SHAPED:
        if vpp != 2:
            raise ConfigError(f"the {name} schedule places two model chunks per rank in a V: "
                              f"use --vpp 2 (got {vpp})")
        if name == "dualpipe" and microbatches < 2 * pp:
            raise ConfigError(f"the dualpipe schedule needs at least 2 * pp = {2 * pp} "
                              f"microbatches (one per stage), got {microbatches}")
    elif name != "interleaved" and vpp > 1:
        raise ConfigError(f"--vpp {vpp} splits each rank into model chunks, which only the "
                          f"interleaved schedule runs: use --schedule interleaved or --vpp 1")
    if name == "interleaved":
        if pp < 2:
            raise ConfigError("the interleaved schedule needs --pp >= 2 (with one rank there "
                              "is no pipeline bubble to shrink)")
        if vpp < 2:
            raise ConfigError("the interleaved schedule needs --vpp >= 2 model chunks per rank; "
                              "with one chunk per rank use --schedule 1f1b")
        if microbatches % pp:
            lower = microbatches // pp * pp
            fixes = f"{lower} or {lower + pp}" if lower else f"{pp}"
            raise ConfigError(f"the interleaved schedule needs microbatches to be a multiple of "
                              f"pp={pp}, got {microbatches}: use {fixes}")


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1,
                   communication: bool = True) -> Schedule:
    """The full schedule: compute order of the named schedule plus its sends and receives, in
    an order that cannot deadlock even when send and recv both block. `communication=False`
    leaves the bare compute order, which simulates to the same timeline as the full schedule
    under the executor's isend/irecv rule and in a fraction of the time (the planner's use)."""
    check_arguments(name, pp, microbatches, vpp)
    overlapped = dualpipe_v(pp, microbatches, vpp)[1] if name == "dualpipe" else ()
    bare = Schedule(name, pp, vpp, microbatches, name in SPLIT_BACKWARD,
                    tuple(tuple(actions) for actions in SCHEDULES[name](pp, microbatches, vpp)),
                    name in V_SHAPED, overlapped)
    return add_communication(bare) if communication else bare
