"""Workers joining and rejoining a sync parameter-server run (--ps-spares; docs/parameter_server.md,
"Joining a running job"): the final parameters equal one process fed the same global batches.

One spawn, two runs: workers 0 and 1, spares 2 and 3, servers 4 and 5 (the scheduler rank 4).
(A) join step 3: both spares join as new slots from step 3 on, so each global batch is cut into
two shares before and four after. (B) no join step: worker 1 is SIGKILLed at its step 2 once it
has the step's norms (its loss and pushes are on the servers, its STEP is not); the spare that
asked first takes slot 1 and redoes step 2. That spare is SIGKILLed at step 4 after its STEP
reached server 0 only, so server 0 applies step 4 and server 1 cannot; the other spare takes
slot 1, redoes step 4 (server 0 answers it from memory) and trains on.
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from test_parameter_server import (PARAM_TOLERANCE, reference, relative_error,
                                   run_ranks_letting_some_die)

from tetrad.errors import ConfigError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps import ParameterServer, PSOptions
from tetrad.parallel.ps.protocol import Kind, check_run
from tetrad.parallel.ps.worker import await_admission
from tetrad.spec.model import TrainConfig
from tetrad.train.job import prepare
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.ps_strategy import ParameterServerStrategy
from tetrad.train.trainer import build_model, train

WORKERS, SPARES, SERVERS = 2, 2, 2
JOIN_STEP = 3
FIRST_DEATH, SECOND_DEATH = 2, 4  # the clocks (steps done) at which slot 1's workers die


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Recording(ParameterServerStrategy):
    """Records the global batch and its own share of each step; in run (B) slot 1's first two
    workers die mid-step."""

    mortal = False

    def local_batch(self, batch):
        local = super().local_batch(batch)
        self.batches.append((self.clock, batch.tolist(), local.tolist()))
        return local

    def clip_grad_norm(self, max_norm):
        norm = super().clip_grad_norm(max_norm)
        if self.mortal and self.rank == 1 and self.clock == FIRST_DEATH:
            die()  # its METRIC and pushes arrived, the servers answered its NORMs
        return norm

    def step(self, lr):
        if self.mortal and self.joined and self.first_step == FIRST_DEATH \
                and self.clock == SECOND_DEATH:
            client = self.client  # STEP to server 0 only, then die
            client._converse({0: client._for_step(Kind.STEP, values=(lr, self.clip_scale),
                                                  key_range=0)}, None)
            die()
        return super().step(lr)


def build_server(config: TrainConfig, world: Group, comm: Comm,
                 options: PSOptions) -> ParameterServer:
    """A server rank as the launcher builds it: the model from the seed, the trainer's AdamW."""
    model_config, _, _ = prepare(config)
    model = build_model(model_config, config)
    defaults = build_optimizer([torch.empty(0)], config).defaults
    return ParameterServer(model, parameter_groups(model, config.weight_decay), world, comm,
                           options, defaults["betas"], defaults["eps"])


def join_rank(rank: int, world_size: int, runs: list) -> list[dict]:
    torch.set_num_threads(1)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    results = []
    for config, options, mortal in runs:
        comm = Comm(CommCounter())
        roles = options.roles(world_size)
        if roles.is_server(rank):
            server = build_server(config, world, comm, options)
            results.append({"summary": server.serve()["summary"]})
            continue
        admission = await_admission(world, comm, options) if roles.is_spare(rank) else None
        if roles.is_spare(rank) and admission is None:
            results.append({"admitted": False})
            continue
        made = []

        def make(model, config, device, options=options, comm=comm, admission=admission,
                 mortal=mortal):
            made.append(Recording(model, config, device, world, comm, options, admission))
            made[0].batches, made[0].mortal = [], mortal
            return made[0]

        report = train(config, make, show_progress=False).report
        worker = made[0]
        results.append({"steps": [s["step"] for s in report["steps"]],
                        "losses": [s["loss"] for s in report["steps"]],
                        "norms": [s["grad_norm"] for s in report["steps"]],
                        "batches": worker.batches, "slot": worker.slot,
                        "first_step": worker.first_step, "summary": worker.summary,
                        "params": {k: v.numpy().copy()
                                   for k, v in worker.model.state_dict().items()}})
    return results


@pytest.fixture(scope="module")
def config(corpus_file) -> TrainConfig:
    return TrainConfig(model="tiny", data=corpus_file, steps=6, batch_size=24, seq_len=32,
                       warmup_steps=2, sample_tokens=0, grad_accum=2)


@pytest.fixture(scope="module")
def outcomes(config) -> list:
    options = dict(num_servers=SERVERS, spares=SPARES, heartbeat_s=60.0, reply_timeout_s=300.0)
    runs = [(config, PSOptions(**options, join_step=JOIN_STEP), False),
            (config, PSOptions(**options), True)]
    return run_ranks_letting_some_die(join_rank, WORKERS + SPARES + SERVERS, runs,
                                      timeout_s=900.0)


def assert_single_process(result: dict, expected: dict) -> None:
    assert result["losses"] == pytest.approx(expected["losses"][result["first_step"]:], rel=1e-5)
    assert result["norms"] == pytest.approx(expected["norms"][result["first_step"]:], rel=1e-5)
    for name, value in result["params"].items():
        assert relative_error(torch.from_numpy(value), expected["params"][name]) \
            < PARAM_TOLERANCE, name


