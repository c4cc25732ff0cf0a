"""Pipeline schedules as data: every schedule validates, runs without deadlock under blocking
send/recv, and reproduces the papers' bubble and memory results by simulation."""

import json
from fractions import Fraction

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.schedules import (Action, Durations, Schedule, ScheduleError, build_schedule,
                              peak_in_flight, render, simulate, validate)
from tetrad.schedules.generate import SCHEDULES, V_SHAPED

CASES = [(name, pp, 1, m) for name in ("naive", "gpipe", "1f1b", "zb") for pp in (1, 2, 4)
         for m in (1, 2, 3, 4, 8)]
CASES += [("interleaved", pp, vpp, m) for pp in (2, 4) for vpp in (2, 3) for m in (pp, 2 * pp, 12)
          if m % pp == 0]


def idle_per_rank(timeline):
    return [timeline.makespan - sum((s.end - s.start for s in spans), Fraction(0))
            for spans in timeline.spans]


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_every_schedule_is_valid_and_deadlock_free(name, pp, vpp, m):
    schedule = build_schedule(name, pp, m, vpp)
    validate(schedule)  # counts, F<B<W, send/recv pairing, blocking simulation completes
    # The executor's rule (isend, irecv waited on at use) gives the dependency-only timeline for
    # any durations, although the send/recv order was placed with the default ones.
    durations = Durations(forward=1.5, backward=2.5, backward_input=0.75)
    bare = Schedule(name, pp, vpp, m, schedule.split_backward,
                    tuple(tuple(filter(lambda a: a.is_compute, actions))
                          for actions in schedule.actions))
    assert simulate(schedule, durations).spans == simulate(bare, durations).spans


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_gpipe_and_1f1b_bubble_and_memory(pp, m):
    for name in ("gpipe", "1f1b"):
        timeline = simulate(build_schedule(name, pp, m))
        assert timeline.idle_time / (pp * timeline.makespan) == Fraction(pp - 1, m + pp - 1)
    assert simulate(build_schedule("gpipe", pp, m)).peak_in_flight == (m,) * pp
    peaks = simulate(build_schedule("1f1b", pp, m)).peak_in_flight
    assert max(peaks) <= pp and list(peaks) == [min(pp - rank, m) for rank in range(pp)]


