"""Spare workers joining a running parameter-server job (--ps-spares, async mode): a worker is
SIGKILLed mid-run, a spare takes its slot at once and trains on from the slot's clock on the
servers' current parameters; a second spare is never needed and goes home.

One spawn: workers 0 and 1, spares 2 and 3, one server (rank 4). Worker 1 dies when it starts
its step 3 (after 3 applied pushes); the spare that asked first is admitted to slot 1 at clock 3.
"""

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
from test_parameter_server import run_ranks_letting_some_die
from test_parameter_server_sync_join import build_server

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps import PSOptions
from tetrad.parallel.ps.worker import await_admission
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.train.ps_strategy import ParameterServerStrategy
from tetrad.train.trainer import train

WORKERS, SPARES, SERVERS = 2, 2, 1
STEPS, DIES_AT = 6, 3
DYING = 1


class MortalWorker(ParameterServerStrategy):
    def local_batch(self, batch):
        if self.rank == DYING and self.clock == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        local = super().local_batch(batch)
        self.batches.append((batch.tolist(), local.tolist()))
        return local


def join_rank(rank: int, world_size: int, config: TrainConfig, options: PSOptions) -> dict:
    torch.set_num_threads(1)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    comm = Comm(CommCounter())
    roles = options.roles(world_size)
    if roles.is_server(rank):
        server = build_server(config, world, comm, options)
        return {"summary": server.serve()["summary"], "updates": server.updates}
    admission = await_admission(world, comm, options) if roles.is_spare(rank) else None
    if roles.is_spare(rank) and admission is None:
        return {"admitted": False}
    made = []

    def make(model, config, device):
        made.append(MortalWorker(model, config, device, world, comm, options, admission))
        made[0].batches = []
        return made[0]

    report = train(config, make, show_progress=False).report
    worker = made[0]
    return {"steps": [s["step"] for s in report["steps"]],
            "losses": [s["loss"] for s in report["steps"]],
            "batches": worker.batches, "slot": worker.slot, "ranks": report["ranks"], "summary": worker.summary}


def test_a_spare_takes_a_dead_workers_place_in_async_mode(corpus_file):
    config = TrainConfig(model="tiny", data=corpus_file, steps=STEPS, batch_size=8, seq_len=32,
                         warmup_steps=2, sample_tokens=0)
    options = PSOptions(num_servers=SERVERS, mode="async", spares=SPARES, heartbeat_s=60.0,
                        reply_timeout_s=120.0)
    outcomes = run_ranks_letting_some_die(join_rank, WORKERS + SPARES + SERVERS, config,
                                          options, timeout_s=600.0)
    assert [status for status, _ in outcomes] == ["ok", "died", "ok", "ok", "ok"], outcomes
    assert outcomes[1][1] == -signal.SIGKILL
    worker, server = outcomes[0][1], outcomes[4][1]
    (joined, spare), = [(rank, outcomes[rank][1]) for rank in (2, 3)
                        if outcomes[rank][1] != {"admitted": False}]
    # The spare continues slot 1 where worker 1 stopped: its steps DIES_AT+1 .. STEPS (the
    # trainer's 1-based numbers), on slot 1's rows of those global batches.
    assert spare["slot"] == 1 and spare["steps"] == list(range(DIES_AT + 1, STEPS + 1))
    assert worker["steps"] == list(range(1, STEPS + 1))
    rows = config.batch_size // WORKERS
    assert [whole for whole, _ in spare["batches"]] == [
        whole for whole, _ in worker["batches"][DIES_AT:]]
    assert [local for _, local in spare["batches"]] == [
        whole[rows:2 * rows] for whole, _ in spare["batches"]]
    summary = server["summary"]
    assert summary["joined"] == {str(joined): 1} and summary["dead_workers"] == [1]
    assert summary["clocks"] == {"0": STEPS, "1": DIES_AT, str(joined): STEPS}
    # Every push of the spare's was applied: the server's updates count them.
    assert summary["updates_applied"] == server["updates"] == STEPS + DIES_AT + STEPS - DIES_AT
    # It started from the servers' parameters of the moment, not the seed's: its first loss is
    # below the initial loss of the run (worker 0's first).
    assert spare["losses"][0] < worker["losses"][0]
    assert worker["summary"] == summary
    roles = {joined: ("worker", False), 5 - joined: ("spare", False)}
    assert [(e["role"], e.get("dead", False)) for e in worker["ranks"]] == [
        ("worker", False), ("worker", True), roles[2], roles[3], ("server", False)]


