"""How the pieces of a training step add up: compute, exposed communication, pipeline bubble.

The bubble uses closed forms (one function, so a schedule simulator can replace it):

  GPipe and 1F1B      (p - 1) / m        Huang et al. 2019; Narayanan et al. 2021, section 2.2
  interleaved 1F1B    (p - 1) / (v m)    Narayanan et al. 2021, section 2.2.2
  zero bubble (ZB-H1) (p - 1) / (3 m)    Qi et al. 2023: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W)
                                         against 1F1B's (p - 1)(T_F + T_B + T_W); with the paper's
                                         1:1:1 ratio of forward, input-gradient and weight-gradient
                                         times that is a third of 1F1B's.

With fewer microbatches than stages every schedule degenerates to (p - 1) / m.
Each is the idle time *relative to the ideal* (bubble-free) time m * t_microbatch, so the step
takes (1 + ratio) times the ideal; as a fraction of the step the bubble is ratio / (1 + ratio).
"""

from __future__ import annotations

from dataclasses import dataclass


def pipeline_bubble_ratio(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Pipeline idle time divided by the ideal compute time of the step (see the module doc)."""
    if pp == 1:
        return 0.0
    base = (pp - 1) / num_microbatches
    if num_microbatches < pp:
        return base  # too few microbatches to fill the pipeline: no schedule hides the ramp
    if schedule == "interleaved":
        return base / vpp
    if schedule == "zb":
        return base / 3
    return base


def bubble_fraction_of_step(ratio: float) -> float:
    return ratio / (1 + ratio)


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float  # forward, backward, recomputation and the optimizer step
    communication_exposed: float  # collectives not hidden behind compute
    bubble: float  # pipeline idle time

    @property
    def total(self) -> float:
        return self.compute + self.communication_exposed + self.bubble

    def as_dict(self) -> dict[str, float]:
        return {"total": self.total, "compute": self.compute,
                "communication_exposed": self.communication_exposed, "bubble": self.bubble}


def overlapped(comm: float, window: float, enabled: bool) -> float:
    """The part of `comm` that sticks out of the compute `window` it runs behind."""
    return max(0.0, comm - window) if enabled else comm
