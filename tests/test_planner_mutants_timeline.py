"""The planner's step arithmetic and the schedule pictures, each against its own definition: the
bubble of durations on the planner's grid against the exact simulation, which schedules are
simulated and which take a closed form, overlap, the picture's cells re-derived from the spans,
and the durations' split of the backward."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from tetrad.errors import ConfigError
from tetrad.planner import timeline as planner_timeline
from tetrad.planner.parameter_server import Traffic
from tetrad.planner.search import SearchResult, ServeSpace, TrainSpace
from tetrad.planner.timeline import (StepTime, bubble_fraction_of_step, overlapped,
                                     pipeline_bubble_ratio, pipeline_in_flight)
from tetrad.schedules import Action, Durations, build_schedule, render, simulate


def _exact_ratio(name: str, pp: int, m: int, vpp: int, durations: Durations) -> Fraction:
    """Idle over busy time of the simulated schedule: the step takes (1 + ratio) x the ideal."""
    schedule = build_schedule(name, pp, m, vpp)
    timeline = simulate(schedule, durations)
    busy = sum((s.end - s.start for s in timeline.spans[0]), Fraction(0))
    return timeline.makespan / busy - 1


def test_default_times_are_a_forward_and_a_backward_of_twice_it_split_in_halves():
    for name, vpp in (("zb", 1), ("1f1b", 1), ("interleaved", 2)):
        assert pipeline_bubble_ratio(name, 4, 8, vpp) == float(_exact_ratio(
            name, 4, 8, vpp, Durations(forward=1, backward=2, backward_input=1)))


@pytest.mark.parametrize("forward,backward,weight", [
    (1.0, 2.03125, 0.5),  # every time a multiple of 1/32 of the forward: no rounding
    (2.0, 4.5, 1.25),
    (0.5, 1.25, 0.5),
])
def test_zero_bubble_times_on_the_grid_give_the_exact_simulated_bubble(forward, backward, weight):
    expected = _exact_ratio("zb", 4, 8, 1, Durations(forward, backward, backward - weight, weight))
    assert pipeline_bubble_ratio("zb", 4, 8, 1, forward, backward, weight) == pytest.approx(
        float(expected), rel=1e-12)


def test_a_weight_pass_below_half_a_grid_step_still_takes_one():
    """Times are rounded to 1/32 of the forward, but a pass never to nothing (a duration must
    be positive): W = 0.001 of the forward runs as 1/32 of it, B - W = 1.999 as 64/32."""
    tiny = pipeline_bubble_ratio("zb", 4, 8, 1, forward=1.0, backward=2.0, backward_weight=1e-3)
    grid = Fraction(1, 32)
    assert tiny == pytest.approx(float(_exact_ratio("zb", 4, 8, 1, Durations(
        1, 2 + grid, 2, grid))), rel=1e-12)


@pytest.mark.parametrize("name,pp,m,vpp", [
    ("1f1b", 8, 256, 1), ("gpipe", 8, 96, 1), ("interleaved", 8, 256, 2), ("1f1b", 4, 3, 1),
    ("interleaved", 4, 8, 3)])
def test_uniform_stages_have_the_papers_bubble_whatever_the_times(name, pp, m, vpp):
    """Idle over ideal time is (p-1)/m for GPipe and 1F1B and (p-1)/(v m) interleaved (m >= p;
    Huang et al. 2019, Narayanan et al. 2021), from the closed forms the planner takes."""
    expected = (pp - 1) / (m * (vpp if m >= pp else 1))
    for forward, backward in ((1.0, 2.0), (1.0, 2.3), (0.5, 3.0)):
        assert pipeline_bubble_ratio(name, pp, m, vpp, forward, backward) == pytest.approx(
            expected, rel=1e-12)


@pytest.mark.parametrize("name,pp,m,vpp,weight,simulated", [
    ("1f1b", 4, 128, 1, None, False),
    ("gpipe", 4, 3, 1, None, False),
    ("interleaved", 4, 8, 2, None, False),
    ("zb", 4, 85, 1, 0.5, False),
    ("zb", 11, 31, 1, 1.5, True),  # W > F: the closed form does not hold, so it is simulated
    ("zbv", 4, 8, 2, 0.5, True),  # the V schedules' bubble has no closed form
])
def test_schedules_with_a_closed_form_are_never_simulated(monkeypatch, name, pp, m, vpp, weight,
                                                          simulated):
    """The module doc's promise: the closed forms answer wherever they are exact for the
    durations; only the rest is simulated (the in-flight peaks, the V schedules' included, never
    are for these shapes)."""
    calls = []
    makespan_real, peaks_real = planner_timeline.makespan, planner_timeline.peak_in_flight
    monkeypatch.setattr(planner_timeline, "makespan",
                        lambda *a, **k: calls.append("bubble") or makespan_real(*a, **k))
    monkeypatch.setattr(planner_timeline, "peak_in_flight",
                        lambda *a, **k: calls.append("in flight") or peaks_real(*a, **k))
    pipeline_in_flight.cache_clear()
    # A backward of 2 + 3/32 forwards: no other test asks for it, so no cached ratio answers.
    pipeline_bubble_ratio(name, pp, m, vpp, forward=1.0, backward=2.09375, backward_weight=weight)
    pipeline_in_flight(name, pp, m, vpp)
    assert calls == (["bubble"] if simulated else [])


def test_overlap_hides_communication_up_to_the_compute_window():
    assert overlapped(3.0, 5.0, True) == 0.0  # hidden entirely, and no interference by default
    assert overlapped(5.0, 3.0, True) == 2.0  # what sticks out of the window
    assert overlapped(5.0, 3.0, False) == 5.0
    # NCCL's kernels slow the compute they hide behind by `interference` of the comm time
    assert overlapped(4.0, 10.0, True, interference=0.5) == 2.0
    assert overlapped(4.0, 1.0, True, interference=0.5) == 3.0


def test_a_step_is_the_sum_of_its_parts_and_the_bubble_its_share():
    step = StepTime(compute=3.0, communication_exposed=0.5, bubble=1.5)
    assert step.total == 5.0
    assert step.as_dict() == {"total": 5.0, "compute": 3.0, "communication_exposed": 0.5,
                              "bubble": 1.5}
    # idle / ideal = r: the step is (1 + r) ideal, the bubble r of it
    for ideal, idle in ((4.0, 1.0), (3.0, 3.0), (10.0, 0.0)):
        assert bubble_fraction_of_step(idle / ideal) == pytest.approx(idle / (ideal + idle))


def test_values_shared_between_callers_cannot_be_changed():
    """The planner caches schedules and hands the same objects to every caller: a caller that
    could change one would change it for all."""
    schedule = build_schedule("1f1b", 2, 2)
    timeline = simulate(schedule)
    values = [schedule, schedule.actions[0][0], timeline, timeline.spans[0][0], Durations(),
              StepTime(1.0, 0.0, 0.0), TrainSpace(), ServeSpace(), SearchResult([], 0, 0),
              Traffic(0.0, 0.0, 0.0, 0.0, 0.0)]
    for value in values:
        field = dataclasses.fields(value)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    hash(schedule), hash(timeline.spans[0][0])  # usable as cache keys


def test_split_backward_parts_default_to_what_the_other_leaves():
    assert Durations(backward=3).split() == (Fraction(3, 2), Fraction(3, 2))
    assert Durations(backward=3, backward_weight=1).split() == (2, 1)
    assert Durations(backward=3, backward_input=1).split() == (1, 2)
    assert Durations(backward=3, backward_input=1, backward_weight=1).split() == (1, 1)
    zb, plain = build_schedule("zb", 2, 2), build_schedule("interleaved", 2, 2, 2)
    times = Durations(forward=3, backward=5, backward_input=4)
    assert [times.of(kind, zb) for kind in "FBW"] == [3, 4, 1]
    assert [times.of(kind, plain) for kind in "FB"] == [Fraction(3, 2), Fraction(5, 2)]


@pytest.mark.parametrize("changes,message", [
    (dict(forward=0), "forward duration must be > 0"),
    (dict(backward=-1), "backward duration must be > 0"),
    (dict(backward=2, backward_input=2), "leaves nothing"),
    (dict(backward=2, backward_weight=3), "leaves nothing"),
])
def test_durations_that_cannot_be_timed_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        Durations(**changes)


def _cells(line: str, start: int, width: int, columns: int) -> list[str]:
    padded = line.ljust(start + width * columns)
    return [padded[start + i * width:start + (i + 1) * width].strip() for i in range(columns)]


@pytest.mark.parametrize("name,pp,m,vpp,durations,unit", [
    ("1f1b", 4, 40, 1, Durations(), 1),  # 129 columns: a tick every 10
    ("1f1b", 2, 4, 1, Durations(), 1),  # 15 columns: a tick every 5
    ("interleaved", 2, 4, 2, Durations(1.5, 2.5), Fraction(1, 4)),
    ("zb", 3, 3, 1, Durations(2, 3.5, 2), Fraction(1, 2)),
])
def test_the_picture_shows_each_span_in_the_columns_it_covers(name, pp, m, vpp, durations,
                                                             unit):
    """One column per `unit` (the largest step every start and end falls on); a column shows
    the span covering its middle, or `.`; a tick every 5 columns (10 past 80 columns)."""
    schedule = build_schedule(name, pp, m, vpp)
    timeline = simulate(schedule, durations)
    lines = render(timeline).splitlines()
    columns = int(timeline.makespan / unit)
    assert f"one column = {float(unit):g} time unit;" in lines[0]
    labels = [f"{s.action.kind}{s.action.microbatch}" + ("ab"[s.action.stage // pp] if vpp > 1
                                                          else "")
              for spans in timeline.spans for s in spans]
    width = max(map(len, labels)) + 1
    start = len(f"rank {pp - 1}  ")
    for rank, spans in enumerate(timeline.spans):
        expected = []
        for column in range(columns):
            middle = (column + Fraction(1, 2)) * unit
            covering = [s for s in spans if s.start < middle < s.end]
            expected.append(f"{covering[0].action.kind}{covering[0].action.microbatch}"
                            + ("ab"[covering[0].action.stage // pp] if vpp > 1 else "")
                            if covering else ".")
        assert lines[2 + rank].startswith(f"rank {rank}")
        assert _cells(lines[2 + rank], start, width, columns) == expected
        assert len(lines[2 + rank].rstrip()) <= start + width * columns
    every = 5 if columns <= 80 else 10
    ticks = _cells(lines[1], start, width * every, -(-columns // every))
    assert lines[1].startswith("time") and ticks == [
        f"{float(c * unit):g}" for c in range(0, columns, every)]
    idle = timeline.idle_time
    assert lines[2 + pp] == (f"makespan {float(timeline.makespan):g}, bubble fraction "
                             f"{float(idle / (pp * timeline.makespan)):.3f} (idle "
                             f"{float(idle):g} of {float(pp * timeline.makespan):g} rank-time "
                             f"units)")
    held = "(chunk, microbatch) pairs" if vpp > 1 else "microbatches"
    assert lines[3 + pp] == (f"peak in-flight {held} per rank: "
                             + " ".join(map(str, timeline.peak_in_flight)))
    assert ("letter = model chunk" in lines[0]) == (vpp > 1)
    assert ("W backward for weights" in lines[0]) == (name == "zb")


def test_times_off_any_coarse_grid_are_rounded_to_half_the_shortest_pass():
    """2.01 puts the exact step at 0.01: 300 columns a microbatch would hide the picture, so
    a column is half the shortest pass (the forward) and the legend says times are rounded."""
    timeline = simulate(build_schedule("1f1b", 2, 2), Durations(forward=1, backward=2.01))
    legend = render(timeline).splitlines()[0]
    assert "one column = 0.5 time unit, times rounded;" in legend
    exact = simulate(build_schedule("1f1b", 2, 2), Durations(forward=1, backward=2.5))
    assert "one column = 0.5 time unit;" in render(exact).splitlines()[0]


def test_long_timelines_fit_in_240_columns():
    timeline = simulate(build_schedule("1f1b", 2, 200))  # makespan 603 time units
    lines = render(timeline).splitlines()
    unit = timeline.makespan / 240
    assert f"one column = {float(unit):g} time unit, times rounded;" in lines[0]
    width = len("F199") + 1
    for row in lines[2:4]:
        assert len(row.rstrip()) <= len("rank 1  ") + 240 * width


def test_an_action_reads_as_kind_microbatch_stage_and_peer():
    assert str(Action("F", 2, 3)) == "F3@s2"
    assert str(Action("SEND_B", 1, 0, peer=0)) == "SEND_B0@s1:r0"
    assert Action("W", 0, 1).is_compute and not Action("RECV_F", 1, 1, 0).is_compute
    schedule = build_schedule("interleaved", 2, 2, 2)
    assert (schedule.num_stages, schedule.rank_of(3), schedule.chunk_of(3)) == (4, 1, 1)
    assert build_schedule("1f1b", 2, 2).has_communication
    assert not build_schedule("1f1b", 2, 2, communication=False).has_communication
    assert not build_schedule("1f1b", 1, 2).has_communication