def test_naive_runs_one_microbatch_at_a_time():
    timeline = simulate(build_schedule("naive", 4, 3))
    assert timeline.bubble_fraction == pytest.approx(3 / 4)
    assert timeline.peak_in_flight == (1, 1, 1, 1)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("vpp", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_divides_the_bubble_by_vpp(pp, vpp, rounds):
    m = rounds * pp
    interleaved = simulate(build_schedule("interleaved", pp, m, vpp))
    plain = simulate(build_schedule("1f1b", pp, m))
    assert interleaved.idle_time * vpp == plain.idle_time
    assert interleaved.makespan < plain.makespan
    # Megatron: rank r warms up with (vpp-1)*pp + 2*(pp-r-1) chunk forwards, then one more
    # forward before its first backward (Korthikanti et al. 2022, activation memory).
    assert list(interleaved.peak_in_flight) == [
        min(m * vpp, (vpp - 1) * pp + 2 * (pp - rank - 1) + 1) for rank in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_zero_bubble_h1_beats_1f1b_at_the_same_memory(pp, m):
    zb_schedule = build_schedule("zb", pp, m)
    zb, plain = simulate(zb_schedule), simulate(build_schedule("1f1b", pp, m))
    assert zb.bubble_fraction < plain.bubble_fraction
    assert zb.peak_in_flight == plain.peak_in_flight
    # W still needs some saved tensors: microbatches whose W is pending stay <= pp everywhere,
    # the peak 1F1B reaches on rank 0.
    assert max(peak_in_flight(zb_schedule, release="W")) == min(pp, m)
    if m >= pp:  # Qi et al. 2023: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) per rank
        durations = Durations(forward=1, backward=3, backward_input=2)
        timeline = simulate(zb_schedule, durations)
        assert idle_per_rank(timeline) == [Fraction((pp - 1) * (1 + 2 - 1))] * pp


def test_blocking_send_recv_next_to_each_compute_deadlocks_1f1b():
    """Why communication is placed by a global order: the obvious placement (receive right
    before the compute, send right after) deadlocks 1F1B when send and recv block."""
    good = build_schedule("1f1b", 2, 4)
    naive_order = []
    for actions in good.actions:
        computes = [a for a in actions if a.is_compute]
        comms = [a for a in actions if not a.is_compute]
        order = []
        for compute in computes:
            order += [c for c in comms if c.kind == "RECV_" + compute.kind
                      and (c.stage, c.microbatch) == (compute.stage, compute.microbatch)]
            order.append(compute)
            order += [c for c in comms if c.kind == "SEND_" + compute.kind
                      and (c.stage, c.microbatch) == (compute.stage, compute.microbatch)]
        naive_order.append(tuple(order))
    bad = Schedule("1f1b", 2, 1, 4, False, tuple(naive_order))
    simulate(bad)  # fine with isend / irecv
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(bad)


def _edit(schedule, rank, change):
    actions = [list(a) for a in schedule.actions]
    change(actions[rank])
    return Schedule(schedule.name, schedule.pp, schedule.vpp, schedule.microbatches,
                    schedule.split_backward, tuple(tuple(a) for a in actions))


def test_validator_names_broken_schedules():
    good = build_schedule("zb", 2, 4)
    last_w = next(i for i, a in reversed(list(enumerate(good.actions[0]))) if a.kind == "W")
    broken = {
        "missing W0@s0": lambda acts: acts.remove(Action("W", 0, 0)),
        "B0@s1 comes before F0@s1": lambda acts: acts.insert(0, acts.pop(
            acts.index(Action("B", 1, 0)))),
        "lives on rank 1": lambda acts: acts.append(Action("F", 1, 9)),
        "missing": lambda acts: acts.pop(last_w),
    }
    for message, change in broken.items():
        with pytest.raises(ScheduleError, match=message):
            validate(_edit(good, 1 if "s1" in message else 0, change))
    recvs = [i for i, a in enumerate(good.actions[1]) if a.kind == "RECV_F"]

    def swap_two_receives(acts):
        acts[recvs[1]], acts[recvs[2]] = acts[recvs[2]], acts[recvs[1]]

    with pytest.raises(ScheduleError, match="different orders|runs before"):
        validate(_edit(good, 1, swap_two_receives))


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 6, 2), "multiple of pp=4, got 6: use 4 or 8"),
    (("1f1b", 4, 8, 2), "--schedule interleaved or --vpp 1"),
    (("interleaved", 4, 8, 1), "--vpp >= 2"),
    (("interleaved", 1, 4, 2), "--pp >= 2"),
    (("gpipe", 0, 4, 1), "--pp must be >= 1"),
    (("gpipe", 2, 0, 1), "--microbatches must be >= 1"),
    (("zero", 2, 4, 1), "choose one of"),
])
def test_bad_input_says_what_to_change(args, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(*args)


def test_render_has_one_row_per_rank_and_one_column_per_unit():
    timeline = simulate(build_schedule("1f1b", 4, 8))
    rows = [line for line in render(timeline).splitlines() if line.startswith("rank")]
    assert len(rows) == 4
    for rank, row in enumerate(rows):
        cells = row.split()[2:]  # drop "rank", "r"
        busy = sum(s.end - s.start for s in timeline.spans[rank])
        assert len([c for c in cells if c != "."]) == busy
        assert len(cells) <= timeline.makespan


def test_cli_prints_timeline_json_and_png(capsys, tmp_path):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    assert "bubble fraction 0.273" in capsys.readouterr().out
    png = tmp_path / "zb.png"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb", "--json",
                 "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"schedule", "pp", "vpp", "microbatches", "actions", "timeline", "bubble_fraction",
            "peak_in_flight", "makespan"} <= set(report)
    assert report["peak_in_flight"] == [2, 1] and png.read_bytes()[:4] == b"\x89PNG"
    assert {a["kind"] for a in report["actions"]["0"]} == {"F", "B", "W", "SEND_F", "RECV_B"}
    assert main(["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                 "--vpp", "2"]) == 2
    assert "multiple of pp=4" in capsys.readouterr().err


def test_every_schedule_has_a_cli_choice(capsys):
    for name in SCHEDULES:
        extra = ["--vpp", "2"] if name in ("interleaved", *V_SHAPED) else []
        assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", name,
                     *extra]) == 0, name
    capsys.readouterr()


def _reference_ends(schedule, durations):
    """Each compute ends its own duration after the latest of: the rank's previous compute, the
    same stage's earlier pass (F before B before W) and the neighbouring stage's pass it consumes
    -- worked out by recursion, independently of the simulator's event loop."""
    computes = [[a for a in actions if a.is_compute] for actions in schedule.actions]
    index = {action: (rank, i) for rank, actions in enumerate(computes)
             for i, action in enumerate(actions)}
    last = schedule.num_stages - 1
    part_input, part_weight = durations.split()
    lengths = {"F": Fraction(durations.forward),
               "B": part_input if schedule.split_backward else Fraction(durations.backward),
               "W": part_weight}
    ends = {}

    def end(action):
        if action not in ends:
            rank, i = index[action]
            ready = [end(computes[rank][i - 1])] if i else []
            if action.kind == "B":
                ready.append(end(Action("F", action.stage, action.microbatch)))
            if action.kind == "W":
                ready.append(end(Action("B", action.stage, action.microbatch)))
            if action.kind == "F" and action.stage > 0:
                ready.append(end(Action("F", action.stage - 1, action.microbatch)))
            if action.kind == "B" and action.stage < last:
                ready.append(end(Action("B", action.stage + 1, action.microbatch)))
            ends[action] = max(ready, default=Fraction(0)) + lengths[action.kind] / schedule.vpp
        return ends[action]

    return {action: end(action) for action in index}


@pytest.mark.parametrize("name,pp,vpp,m", [case for case in CASES if case[1] > 1])
def test_simulated_times_equal_an_independent_recursion(name, pp, vpp, m):
    durations = Durations(forward=1.5, backward=2.5, backward_input=0.75)
    schedule = build_schedule(name, pp, m, vpp)
    timeline = simulate(schedule, durations)
    expected = _reference_ends(schedule, durations)
    simulated = {span.action: span.end for spans in timeline.spans for span in spans}
    assert simulated == expected
    assert timeline.makespan == max(expected.values())
    for spans in timeline.spans:
        for span in spans:
            assert span.end - span.start == durations.of(span.action.kind, schedule)
    assert simulate(schedule, durations, blocking=True).makespan >= timeline.makespan