def test_a_negative_number_of_spares_is_refused():
    with pytest.raises(ConfigError, match="--ps-spares must be an integer >= 0"):
        PSOptions(spares=-1, mode="async")


def test_spares_need_a_worker_beside_them():
    with pytest.raises(ConfigError, match="leave no worker beside 1 parameter server"):
        PSOptions(mode="async", spares=2).roles(3)


def test_tetrad_train_launches_spares_that_go_home_unneeded(tmp_path, corpus_file):
    # No --dp: the workers are the processes that are neither servers nor spares. Nobody dies,
    # so both spares are told they were not needed; the report has their entries.
    report = tmp_path / "r.json"
    assert main(["train", "--model", "tiny", "--steps", "3", "--batch-size", "4", "--seq-len",
                 "32", "--sample-tokens", "0", "--data", corpus_file, "--report", str(report),
                 "--strategy", "ps", "--ps-mode", "async", "--nproc", "5", "--servers", "1",
                 "--ps-spares", "2"]) == 0
    result = json.loads(report.read_text())
    assert [e["role"] for e in result["ranks"]] == [
        "worker", "worker", "spare", "spare", "server"]
    summary = result["parameter_server"]
    assert summary["joined"] == {} and summary["clocks"] == {"0": 3, "1": 3}


def test_tetrad_train_joins_a_spare_to_a_sync_run_from_the_step_it_names(tmp_path, corpus_file):
    """--ps-join-step through the CLI: the spare works from step 2 as a third share of each
    global batch, and the run trains as one process does on the same batches (the data rule and
    the exactness of sync joins: tests/test_parameter_server_sync_join.py)."""
    common = ["train", "--model", "tiny", "--steps", "3", "--batch-size", "6", "--seq-len", "32",
              "--sample-tokens", "0", "--data", corpus_file]
    joined, single = tmp_path / "joined.json", tmp_path / "single.json"
    assert main([*common, "--report", str(joined), "--strategy", "ps", "--nproc", "4",
                 "--servers", "1", "--ps-spares", "1", "--ps-join-step", "2"]) == 0
    assert main([*common, "--report", str(single)]) == 0
    result, reference = json.loads(joined.read_text()), json.loads(single.read_text())
    summary = result["parameter_server"]
    assert summary["joined"] == {"2": 2} and summary["updates_applied"] == 3
    assert [e["role"] for e in result["ranks"]] == ["worker", "worker", "worker", "server"]
    for step, expected in zip(result["steps"], reference["steps"], strict=True):
        assert step["loss"] == pytest.approx(expected["loss"], rel=1e-5)


@pytest.mark.parametrize("argv, fragment", [
    (["--ps-mode", "async", "--nproc", "4", "--dp", "2", "--servers", "1", "--ps-spares", "2"],
     "dp 2 workers + 1 servers + 2 spares = 5"),
    (["--nproc", "4", "--servers", "1", "--ps-join-step", "2"],
     "--ps-join-step joins the --ps-spares of a --ps-mode sync run as new workers"),
    (["--ps-mode", "async", "--nproc", "4", "--servers", "1", "--ps-spares", "1",
      "--ps-join-step", "2"], "(got --ps-mode async, --ps-spares 1)"),
])
def test_impossible_joins_cost_one_line(capsys, corpus_file, argv, fragment):
    code = main(["train", "--model", "tiny", "--steps", "1", "--data", corpus_file,
                 "--strategy", "ps", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err


def test_spares_need_the_parameter_server():
    with pytest.raises(ConfigError, match="--ps-spares configures the parameter server"):
        ParallelConfig(dp=2, ps_spares=1)
