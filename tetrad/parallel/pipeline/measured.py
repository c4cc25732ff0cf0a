"""What pipeline steps cost, action by action, read from the executor's events (StepStats.events):
the ActionCosts that simulate(..., costs=...) replays, so that a measured idle fraction can stand
next to the simulation of the very costs it ran with, not of forward 1 and backward 2.

- A compute's cost is its action's time less its wait for a received input (that wait is the
  bubble the simulator must reproduce, not a cost), the mean per (kind, stage): what the steps
  spent in total, which a loaded machine's rare long stalls lift above the median. The W of a
  backward the executor ran whole ("BW") only marks it done and is left out.
- A SEND's or RECV's cost is the time posting it held its rank.
- A message's transfer time is measured where the receiver was already waiting when the sender
  posted it: then the wait ended when the tensor arrived (time.perf_counter is one clock for all
  processes of a machine), counted from the end of the SEND, as the simulator counts it: below 0
  where the tensor arrived while the sender was still inside its send call (descheduled there on
  a loaded machine). Median over those messages; 0 when no receiver ever waited so.
- Each step also spends time outside the actions: before the first (splitting the batch) and
  after the last (the sends' completion and the loss all-reduce). `head_s` is the median lead-in;
  `tail_s` the median over steps of the shortest tail of any rank, as the rank finishing last
  waits on no one.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from tetrad.schedules import ActionCosts

Event = tuple[str, int, int, float, float]  # kind, stage, microbatch, start, end
COMPUTES = ("F", "B", "BW", "W")


@dataclass(frozen=True)
class MeasuredCosts:
    costs: ActionCosts
    head_s: float
    tail_s: float
    transfer_samples: int


def measured_costs(steps: Sequence[Sequence[Sequence[Event]]]) -> MeasuredCosts:
    """steps[step][rank]: that rank's events of one step."""
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    transfers, heads, tails = [], [], []
    for ranks in steps:
        sends, waits = {}, {}
        step_tails = []
        for events in ranks:
            step = next(e for e in events if e[0] == "STEP")
            actions = [e for e in events if e[0] not in ("STEP", "WAIT_F", "WAIT_B")]
            heads.append(actions[0][3] - step[3])
            step_tails.append(step[4] - actions[-1][4])
            whole = {(stage, mb) for kind, stage, mb, _, _ in actions if kind == "BW"}
            for kind, stage, mb, start, end in events:
                if kind.startswith("WAIT"):
                    waits[kind[-1], stage, mb] = (start, end)
                elif kind.startswith("SEND"):
                    sends[kind[-1], stage, mb] = end
            for kind, stage, mb, start, end in actions:
                if kind == "W" and (stage, mb) in whole:
                    continue
                waited = 0.0
                if kind in COMPUTES and (wait := waits.get(("F" if kind == "F" else "B",
                                                            stage, mb))) is not None:
                    if start <= wait[0] and wait[1] <= end:
                        waited = wait[1] - wait[0]
                samples[kind, stage].append(end - start - waited)
        tails.append(min(step_tails))
        for (direction, stage, mb), (wait_start, wait_end) in waits.items():
            sent = sends.get((direction, stage - 1 if direction == "F" else stage + 1, mb))
            if sent is not None and wait_start <= sent:
                transfers.append(wait_end - sent)
    costs = ActionCosts({key: statistics.fmean(values) for key, values in samples.items()},
                        statistics.median(transfers) if transfers else 0.0)
    return MeasuredCosts(costs, statistics.median(heads), statistics.median(tails),
                         len(transfers))
