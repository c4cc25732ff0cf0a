"""How the pieces of a training step add up: compute, exposed communication, pipeline bubble.

The bubble and the activations in flight come from the schedule simulator (tetrad.schedules), run
on the compute order of the very schedule the executor runs, so planner, `tetrad schedule` and
runtime agree. The simulator takes one duration per kind of action, the same on every stage, so
the planner gives it the slowest stage's forward F, backward B and, for zero bubble, the part W of
B that computes weight gradients (the forward's matmuls again; B - W, with any recomputation, is
the input gradient on the critical path). Durations are rounded to 1/DURATION_GRID of the forward
so that the thousands of layouts a search evaluates share a few cached simulations.

Where a schedule has a closed form exact for the planner's durations, the planner takes it and
never builds the action lists: GPipe, 1F1B and interleaved (microbatches a multiple of pp)
whatever F:B, ZB-H1 for W <= F and W <= B - W; the in-flight peaks likewise, the V schedules'
included. tests/test_planner_comm.py and tests/test_planner_search_speed.py check them equal to
the simulation over many shapes. As ratios of idle to busy time on each rank (stage times
uniform; ZB-H1 as its makespan, each rank busy m (F + B)):

  GPipe and 1F1B      (p - 1) / m        Huang et al. 2019; Narayanan et al. 2021, section 2.2
  interleaved 1F1B    (p - 1) / (v m)    Narayanan et al. 2021, section 2.2.2 (m >= p)
  any of these, m < p (p - 1) / m        too few microbatches to fill the pipeline
  zero bubble (ZB-H1) makespan = max(m (F + B) + (p - 1)(F + B - 2W),  (m + p - 1)(F + B - W) + W)
                      Qi et al. 2023: (p - 1)(T_F + T_B - T_W) per rank once m >= p; exact for
                      W <= F and W <= B - W (otherwise simulated).
  ZB-V and DualPipeV  makespan(m) = makespan(2p) + (m - 2p)(F + B): from 2p microbatches on
                      (DualPipeV's least) every further microbatch adds only its own work to the
                      V's steady state, so one simulation at m = 2p (12 p^2 actions) prices any m;
                      tests/test_schedule_v.py checks it against the simulation at larger m.

Activations in flight at each rank's peak, in microbatches of the rank's whole layer set: GPipe m;
1F1B min(p - r, m); interleaved min(m v, (v - 1) p + 2 (p - r - 1) + 1) chunks of 1/v each; ZB-H1
min(p, m) on every rank, counted until W, which still needs the saved matmul inputs (the
zero-bubble paper's p M_B; tetrad's executor holds them that long too); ZB-V min(2m, m + 1 + r, 2p)
chunks of 1/2 and DualPipeV (m >= 2p) 2p + 1 of them on every rank, as their action lists hold
them (more microbatches than 2p do not raise them).

Bubble ratios are idle time *relative to the ideal* (bubble-free) time m * t_microbatch, so the
step takes (1 + ratio) times the ideal; as a fraction of the step the bubble is
ratio / (1 + ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from tetrad.schedules import Durations, Schedule, build_schedule, peak_in_flight
from tetrad.schedules.generate import SPLIT_BACKWARD, V_SHAPED
from tetrad.schedules.simulate import makespan

DURATION_GRID = 32  # ZB-H1's bubble then within 6% of the unrounded times' (the others' is exact)


def has_closed_form(schedule: str, pp: int, m: int) -> bool:
    """Whether closed_form_makespan and closed_form_in_flight answer for this shape (the
    interleaved schedule refuses a microbatch count that is not a multiple of pp)."""
    return schedule not in V_SHAPED and (schedule != "interleaved" or m % pp == 0)


def v_in_flight_closed_form(schedule: str, pp: int, m: int) -> bool:
    """Whether closed_form_in_flight answers for a V schedule (DualPipeV's from 2 pp
    microbatches, the fewest the search gives it)."""
    return schedule == "zbv" or (schedule == "dualpipe" and m >= 2 * pp)


def _grid_units(value: float, forward: float) -> int:
    return max(1, round(DURATION_GRID * value / forward))


def pipeline_bubble_ratio(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                          forward: float = 1.0, backward: float = 2.0,
                          backward_weight: float | None = None) -> float:
    """Pipeline idle time divided by the compute time of the step, each rank running one
    microbatch in `forward` + `backward` (see the module doc). `backward_weight` is the part of
    the backward a split schedule (zb) defers as W; None: half, as the simulator assumes."""
    if pp == 1:
        return 0.0
    units = _grid(schedule, forward, backward, backward_weight)
    return float(_bubble_ratio(schedule, pp, num_microbatches, vpp, *units))


def pipeline_bubble_ratio_floor(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                                forward: float = 1.0, backward: float = 2.0,
                                backward_weight: float | None = None) -> float:
    """At most pipeline_bubble_ratio, without simulating: the ratio itself where a closed form
    gives it; for the V schedules, the last rank's wait for the p - 1 chunk forwards above it
    before its m (F + B) of work (less 1e-9 for the float rounding past 2p microbatches)."""
    if schedule not in V_SHAPED or pp == 1:
        return pipeline_bubble_ratio(schedule, pp, num_microbatches, vpp, forward, backward,
                                     backward_weight)
    f, b, w = _grid(schedule, forward, backward, backward_weight)
    return float(Fraction((pp - 1) * f, 2 * num_microbatches * (f + b + w))) * (1 - 1e-9)


def _grid(schedule: str, forward: float, backward: float,
          backward_weight: float | None) -> tuple[int, int, int]:
    """F, B and W in grid units: the forward is DURATION_GRID; B is the input-gradient part
    when the schedule splits the backward (W: None is half of it), else all of it and W 0."""
    weight = backward / 2 if backward_weight is None else backward_weight
    split = schedule in SPLIT_BACKWARD
    return (DURATION_GRID, _grid_units(backward - weight if split else backward, forward),
            _grid_units(weight, forward) if split else 0)


@lru_cache(maxsize=8192)
def _bubble_ratio(schedule: str, pp: int, m: int, vpp: int, forward: int, backward_input: int,
                  backward_weight: int) -> Fraction:
    busy = m * (forward + backward_input + backward_weight)
    if schedule in V_SHAPED and m > 2 * pp:
        filled = _bubble_ratio(schedule, pp, 2 * pp, vpp, forward, backward_input,
                               backward_weight)
        per_microbatch = busy / m
        return ((1 + filled) * 2 * pp * per_microbatch + (m - 2 * pp) * per_microbatch) / busy - 1
    if has_closed_form(schedule, pp, m) and (
            schedule not in SPLIT_BACKWARD
            or backward_weight <= min(forward, backward_input)):
        return Fraction(closed_form_makespan(schedule, pp, m, vpp, forward, backward_input,
                                             backward_weight)) / busy - 1
    durations = (Durations(forward, backward_input + backward_weight, backward_input,
                           backward_weight) if backward_weight else
                 Durations(forward, backward_input))
    return makespan(_compute_order(schedule, pp, m, vpp), durations) / busy - 1


def closed_form_makespan(schedule: str, pp: int, m: int, vpp: int, forward: Fraction,
                         backward_input: Fraction, backward_weight: Fraction) -> Fraction:
    """The simulated makespan of uniform stages, in closed form (module doc): `backward_input`
    is the whole backward unless the schedule splits it."""
    f, b, w = forward, backward_input, backward_weight
    if schedule in SPLIT_BACKWARD:
        return max(m * (f + b + w) + (pp - 1) * (f + b - w), (m + pp - 1) * (f + b) + w)
    return m * (f + b) + (pp - 1) * Fraction(f + b) / (1 if m < pp else vpp)


@lru_cache(maxsize=4096)
def _compute_order(schedule: str, pp: int, m: int, vpp: int) -> Schedule:
    # Without send/receive actions: under the executor's isend/irecv rule the timeline is the same.
    return build_schedule(schedule, pp, m, vpp, communication=False)


@lru_cache(maxsize=4096)
def pipeline_in_flight(schedule: str, pp: int, num_microbatches: int,
                       vpp: int = 1) -> tuple[float, ...]:
    """Per pipeline rank, the microbatches whose activations it holds at its peak, in units of
    the rank's whole layer set (an interleaved chunk is 1/vpp of it); zero bubble counts until
    W. The closed forms of the module doc, or the schedule's action lists where none applies."""
    p, m, v = pp, num_microbatches, vpp
    if has_closed_form(schedule, p, m) or v_in_flight_closed_form(schedule, p, m):
        return closed_form_in_flight(schedule, p, m, v)
    release = "W" if schedule in SPLIT_BACKWARD else "B"
    return tuple(peak / v for peak in peak_in_flight(_compute_order(schedule, p, m, v), release))


