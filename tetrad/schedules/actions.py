"""What a pipeline schedule is made of: per rank, an ordered list of actions.

Stages are global virtual stages 0 .. pp*vpp-1. In the loop placement stage s lives on rank
s % pp (Megatron's interleaved placement: with pp=4, vpp=2 rank 0 holds stages 0 and 4), so with
vpp=1 the stage index equals the rank. In the V placement (ZB-V, DualPipeV: two chunks per rank)
rank r holds stages r and 2*pp-1-r, so the pipeline runs down the ranks and back up, and the
first and last stages share rank 0. Compute actions:

    F  forward of (stage, microbatch)
    B  backward; the full backward, or backward-for-input when `split_backward` (zero bubble)
    W  backward-for-weights, only when `split_backward`

Communication actions name the stage *doing* the send or receive (as torch.distributed.pipelining
does), and `peer` is the rank on the other end:

    SEND_F  stage s sends its output activation to stage s+1     matches RECV_F of stage s+1
    RECV_F  stage s receives its input activation from stage s-1
    SEND_B  stage s sends the gradient of its input to stage s-1 matches RECV_B of stage s-1
    RECV_B  stage s receives the gradient of its output from stage s+1

No torch here: the planner imports this package for its bubble term.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.errors import TetradError

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(TetradError):
    """A schedule that cannot run: a missing or repeated action, an order that breaks a
    dependency, or a communication order that deadlocks."""


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    microbatch: int
    peer: int | None = None  # the rank on the other end of a SEND_* / RECV_*

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}@s{self.stage}"
        return text if self.peer is None else f"{text}:r{self.peer}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "stage": self.stage, "microbatch": self.microbatch,
                "peer": self.peer}


def stage_rank(stage: int, pp: int, v_shape: bool) -> int:
    """The pipeline rank that holds `stage` (module doc: the loop or the V placement)."""
    if v_shape:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def message(action: Action) -> tuple[str, int, int]:
    """The tensor a SEND_* / RECV_* moves, named by (direction, receiving stage, microbatch), so a
    send and its matching receive give the same key."""
    direction = action.kind[-1]
    if action.kind.startswith("SEND"):
        stage = action.stage + 1 if direction == "F" else action.stage - 1
        return direction, stage, action.microbatch
    return direction, action.stage, action.microbatch


def upstream(action: Action, num_stages: int) -> Action | None:
    """The compute on the neighbouring stage whose output this compute consumes."""
    if action.kind == "F" and action.stage > 0:
        return Action("F", action.stage - 1, action.microbatch)
    if action.kind == "B" and action.stage < num_stages - 1:
        return Action("B", action.stage + 1, action.microbatch)
    return None


def downstream(action: Action, num_stages: int) -> Action | None:
    """The compute on the neighbouring stage that consumes this compute's output."""
    if action.kind == "F" and action.stage < num_stages - 1:
        return Action("F", action.stage + 1, action.microbatch)
    if action.kind == "B" and action.stage > 0:
        return Action("B", action.stage - 1, action.microbatch)
    return None


def local_prerequisite(action: Action) -> Action | None:
    """The compute on the same stage that must run first: B needs F's saved activations, W needs
    the output gradients B computed. Sends need the compute whose tensor they ship."""
    if action.kind == "B":
        return Action("F", action.stage, action.microbatch)
    if action.kind == "W":
        return Action("B", action.stage, action.microbatch)
    if action.kind.startswith("SEND"):
        return Action(action.kind[-1], action.stage, action.microbatch)
    return None


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    vpp: int
    microbatches: int
    split_backward: bool  # B is backward-for-input and every (stage, microbatch) also has a W
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order
    v_shape: bool = False  # the V placement (module doc) instead of the loop
    # Per rank, the (F, B) pairs the schedule runs as one overlapped unit (DualPipe): while one
    # microbatch's chunk waits on its expert all-to-all, the other's computes.
    overlapped: tuple[tuple[tuple[Action, Action], ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.pp, self.v_shape)

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's vpp model chunks a stage is."""
        return stage // self.pp

    @property
    def has_communication(self) -> bool:
        return any(not a.is_compute for rank_actions in self.actions for a in rank_actions)

    def to_dict(self) -> dict:
        return {"schedule": self.name, "pp": self.pp, "vpp": self.vpp,
                "microbatches": self.microbatches, "split_backward": self.split_backward,
                "placement": "v" if self.v_shape else "loop",
                "overlapped": {str(rank): [[str(f), str(b)] for f, b in pairs]
                               for rank, pairs in enumerate(self.overlapped)},
                "actions": {str(rank): [a.to_dict() for a in rank_actions]
                            for rank, rank_actions in enumerate(self.actions)}}
