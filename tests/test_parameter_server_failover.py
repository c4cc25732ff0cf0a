"""A parameter server that survives a server (--ps-replicas 1, sync): servers are SIGKILLed
mid-run and the job finishes with the single-process run's losses, norms and final parameters.

One spawn: 2 workers and 4 servers (ranks 2..5, the scheduler rank 2). Server 1 (rank 3) dies
when the first push of step 2 reaches it: the workers are waiting for its norm, so they replay
their pushes to its standby (server 2), which gathers the step from the replays. Server 3
(rank 5) dies right after sending its standby (the scheduler) the update of step 4 and before
the workers have their parameters: the standby has the step already and answers the replays at
once. Every other server goes on as before.
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from test_parameter_server import (PARAM_TOLERANCE, raw_bytes, reference, relative_error,
                                   run_ranks_letting_some_die)

from tetrad.errors import ConfigError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps import KeyLayout, ParameterServer, PSOptions
from tetrad.planner.parameter_server import replica_bytes
from tetrad.parallel.ps.protocol import Kind
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.train.job import prepare
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.ps_strategy import ParameterServerStrategy
from tetrad.train.trainer import build_model, train

WORKERS, SERVERS = 2, 4
DIES_AT_PUSH = {3: 2}  # rank -> the step whose first push kills it
DIES_AFTER_REPLICATING = {5: 4}  # rank -> the step whose update it replicates, then dies


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class MortalServer(ParameterServer):
    def _on_push(self, message):
        if DIES_AT_PUSH.get(self.rank) == message.clock:
            die()
        super()._on_push(message)

    def _send(self, peer, message):
        super()._send(peer, message)
        if (message.kind == Kind.REPLICATE
                and DIES_AFTER_REPLICATING.get(self.rank) == message.clock):
            die()


def failover_rank(rank: int, world_size: int, config: TrainConfig, options: PSOptions) -> dict:
    torch.set_num_threads(1)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    comm = Comm(CommCounter())
    if options.roles(world_size).is_server(rank):
        model_config, _, _ = prepare(config)
        model = build_model(model_config, config)
        defaults = build_optimizer([torch.empty(0)], config).defaults
        server = MortalServer(model, parameter_groups(model, config.weight_decay), world, comm,
                              options, defaults["betas"], defaults["eps"])
        served = server.serve()
        return {"summary": served["summary"], "key_ranges": sorted(server.served),
                "received": raw_bytes(server.received)}
    made = []

    def make(model, config, device):
        made.append(ParameterServerStrategy(model, config, device, world, comm, options))
        return made[0]

    report = train(config, make, show_progress=False).report
    worker = made[0]
    return {"losses": [s["loss"] for s in report["steps"]],
            "norms": [s["grad_norm"] for s in report["steps"]],
            "ranks": report["ranks"], "summary": worker.summary,
            "route": dict(worker.client.route),
            "params": {k: v.numpy().copy() for k, v in worker.model.state_dict().items()}}


def test_sync_training_survives_two_killed_servers(corpus_file):
    config = TrainConfig(model="tiny", data=corpus_file, steps=6, batch_size=12, seq_len=32,
                         warmup_steps=2, sample_tokens=0, grad_accum=2)
    options = PSOptions(num_servers=SERVERS, replicas=1, heartbeat_s=60.0, reply_timeout_s=120.0)
    outcomes = run_ranks_letting_some_die(failover_rank, WORKERS + SERVERS, config, options,
                                          timeout_s=240.0)
    assert [status for status, _ in outcomes] == ["ok", "ok", "ok", "died", "ok", "died"], \
        outcomes
    assert outcomes[3][1] == outcomes[5][1] == -signal.SIGKILL
    expected = reference(config)
    for status, worker in outcomes[:WORKERS]:
        assert worker["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert worker["norms"] == pytest.approx(expected["norms"], rel=1e-5)
        for name, value in worker["params"].items():
            assert relative_error(torch.from_numpy(value), expected["params"][name]) \
                < PARAM_TOLERANCE, name
        # Range 1 is served by its standby server 2 (rank 4), range 3 by server 0 (rank 2).
        assert worker["route"] == {0: 2, 1: 4, 2: 4, 3: 2}
    summary = outcomes[0][1]["summary"]
    assert summary["dead_servers"] == [3, 5] and summary["updates_applied"] == 6
    assert [(e["role"], e.get("dead", False)) for e in outcomes[0][1]["ranks"]] == [
        ("worker", False)] * 2 + [("server", False), ("server", True), ("server", False),
                                  ("server", True)]
    assert outcomes[2][1]["key_ranges"] == [0, 3] and outcomes[4][1]["key_ranges"] == [1, 2]
    # Replication bytes, counted by the standbys: server 2 had range 1's updates of steps 0 and 1
    # before rank 3 died, the scheduler range 3's of steps 0 to 3 and maybe 4 (its sender died
    # right after handing it to the socket). Each is the range's fp32 gradient, dense and table
    # rows; over the ranges they add up to the planner's S shares.
    model_config, _, _ = prepare(config)
    layout = KeyLayout.from_model(build_model(model_config, config), SERVERS)

    def range_bytes(index: int) -> int:
        (lo, hi), (row_lo, row_hi) = layout.dense_range(index), layout.row_range(index)
        return 4 * (hi - lo + (row_hi - row_lo) * layout.row_numel)

    assert outcomes[4][1]["received"]["replica"] == 2 * range_bytes(1)
    assert outcomes[2][1]["received"]["replica"] in (4 * range_bytes(3), 5 * range_bytes(3))
    whole = 4 * (layout.dense_numel + layout.num_rows * layout.row_numel)
    assert sum(map(range_bytes, range(SERVERS))) == whole
    assert SERVERS * replica_bytes(SERVERS, 4 * layout.dense_numel,
                                   4 * layout.num_rows * layout.row_numel) == whole


@pytest.mark.parametrize("options, message", [
    (dict(num_servers=1, replicas=1), "needs --servers 2 or more"),
    (dict(num_servers=2, replicas=1, mode="async"), "--ps-mode sync only"),
    (dict(num_servers=2, replicas=2), "--ps-replicas must be 0 or 1"),
])
def test_replicas_refused_where_they_cannot_work(options, message):
    with pytest.raises(ConfigError, match=message):
        PSOptions(**options)


def test_the_layout_refuses_replicas_it_cannot_run():
    with pytest.raises(ConfigError, match="needs --servers 2 or more and --ps-mode sync"):
        ParallelConfig(dp=2, strategy="ps", servers=1, ps_replicas=1)
    with pytest.raises(ConfigError, match="add --strategy ps"):
        ParallelConfig(dp=2, ps_replicas=1)
    assert ParallelConfig(dp=2, strategy="ps", servers=2, ps_replicas=1).ps_replicas == 1
