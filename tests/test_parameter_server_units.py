"""The parameter server's pieces in one process, which the spawned checks of
test_parameter_server.py rely on: key ranges, the SSP/async/sync gate, the wire header, and the
options' one-line refusals."""

import pytest
import torch

from tetrad.errors import ConfigError
from tetrad.parallel.ps import KeyLayout, PSOptions
from tetrad.parallel.ps.clock import Scheduler
from tetrad.parallel.ps.protocol import Kind, Message, check_run
from tetrad.spec.model import TrainConfig
from tetrad.train.job import prepare
from tetrad.train.trainer import build_model


def test_key_ranges_cover_every_parameter_once():
    config = TrainConfig(model="tiny")
    model_config, _, _ = prepare(config)
    model = build_model(model_config, config)
    for servers in (1, 2, 3, 5):
        layout = KeyLayout.from_model(model, servers)
        dense = [layout.dense_range(s) for s in range(servers)]
        rows = [layout.row_range(s) for s in range(servers)]
        assert dense[0][0] == 0 and dense[-1][1] == layout.dense_numel
        assert all(a[1] == b[0] for a, b in zip(dense, dense[1:]))
        assert rows[0][0] == 0 and rows[-1][1] == model_config.vocab_size
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        assert layout.dense_numel + layout.num_rows * layout.row_numel == sum(
            p.numel() for p in model.parameters())
        assert max(hi - lo for lo, hi in dense) - min(hi - lo for lo, hi in dense) <= 1
        # Each dense parameter's flat elements, in order, from the servers' pieces in turn.
        covered = {name: [] for name, _ in layout.dense}
        for server, (lo, hi) in enumerate(dense):
            for name, start, end, offset in layout.dense_pieces(server):
                assert 0 <= start < end <= hi - lo
                covered[name].append((offset, offset + end - start))
        for name, numel in layout.dense:
            pieces = covered[name]
            assert pieces[0][0] == 0 and pieces[-1][1] == numel, name
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), name
        offsets = list(layout.dense_offsets().values())
        assert offsets[0] == 0 and all(
            b - a == numel for a, b, (_, numel) in zip(offsets, offsets[1:], layout.dense))
    tied = build_model(model_config.replace(tie_embeddings=True), config)
    assert KeyLayout.from_model(tied, 2).sparse is None  # the head reads every row


def test_ssp_gate_holds_the_fastest_and_releases_it():
    book = Scheduler([0, 1, 2], "ssp", 1)
    for clock in range(2):  # worker 0 runs ahead
        assert book.push(0, clock) == clock
        book.applied([0])
        assert book.may_start(0) is (clock == 0)
    assert book.held == [0] and book.holds == 1
    assert book.push(1, 0) == 0
    book.applied([1])
    assert book.may_start(1) and book.release() == []  # worker 2 is still on step 0
    book.drop(2)  # the slowest dies: the fastest is within K of the slowest live one again
    assert book.release() == [0] and book.held == []
    summary = book.summary()
    assert summary["staleness"]["max"] == 1 and summary["dead_workers"] == [2]
    assert summary["update_lag"]["histogram"] == {"0": 2, "2": 1}  # 2: worker 0's updates


def test_ssp_gate_bounds_the_lead_over_the_slowest_not_the_clock():
    book = Scheduler([0, 1], "ssp", 1)
    for clock in range(2):  # both on step 2: a lead of 0, far from clock 0
        for worker in (0, 1):
            book.push(worker, clock)
            book.applied([worker])
            assert book.may_start(worker)
    assert book.push(0, 2) == 0  # the gap: 2 - 2
    book.applied([0])
    assert book.may_start(0)  # 3 - 2 = 1 step ahead: within the bound
    assert book.push(0, 3) == 1
    book.applied([0])
    assert not book.may_start(0) and book.held == [0]  # 2 ahead
    book.push(1, 2)
    book.applied([1])
    assert book.release() == [0]  # 4 - 3 = 1 again


def test_async_never_holds_and_sync_has_no_lag():
    book = Scheduler([0, 1], "async", None)
    gaps = []
    for clock in range(5):
        gaps.append(book.push(0, clock))
        book.applied([0])
        assert book.may_start(0)
    assert gaps == [0, 1, 2, 3, 4]  # worker 1 has not pushed yet: it is the slowest
    assert book.push(1, 0) == 0 and book.summary()["update_lag"]["max"] == 5
    sync = Scheduler([0, 1], "sync", None)
    for clock in range(3):
        assert [sync.push(w, clock) for w in (0, 1)] == [0, 0]
        sync.applied([0, 1])
        assert all(sync.may_start(w) for w in (0, 1))
    assert sync.summary()["update_lag"]["max"] == 0


def test_header_round_trip():
    message = Message(Kind.STEP, 3, clock=7, count=11, values=(1.25e-3, 0.5))
    decoded = Message.from_header(message.header())
    assert (decoded.kind, decoded.sender, decoded.clock, decoded.count, decoded.values) == (
        Kind.STEP, 3, 7, 11, (1.25e-3, 0.5))
    # Two kinds sharing a number would make one an alias of the other on the wire.
    assert len(list(Kind)) == len(Kind.__members__)
    for kind in Kind:
        assert Message.from_header(Message(kind, 0, clock=2**40).header()).kind is kind
    carried = Message.carrying(Kind.DONE, 4, {"rank": 4, "losses": [2.5, float("inf")]})
    assert carried.count == carried.payload[0].numel()
    assert carried.object() == {"rank": 4, "losses": [2.5, float("inf")]}


@pytest.mark.parametrize("options, fragment", [
    (dict(num_servers=0), "--servers must be a positive integer"),
    (dict(mode="hogwild"), "--ps-mode must be one of sync, async, ssp"),
    (dict(mode="async", staleness=2), "--staleness bounds --ps-mode ssp only"),
    (dict(mode="ssp", staleness=-1), "--staleness must be an integer >= 0"),
    (dict(heartbeat_s=900.0), "must exceed the heartbeat timeout"),
])
def test_bad_options_say_what_to_change(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PSOptions(**options)


def test_bad_runs_say_what_to_change():
    with pytest.raises(ConfigError, match="make --nproc larger than --servers"):
        PSOptions(num_servers=2).roles(2)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="make it a multiple of 6"):
        check_run(8, 2, "fp32", cpu, 3)
    with pytest.raises(ConfigError, match="use --dtype bf16 or fp32"):
        check_run(6, 1, "fp16", cpu, 3)
    with pytest.raises(ConfigError, match="runs on CPU over gloo"):
        check_run(6, 1, "fp32", torch.device("cuda", 0), 3)
    assert PSOptions(mode="ssp").staleness == 1