def shares(result: dict, slots_at) -> list[bool]:
    """Whether each recorded step's share is rows [k B/n, (k+1) B/n) of its global batch."""
    slot = result["slot"]
    out = []
    for clock, whole, local in result["batches"]:
        rows = len(whole) // slots_at(clock)
        out.append(local == whole[slot * rows:(slot + 1) * rows])
    return out


def test_spares_join_a_sync_run_at_its_join_step(config, outcomes):
    expected = reference(config)
    first = outcomes[0][1][0]  # worker 0's result of run (A); rank 0 survives both runs
    assert_single_process(first, expected)
    assert first["steps"] == list(range(1, config.steps + 1))
    summary = first["summary"]
    joined = {int(rank): slot for rank, slot in summary["joined"].items()}
    assert sorted(joined.values()) == [2, 3] and sorted(joined) == [2, 3]
    assert summary["clocks"] == {"0": 6, "1": 6, "2": 6, "3": 6}
    assert summary["updates_applied"] == config.steps and summary["dead_workers"] == []

    def slots_at(clock: int) -> int:
        return WORKERS if clock < JOIN_STEP else WORKERS + SPARES

    assert all(shares(first, slots_at))
    # Worker 0's share halves at the join step: 12 rows, then 6 of the 24.
    assert [len(local) for _, _, local in first["batches"]] == [12] * 3 + [6] * 3
    # The survivor of run (B) among the spares joined run (A) at step 3 on its slot's rows.
    spare = next(outcomes[rank][1][0] for rank in (2, 3) if outcomes[rank][0] == "ok")
    assert spare["first_step"] == JOIN_STEP and all(shares(spare, slots_at))
    assert [whole for _, whole, _ in spare["batches"]] == [
        whole for _, whole, _ in first["batches"][JOIN_STEP:]]
    assert_single_process(spare, expected)


def test_killed_sync_workers_rejoin_through_spares_and_lose_nothing(config, outcomes):
    assert [status for status, _ in outcomes].count("died") == 2, outcomes
    assert outcomes[1] == ("died", -signal.SIGKILL)
    (second_spare,) = [rank for rank in (2, 3) if outcomes[rank][0] == "ok"]
    first_spare = 5 - second_spare
    assert outcomes[first_spare] == ("died", -signal.SIGKILL)
    expected = reference(config)
    worker, spare = outcomes[0][1][1], outcomes[second_spare][1][1]
    assert_single_process(worker, expected)
    assert worker["steps"] == list(range(1, config.steps + 1))
    # The second spare redid slot 1's step 4 (trainer step 5) and went on to the end.
    assert spare["slot"] == 1 and spare["first_step"] == SECOND_DEATH
    assert spare["steps"] == list(range(SECOND_DEATH + 1, config.steps + 1))
    assert_single_process(spare, expected)
    assert all(shares(worker, lambda clock: WORKERS)) and all(shares(spare, lambda c: WORKERS))
    assert [whole for _, whole, _ in spare["batches"]] == [
        whole for _, whole, _ in worker["batches"][SECOND_DEATH:]]
    summary = worker["summary"]
    assert summary == spare["summary"]
    assert summary["dead_workers"] == sorted([1, first_spare])
    assert summary["joined"] == {str(first_spare): 1, str(second_spare): 1}
    assert summary["updates_applied"] == config.steps
    # Slot 1's clocks: worker 1 held it for steps 0 and 1, the first spare for steps 2 and 3 and
    # for step 4 on server 0 if that step was applied there before the second spare spoke.
    clocks = summary["clocks"]
    assert clocks.pop(str(first_spare)) in (SECOND_DEATH, SECOND_DEATH + 1)
    assert clocks == {"0": 6, "1": FIRST_DEATH, str(second_spare): config.steps}


@pytest.mark.parametrize("options, message", [
    (dict(join_step=2), "it needs --ps-spares and --ps-mode sync"),
    (dict(spares=1, join_step=0), "from a step >= 1"),
    (dict(spares=1, mode="async", join_step=2), "--ps-mode async"),
])
def test_a_join_step_is_refused_where_it_cannot_apply(options, message):
    with pytest.raises(ConfigError, match=message):
        PSOptions(**options)


def test_every_worker_count_a_run_may_grow_to_splits_the_batch():
    cpu = torch.device("cpu")
    check_run(24, 2, "fp32", cpu, 2, 4)  # 2, 3 or 4 workers: 6, 4 or 3 rows per microbatch
    check_run(16, 2, "fp32", cpu, 2)  # no spares join: 2 workers only
    with pytest.raises(ConfigError, match="does not split into 3 workers x grad-accum 2"):
        check_run(16, 2, "fp32", cpu, 2, 4)  # one spare may join before the other
    growing, replacing = (PSOptions(num_servers=2, spares=2, join_step=3),
                          PSOptions(num_servers=2, spares=2))
    assert growing.roles(6).most_workers(growing) == 4
    assert replacing.roles(6).most_workers(replacing) == 2
