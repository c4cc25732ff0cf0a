"""The simulator's per-action costs: stage-by-stage seconds and the time a message takes."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from tetrad.errors import ConfigError
from tetrad.schedules import ActionCosts, Durations, build_schedule, simulate
from tetrad.schedules.simulate import whole_backwards

LAYOUTS = [("gpipe", 2, 4, 1), ("1f1b", 3, 6, 1), ("interleaved", 2, 4, 2), ("zb", 3, 6, 1),
           ("zbv", 2, 4, 2), ("dualpipe", 2, 4, 2)]


def _uniform(schedule, durations: Durations) -> ActionCosts:
    """The costs that say what `durations` says, stage by stage."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    seconds = {(kind, stage): float(durations.of(kind, schedule))
               for kind in kinds for stage in range(schedule.num_stages)}
    if schedule.split_backward:
        seconds.update({("BW", stage): float(durations.of("B", schedule)
                                             + durations.of("W", schedule))
                        for stage in range(schedule.num_stages)})
    return ActionCosts(seconds)


@pytest.mark.parametrize("name,pp,microbatches,vpp", LAYOUTS)
@pytest.mark.parametrize("as_executed", [False, True])
def test_uniform_costs_give_the_durations_timeline(name, pp, microbatches, vpp, as_executed):
    durations = Durations(forward=1.5, backward=2.5, backward_input=1.0)
    schedule = build_schedule(name, pp, microbatches, vpp)
    expected = simulate(schedule, durations, as_executed=as_executed)
    timed = simulate(schedule, costs=_uniform(schedule, durations), as_executed=as_executed)
    assert timed.spans == expected.spans and timed.makespan == expected.makespan


def test_one_microbatch_walks_every_cost_in_order():
    # Rank 0: F0, SEND_F, RECV_B, B0; rank 1: RECV_F, F1, B1, SEND_B. Each cost is a distinct
    # power of two, so the makespan names every term it holds.
    schedule = build_schedule("gpipe", 2, 1, 1)
    seconds = {("F", 0): 1, ("F", 1): 2, ("B", 0): 4, ("B", 1): 8, ("SEND_F", 0): 16,
               ("RECV_F", 1): 32, ("SEND_B", 1): 64, ("RECV_B", 0): 128}
    timeline = simulate(schedule, costs=ActionCosts(seconds, transfer=256))
    # F0 + SEND_F + transfer (RECV_F was posted at 32, before the tensor arrived at 273)
    # + F1 + B1 + SEND_B + transfer + B0; RECV_B's 128 on rank 0 ends before the arrival.
    assert timeline.makespan == 1 + 16 + 256 + 2 + 8 + 64 + 256 + 4
    assert [span.end - span.start for span in timeline.spans[1]] == [2, 8]


def test_the_slower_last_stage_sets_the_1f1b_steady_state():
    schedule = build_schedule("1f1b", 2, 8, 1)
    even = simulate(schedule, costs=ActionCosts({("F", 0): 1, ("F", 1): 1, ("B", 0): 2,
                                                 ("B", 1): 2}))
    heavy = simulate(schedule, costs=ActionCosts({("F", 0): 1, ("F", 1): 2, ("B", 0): 2,
                                                  ("B", 1): 3}))
    # Rank 1 never waits after its first forward: its F+B of 5 per microbatch sets the pace.
    assert even.makespan == 1 + 8 * 3 + 2
    assert heavy.makespan == 1 + 8 * 5 + 2
    assert heavy.spans[1][0].start == 1


def test_a_bare_compute_order_hands_tensors_over_after_the_transfer():
    built = build_schedule("gpipe", 2, 1, 1)
    bare = replace(built, actions=tuple(tuple(a for a in rank if a.is_compute)
                                        for rank in built.actions))
    costs = {("F", 0): 1, ("F", 1): 1, ("B", 0): 1, ("B", 1): 1}
    timeline = simulate(bare, costs=ActionCosts(costs, transfer=0.5))
    assert not bare.has_communication and timeline.makespan == 4 + 2 * Fraction(1, 2)


def test_a_compute_without_a_cost_and_blocking_mode_are_refused():
    schedule = build_schedule("gpipe", 2, 1, 1)
    with pytest.raises(ConfigError, match="no cost for B of stage 1"):
        simulate(schedule, costs=ActionCosts({("F", 0): 1, ("F", 1): 1, ("B", 0): 1}))
    with pytest.raises(ConfigError, match="asynchronous"):
        simulate(schedule, blocking=True, costs=ActionCosts({}))


def test_a_stage_whose_every_backward_runs_whole_needs_no_split_cost():
    schedule = build_schedule("zbv", 2, 4, 2)
    durations = Durations(forward=1.0, backward=2.0)
    costs = _uniform(schedule, durations)
    whole = whole_backwards(schedule)
    stage = next(s for s in range(schedule.num_stages)
                 if all(a in whole for actions in schedule.actions for a in actions
                        if a.kind == "B" and a.stage == s))
    whole_only = {key: value for key, value in costs.seconds.items()
                  if not (key[0] in ("B", "W") and key[1] == stage)}
    expected = simulate(schedule, durations, as_executed=True)
    timed = simulate(schedule, costs=ActionCosts(whole_only), as_executed=True)
    assert timed.spans == expected.spans


def test_measured_costs_read_the_executors_events():
    from tetrad.parallel.pipeline.measured import measured_costs

    rank0 = [("STEP", -1, -1, 0.0, 100.0), ("F", 0, 0, 1.0, 11.0), ("SEND_F", 0, 0, 11.0, 12.0),
             ("RECV_B", 0, 0, 12.0, 13.0), ("WAIT_B", 0, 0, 13.0, 30.0),
             ("BW", 0, 0, 13.0, 40.0), ("W", 0, 0, 40.0, 40.5)]
    rank1 = [("STEP", -1, -1, 0.2, 99.0), ("RECV_F", 1, 0, 0.5, 1.0), ("WAIT_F", 1, 0, 1.0, 14.0),
             ("F", 1, 0, 1.0, 20.0), ("B", 1, 0, 20.0, 28.0), ("SEND_B", 1, 0, 28.0, 29.0),
             ("W", 1, 0, 29.0, 33.0)]
    measured = measured_costs([[rank0, rank1]])
    # Waits are the bubble, not a cost; the W of a whole backward only marks it done.
    assert measured.costs.seconds == {
        ("F", 0): 10.0, ("SEND_F", 0): 1.0, ("RECV_B", 0): 1.0, ("BW", 0): 10.0,
        ("RECV_F", 1): 0.5, ("F", 1): 6.0, ("B", 1): 8.0, ("SEND_B", 1): 1.0, ("W", 1): 4.0}
    # Both receivers waited before the send: arrivals 2 and 1 after the sends.
    assert measured.costs.transfer == 1.5 and measured.transfer_samples == 2
    assert measured.head_s == pytest.approx(0.65) and measured.tail_s == pytest.approx(59.5)
