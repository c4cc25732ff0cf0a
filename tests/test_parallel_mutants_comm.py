"""The byte, call and wait bookkeeping of tetrad.parallel.comm, in one process (no ranks spawned):
the numbers the run report prints are checked against counts made by hand, so a swapped operator
or a moved boundary in the counter shows up here rather than as a plausible wrong report."""

import datetime
import time
from fractions import Fraction

import pytest
import torch

from tetrad.parallel.comm import DONE, KINDS, Comm, CommCounter, Handle, ring_volume
from tetrad.parallel.mesh import Group


def ring_bytes_by_simulation(kind: str, nbytes: int, size: int) -> Fraction:
    """Bytes one rank sends, counted step by step: a ring reduce-scatter or all-gather passes one
    S/N chunk per step for N-1 steps, an all-reduce is one of each, and all-to-all or a broadcast
    chain sends every share but the rank's own (averaged over the ranks for the chain)."""
    chunk = Fraction(nbytes, size)
    steps = {"all_reduce": 2 * (size - 1), "reduce_scatter": size - 1, "all_gather": size - 1,
             "all_to_all": size - 1, "broadcast": size - 1}
    return chunk * steps[kind]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_ring_volumes_equal_the_step_by_step_count(size):
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"):
        assert ring_volume(kind, 1200, size) == ring_bytes_by_simulation(kind, 1200, size), kind
    assert ring_volume("p2p", 1200, size) == (0 if size == 1 else 1200)
    with pytest.raises(ValueError, match="unknown collective kind"):
        ring_volume("gossip", 1200, 2 if size == 1 else size)


def test_per_step_totals_divide_by_the_steps_and_leave_out_off_step_tags():
    counter = CommCounter()
    for step in range(4):
        counter.record("all_reduce", 300, "grads")
        counter.record("all_reduce", Fraction(1, 3), "grads", calls=0)  # more of the same call
        counter.record("all_gather", 40, "params", calls=2)
        counter.record("broadcast", 10_000, "checkpoint")
        counter.record("all_gather", 7, "report")
        counter.end_step()
    assert counter.steps == 4
    assert counter.totals()["broadcast"] == 40_000
    assert counter.totals(("grads",)) == {**dict.fromkeys(KINDS, 0),
                                          "all_reduce": 4 * 300 + Fraction(4, 3)}
    assert counter.totals_per_step() == {**dict.fromkeys(KINDS, 0), "all_reduce": 300,
                                         "all_gather": 40}
    assert counter.calls_per_step() == {**dict.fromkeys(KINDS, 0), "all_reduce": 1,
                                        "all_gather": 2}
    assert counter.tags() == {"grads", "params", "checkpoint", "report"}
    counter.reset()
    assert counter.steps == 0 and counter.tags() == set() and counter.exposed_per_step() is None
    assert counter.totals_per_step() == dict.fromkeys(KINDS, 0)


def test_exposed_time_is_the_median_after_the_first_step_without_off_step_waits():
    counter = CommCounter()
    assert counter.exposed_per_step() is None
    counter.record_wait("all_reduce", 9.0, "grads")  # the warm-up step
    counter.end_step()
    assert counter.exposed_per_step() == (9.0, {"all_reduce": 9.0})  # one step: that step
    for all_reduce, p2p in ((1.0, 0.5), (3.0, 0.25), (2.0, 1.0)):
        counter.record_wait("all_reduce", all_reduce, "grads")
        counter.record_wait("all_reduce", 100.0, "checkpoint")
        counter.record_wait("p2p", p2p, "activations")
        counter.end_step()
    total, by_kind = counter.exposed_per_step()
    assert total == 3.0  # the steps' totals are 1.5, 3.25, 3.0
    assert by_kind == {"all_reduce": 2.0, "p2p": 0.5}


class SleepingWork:
    def __init__(self, seconds: float):
        self.seconds, self.timeouts = seconds, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        time.sleep(self.seconds)


def test_a_handle_times_its_wait_once_under_its_kind_and_tag():
    counter = CommCounter()
    works = [SleepingWork(0.05), SleepingWork(0.05)]
    handle = Handle(works, counter, "all_gather", "params")
    started = time.perf_counter()
    handle.wait(timeout_s=7)
    elapsed = time.perf_counter() - started
    handle.wait()  # already done: nothing more is waited for or recorded
    counter.end_step()
    waited = counter.exposed_per_step()[1]["all_gather"]
    assert 0.1 <= waited <= elapsed
    assert [w.timeouts for w in works] == [[datetime.timedelta(seconds=7)]] * 2
    single = SleepingWork(0.0)
    Handle(single).wait()
    assert single.timeouts == [None]


def test_a_ring_collective_counts_one_call_its_sends_and_its_whole_time():
    counter = CommCounter()
    comm = Comm(counter, "ring")

    def ring(tensor, group, sent):  # stands in for a ring over two sends
        time.sleep(0.05)
        sent(tensor)
        sent(tensor[:10])

    tensor = torch.zeros(100)
    started = time.perf_counter()
    assert comm._ring("all_reduce", "grads", ring, tensor, None) is DONE
    elapsed = time.perf_counter() - started
    counter.end_step()
    assert counter.totals()["all_reduce"] == 110 * 4
    assert counter.calls_per_step()["all_reduce"] == 1
    assert 0.05 <= counter.exposed_per_step()[0] <= elapsed


def test_a_group_of_one_sends_nothing_and_copies_what_it_must():
    counter = CommCounter()
    one = Group("solo", (3,), 0)
    for algorithm in ("backend", "ring"):
        comm = Comm(counter, algorithm)
        assert comm.counter is counter
        data = torch.arange(6.0)
        assert comm.all_reduce(data, one, "grads") is DONE
        assert data.tolist() == list(range(6))
        out = torch.full((6,), -1.0)
        comm.reduce_scatter(out, data, one, "grads")
        assert out.tolist() == data.tolist()
        out = torch.full((2, 3), -1.0)
        comm.all_gather(out, data, one, "params")
        assert out.flatten().tolist() == data.tolist()
        out = torch.full((6,), -1.0)
        comm.all_to_all(out, data, one, "tokens")
        assert out.tolist() == data.tolist()
        comm.broadcast(data, 0, one, "setup")
        assert comm.all_gather_object({"rank": 3}, one, "report") == [{"rank": 3}]
    assert counter.tags() == set()
    assert isinstance(Comm().counter, CommCounter)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Comm(counter, "tree")