def closed_form_in_flight(schedule: str, pp: int, m: int, vpp: int) -> tuple[float, ...]:
    """What pipeline_in_flight reads off the action lists, in closed form (module doc)."""
    if schedule == "gpipe":
        return (m,) * pp
    if schedule == "zbv":
        return tuple(min(2 * m, m + 1 + rank, 2 * pp) / 2 for rank in range(pp))
    if schedule == "dualpipe":
        return ((2 * pp + 1) / 2,) * pp
    if schedule in SPLIT_BACKWARD:
        return (min(pp, m),) * pp
    if schedule == "interleaved":
        return tuple(min(m * vpp, (vpp - 1) * pp + 2 * (pp - rank - 1) + 1) / vpp
                     for rank in range(pp))
    return tuple(min(pp - rank, m) for rank in range(pp))


@lru_cache(maxsize=1024)
def paired_share(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Of a rank's chunk forwards (and as many backwards), the share the schedule runs as one
    of its overlapped (F, B) pairs, on the rank that pairs fewest: 0 but for DualPipeV, whose
    steady state is all pairs (about 1 - 1.5 pp / m)."""
    if schedule != "dualpipe":
        return 0.0
    pairs = build_schedule(schedule, pp, num_microbatches, vpp, communication=False).overlapped
    return min(len(rank_pairs) for rank_pairs in pairs) / (num_microbatches * vpp)


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


def overlapped(comm: float, window: float, enabled: bool, interference: float = 0.0) -> float:
    """What `comm` adds to the step when it runs behind the compute `window`. While it runs, the
    compute loses `interference` of its speed (EfficiencyProfile.comm_interference: the SMs
    NCCL's kernels occupy), which stretches the window by interference * comm; the step lasts
    the longer of that and the communication itself."""
    if not enabled:
        return comm
    return max(0.0, comm - window, interference * comm)
