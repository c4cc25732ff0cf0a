"""The search's speed-ups change no answer: the integer-clock simulation of a compute-only
schedule against the general Fraction simulator (_Run), and `plan train --json` with every
planner simulation run through _Run and the stage cache bypassed, byte for byte."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

import tetrad.planner.memory as memory
import tetrad.planner.timeline as timeline
from tetrad.cli.main import main
from tetrad.schedules import Durations, build_schedule, simulate
from tetrad.schedules.generate import SCHEDULES, SPLIT_BACKWARD
from tetrad.schedules.simulate import _Run, makespan

DURATIONS = (Durations(), Durations(1.0, 3.0), Durations(32, 70, 41, 29),
             Durations(Fraction(1, 3), Fraction(5, 7)), Durations(0.3, 0.7, 0.25, 0.45))


def _shapes():
    for name in SCHEDULES:
        for pp in (2, 3, 4):
            for m in (1, 2, 3, 4, 6, 8, 9):
                for vpp in ((2, 3) if name == "interleaved" else (1,)):
                    try:
                        yield build_schedule(name, pp, m, vpp, communication=False)
                    except Exception:  # a shape the schedule refuses (interleaved's m % pp)
                        continue


def _reference(schedule, durations, as_executed=False):
    run = _Run(schedule, durations, False, as_executed)
    run.go()
    return [[(s.action, s.start, s.end) for s in spans] for spans in run.spans], max(run.clock)


def test_integer_clocks_time_every_compute_as_the_fraction_simulator():
    checked = 0
    for schedule in _shapes():
        for durations in DURATIONS:
            split = durations.backward_input is not None
            if split and not schedule.split_backward:
                continue
            for as_executed in ((False, True) if schedule.split_backward else (False,)):
                spans, end = _reference(schedule, durations, as_executed)
                timed = simulate(schedule, durations, as_executed=as_executed)
                assert [[(s.action, s.start, s.end) for s in rank] for rank in timed.spans] \
                    == spans
                assert timed.makespan == end and isinstance(timed.makespan, Fraction)
            assert makespan(schedule, durations) == _reference(schedule, durations)[1]
            checked += 1
    assert checked > 200 and {s for s in SCHEDULES if s in SPLIT_BACKWARD}


def test_a_deadlocked_compute_order_still_names_each_stuck_rank():
    from tetrad.schedules import ScheduleError
    from tetrad.schedules.actions import Action, Schedule

    crossed = Schedule("crossed", 2, 1, 1, False, (
        (Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0))))
    with pytest.raises(ScheduleError, match="rank 0 at B0@s0"):
        simulate(crossed)
    with pytest.raises(ScheduleError, match="deadlocks"):
        makespan(crossed)


def _plan_json(capsys, args):
    for cached in (timeline._bubble_ratio, timeline._compute_order, timeline.pipeline_in_flight,
                   memory.representative_stages):
        getattr(cached, "cache_clear", lambda: None)()
    capsys.readouterr()
    main(["plan", "train", "--json", *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("args", [
    ["--model", "llama3-70b", "--gpu", "h100", "--num-gpus", "8192"],
    ["--model", "deepseek-v3", "--gpu", "h800", "--num-gpus", "16384"],
    ["--model", "llama3-8b", "--gpu", "a100", "--num-gpus", "64", "--schedule", "zb"],
    ["--model", "llama3-405b", "--gpu", "h100", "--num-gpus", "16384"],
])
def test_plan_json_is_what_the_fraction_simulator_gives(capsys, monkeypatch, args):
    fast = _plan_json(capsys, args)
    simulated = []

    def through_fraction_simulator(schedule, durations):
        simulated.append(schedule.name)
        return _reference(schedule, durations)[1]

    monkeypatch.setattr(timeline, "makespan", through_fraction_simulator)
    monkeypatch.setattr(memory, "representative_stages", memory.representative_stages.__wrapped__)
    reference = _plan_json(capsys, args)
    assert fast == reference
    assert any(config["step_time_s"]["bubble"] > 0 for config in fast["configs"])
    # Only the V schedules' bubbles are simulated; the others take their exact closed forms.
    if any(config["parallel"]["schedule"] in ("zbv", "dualpipe") for config in fast["configs"]):
        assert simulated


@pytest.mark.parametrize("schedule", ["zbv", "dualpipe"])
def test_plan_train_takes_the_v_schedules(capsys, schedule):
    """`tetrad plan train --schedule zbv|dualpipe`: every layout offered runs that schedule, two
    stages per rank in a V, with its own simulated bubble."""
    plan = _plan_json(capsys, ["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16",
                               "--schedule", schedule, "--top", "3"])
    assert plan["configs"]
    for config in plan["configs"]:
        parallel = config["parallel"]
        assert (parallel["schedule"], parallel["vpp"]) == (schedule, 2)
        assert parallel["pp"] > 1 and config["step_time_s"]["bubble"] > 0
