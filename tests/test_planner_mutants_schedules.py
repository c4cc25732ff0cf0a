"""Schedules the generators never build, against what the simulator and validator must say of
them: chunks that share a rank, a compute ahead of its receive, each kind of broken list; and the
documented default durations (forward 1, backward 2: docs/pipeline.md)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tetrad.schedules import Action, Schedule, ScheduleError, build_schedule, simulate, validate


def _schedule(pp: int, vpp: int, microbatches: int, actions, split: bool = False) -> Schedule:
    return Schedule("hand", pp, vpp, microbatches, split, tuple(map(tuple, actions)))


def _replace(schedule: Schedule, rank: int, actions) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return _schedule(schedule.pp, schedule.vpp, schedule.microbatches, lists,
                     schedule.split_backward)


def test_default_durations_are_a_forward_of_1_and_a_backward_of_2_split_in_halves():
    one = simulate(build_schedule("naive", 1, 1))
    assert [(s.action.kind, s.end - s.start) for s in one.spans[0]] == [("F", 1), ("B", 2)]
    split = simulate(build_schedule("zb", 1, 1))
    assert [(s.action.kind, s.end - s.start) for s in split.spans[0]] == [
        ("F", 1), ("B", 1), ("W", 1)]


def test_a_schedule_of_no_ranks_takes_no_time():
    assert simulate(_schedule(0, 1, 0, [])).makespan == 0


def test_two_chunks_on_one_rank_hand_their_tensors_over_in_memory():
    """A rank holding stages 0 and 1 (pp 1, vpp 2): each chunk takes half the times, and stage
    1 cannot start before stage 0 has produced its input."""
    stage = [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]
    timeline = simulate(_schedule(1, 2, 1, [stage]))
    assert [(s.start, s.end) for s in timeline.spans[0]] == [
        (0, Fraction(1, 2)), (Fraction(1, 2), 1), (1, 2), (2, 3)]
    assert timeline.idle_time == 0 and timeline.bubble_fraction == 0.0
    with pytest.raises(ScheduleError, match=r"needs F0@s0"):
        simulate(_schedule(1, 2, 1, [[stage[1], stage[0], stage[2], stage[3]]]))


def test_a_compute_listed_before_the_receive_of_its_input_deadlocks():
    good = build_schedule("1f1b", 2, 2)
    actions = list(good.actions[1])
    recv = next(i for i, a in enumerate(actions) if a.kind == "RECV_F")
    actions.insert(recv + 1, actions.pop(recv))  # the RECV now follows the forward it feeds
    with pytest.raises(ScheduleError, match="no RECV of its input was posted before it"):
        simulate(_replace(good, 1, actions))


def test_a_receive_from_a_rank_that_has_finished_deadlocks_under_blocking_send_recv():
    good = build_schedule("1f1b", 2, 1)
    extra = next(a for a in good.actions[1] if a.kind == "RECV_F")
    with pytest.raises(ScheduleError, match=r"rank 1 at RECV_F0@s1:r0: blocks until rank 0"):
        simulate(_replace(good, 1, [*good.actions[1], extra]), blocking=True)


def test_idle_time_is_each_ranks_gap_to_the_makespan_and_the_json_lists_every_span():
    timeline = simulate(build_schedule("1f1b", 3, 4))
    gaps = [timeline.makespan - sum((s.end - s.start for s in spans), Fraction(0))
            for spans in timeline.spans]
    assert timeline.idle_time == sum(gaps) > 0
    assert timeline.bubble_fraction == pytest.approx(float(sum(gaps) / (3 * timeline.makespan)))
    out = timeline.to_dict()
    assert out["makespan"] == float(timeline.makespan)
    assert out["bubble_fraction"] == timeline.bubble_fraction
    for rank, spans in enumerate(timeline.spans):
        assert out["timeline"][str(rank)] == [
            {"kind": s.action.kind, "stage": s.action.stage, "microbatch": s.action.microbatch,
             "start": float(s.start), "end": float(s.end)} for s in spans]


def _without(actions, *drop):
    return [a for a in actions if a not in drop]


def test_the_validator_names_each_kind_of_broken_list():
    good = build_schedule("1f1b", 2, 4)
    rank0, rank1 = list(good.actions[0]), list(good.actions[1])
    sends = [a for a in rank0 if a.kind == "SEND_F"]
    cases = {
        "1 action lists for pp=2": _schedule(2, 1, 4, [rank0]),
        "names a stage outside 0..1": _replace(good, 1, rank1 + [Action("F", 2, 0)]),
        r"repeated F0@s0": _replace(good, 0, [Action("F", 0, 0)] + rank0),
        r"unexpected F7@s0": _replace(good, 0, rank0 + [Action("F", 0, 7)]),
        r"is not a needed send/receive": _replace(good, 0, rank0 + [sends[0]]),
        r"rank 0 is missing SEND_F3@s0:r1": _replace(good, 0, _without(rank0, sends[3])),
        r"SEND_F0@s0:r1 comes before F0@s0": _replace(
            good, 0, [sends[0]] + _without(rank0, sends[0])),
    }
    for message, schedule in cases.items():
        with pytest.raises(ScheduleError, match=message):
            validate(schedule)


def test_missing_actions_are_named_three_at_a_time():
    """The first three problems, not a wall of text: four missing backwards name three."""
    good = build_schedule("gpipe", 1, 4)
    backwards = [a for a in good.actions[0] if a.kind == "B"]
    with pytest.raises(ScheduleError) as error:
        validate(_replace(good, 0, _without(good.actions[0], *backwards)))
    assert str(error.value).count("missing B") == 3


def test_every_generated_schedule_holds_each_compute_once_in_dependency_order():
    """F before B before W on every (stage, microbatch), each exactly once, on the rank the
    stage lives on: checked here by hand, beside the validator's own checks."""
    for name, pp, vpp, m in (("naive", 3, 1, 2), ("gpipe", 3, 1, 3), ("1f1b", 4, 1, 6),
                             ("zb", 3, 1, 5), ("interleaved", 2, 3, 4)):
        schedule = build_schedule(name, pp, m, vpp, communication=False)
        kinds = "FBW" if name == "zb" else "FB"
        for rank, actions in enumerate(schedule.actions):
            assert len(actions) == len(set(actions)) == len(kinds) * vpp * m
            position = {a: i for i, a in enumerate(actions)}
            for stage in range(rank, pp * vpp, pp):
                for mb in range(m):
                    order = [position[Action(kind, stage, mb)] for kind in kinds]
                    assert order == sorted(order)
