"""ASCII picture of a timeline: one row per rank, one column per time unit."""

from __future__ import annotations

import math
from fractions import Fraction

from tetrad.schedules.simulate import Timeline

MAX_COLUMNS = 240  # beyond this a terminal wraps; columns then round to the nearest time


def label(kind: str, microbatch: int, chunk: int, vpp: int) -> str:
    """`F3`, or `F3b` for chunk 1 of an interleaved rank."""
    return f"{kind}{microbatch}" + (chr(ord("a") + chunk) if vpp > 1 else "")


def number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


def column_unit(timeline: Timeline) -> tuple[Fraction, bool]:
    """The largest time step that puts every action boundary on a column edge, and True; or,
    when that step would be much finer than the shortest action (durations such as 2.37) or the
    row too long, a coarser step with boundaries rounded to it, and False."""
    spans = [s for rank_spans in timeline.spans for s in rank_spans]
    if not spans:
        return Fraction(1), True
    points = [t for s in spans for t in (s.start, s.end)]
    denominator = math.lcm(*(p.denominator for p in points))
    exact = Fraction(math.gcd(*(int(p * denominator) for p in points)), denominator)
    shortest = min(s.end - s.start for s in spans)
    unit = exact if exact * 4 >= shortest else shortest / 2
    unit = max(unit, timeline.makespan / MAX_COLUMNS)
    return unit, unit == exact


def render(timeline: Timeline) -> str:
    schedule = timeline.schedule
    unit, exact = column_unit(timeline)
    num_columns = math.ceil(timeline.makespan / unit)
    rows = []
    for spans in timeline.spans:
        cells = ["."] * num_columns
        for span in spans:
            text = label(span.action.kind, span.action.microbatch,
                         schedule.chunk_of(span.action.stage), schedule.vpp)
            first, last = round(span.start / unit), round(span.end / unit)
            for column in range(first, max(last, first + 1)):
                cells[min(column, num_columns - 1)] = text
        rows.append(cells)
    width = max(len(cell) for row in rows for cell in row) + 1
    tick_every = 5 if num_columns <= 80 else 10
    axis = "".join(number(column * unit).ljust(width * tick_every)
                   for column in range(0, num_columns, tick_every))
    prefix = f"rank {schedule.pp - 1}  "
    lines = [_legend(timeline, unit, exact), "time".ljust(len(prefix)) + axis.rstrip()]
    lines += [f"rank {rank}".ljust(len(prefix)) + "".join(cell.ljust(width) for cell in row)
              .rstrip() for rank, row in enumerate(rows)]
    lines.append(f"makespan {number(timeline.makespan)}, bubble fraction "
                 f"{timeline.bubble_fraction:.3f} (idle {number(timeline.idle_time)} of "
                 f"{number(schedule.pp * timeline.makespan)} rank-time units)")
    held = "(chunk, microbatch) pairs" if schedule.vpp > 1 else "microbatches"
    lines.append(f"peak in-flight {held} per rank: "
                 + " ".join(str(peak) for peak in timeline.peak_in_flight))
    return "\n".join(lines)


def _legend(timeline: Timeline, unit: Fraction, exact: bool) -> str:
    schedule = timeline.schedule
    kinds = ("F forward, B backward for inputs, W backward for weights" if schedule.split_backward
             else "F forward, B backward")
    chunks = (f", letter = model chunk on the rank (a = stages 0..{schedule.pp - 1})"
              if schedule.vpp > 1 else "")
    return (f"{schedule.name}  pp={schedule.pp} vpp={schedule.vpp} "
            f"microbatches={schedule.microbatches}  (one column = {number(unit)} time unit"
            f"{'' if exact else ', times rounded'}; "
            f"{kinds}; number = microbatch{chunks}; . idle)")
