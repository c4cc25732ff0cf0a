"""Starting the processes of a distributed run: `spawn` runs a function on N local workers (what
`tetrad train --nproc N` and the multi-rank tests use); under torchrun (one node or many) the
same worker code runs in the processes torchrun started. The layout is checked before any process
starts, so bad input costs one line, not a traceback per rank.

A failing worker takes the whole job down at once: its traceback travels to the parent, which
kills the other workers (they would otherwise sit in a collective waiting for the dead rank) and
raises WorkerFailed naming the rank. Collectives time out too, so nothing waits forever. The one
exception: parameter-server workers other than rank 0 in async and ssp mode, which the servers
drop and train on without (docs/parameter_server.md).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import queue
import sys
import time
import traceback
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from tetrad.config import TrainConfig
from tetrad.errors import ConfigError, TetradError

HOST = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer than this means a rank is gone


class WorkerFailed(TetradError):
    """A worker raised or died; the message names its rank and carries its error."""


def local_device(local_rank: int, local_world_size: int) -> torch.device:
    """cuda:local_rank when every rank on this machine can have a GPU of its own, else the CPU
    for all of them (one backend per job: gloo cannot talk to NCCL)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_worker(rank: int, world_size: int, local_rank: int, local_world_size: int,
                timeout_s: float, store: dist.Store | None = None) -> torch.device:
    """One thread per worker (the cores are shared), NCCL on a GPU of its own, gloo otherwise."""
    torch.set_num_threads(1)
    device = local_device(local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if store is None:  # started by torchrun: rendezvous from its MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    return device


def started_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def torchrun_ranks() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun sets them."""
    world_size = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def _worker(fn: Callable, rank: int, world_size: int, port: int, timeout_s: float,
            args: tuple, results: multiprocessing.Queue) -> None:
    try:
        store = dist.TCPStore(HOST, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        init_worker(rank, world_size, rank, world_size, timeout_s, store)
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # tensors travel as bytes, not as shared-memory handles
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - everything must reach the parent
        message = (f"{type(error).__name__}: {error}" if isinstance(error, TetradError)
                   else traceback.format_exc())
        results.put((rank, "error", message))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, args: tuple = (), timeout_s: float | None = None,
          collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
          expendable: frozenset[int] = frozenset()) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `nprocs` fresh processes (spawn start method) joined
    in one process group, and return each rank's return value in rank order. `fn` must be
    importable by name. Raises WorkerFailed as soon as one worker fails, and after `timeout_s`
    (None: no limit on the whole job; the collective timeout still catches a hang). The ranks in
    `expendable` may fail or die: their error goes to stderr, their value is None, and the job
    returns once every other rank has returned."""
    context = multiprocessing.get_context("spawn")
    # The parent hosts the rendezvous store on a free port: no port guessing, no races.
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=collective_timeout_s))
    results = context.Queue()
    workers = [context.Process(target=_worker, daemon=True,
                               args=(fn, rank, nprocs, store.port, collective_timeout_s, args,
                                     results))
               for rank in range(nprocs)]
    for worker in workers:
        worker.start()
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        values = _collect(workers, results, deadline, expendable)
    except BaseException:
        _stop(workers, grace_s=0)
        raise
    _stop(workers, grace_s=10)  # they are tearing their process groups down
    return values


def _collect(workers: list, results: multiprocessing.Queue, deadline: float | None,
             expendable: frozenset[int]) -> list[Any]:
    values: dict[int, Any] = {}
    needed = [rank for rank in range(len(workers)) if rank not in expendable]
    while any(rank not in values for rank in needed):
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            # An expendable rank that exits with code 0 and no result (os._exit) is dead too.
            dead = [rank for rank, worker in enumerate(workers)
                    if rank not in values and worker.exitcode not in (None, 0)
                    or rank in expendable and rank not in values and worker.exitcode == 0]
            if dead:
                # Its error report may still be in flight: give it a moment to arrive.
                try:
                    rank, status, payload = results.get(timeout=2.0)
                except queue.Empty:
                    message = (f"rank {dead[0]} died with exit code {workers[dead[0]].exitcode} "
                               f"and no error report")
                    if dead[0] not in expendable:
                        raise WorkerFailed(message) from None
                    rank, status, payload = dead[0], "error", message
            elif deadline is not None and time.monotonic() > deadline:
                missing = [rank for rank in needed if rank not in values]
                raise WorkerFailed(f"timed out waiting for ranks {missing}")
            else:
                continue
        if status == "error":
            if rank not in expendable:
                dead = _silently_dead(workers, values, expendable, rank)
                if dead is not None:  # the root cause; `rank` only lost its peer
                    raise WorkerFailed(
                        f"rank {dead} died with exit code {workers[dead].exitcode} and no error "
                        f"report (then rank {rank} failed: {payload.strip()})")
                raise WorkerFailed(f"rank {rank} failed: {payload.strip()}")
            print(f"rank {rank} stopped, the run goes on without it: {payload.strip()}",
                  file=sys.stderr)
            values[rank] = None
            continue
        values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    # Expendable ranks still running are stopped by the caller's _stop.
    return [values.get(rank) for rank in range(len(workers))]


def _silently_dead(workers: list, values: dict[int, Any], expendable: frozenset[int],
                   reporting: int, grace_s: float = 0.2) -> int | None:
    """A needed rank other than `reporting` that died without a report (killed by a signal, say):
    when a rank's collective fails because its peer vanished, the peer is what to name. Waits up
    to `grace_s` for such a death to be seen."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, worker in enumerate(workers):
            if (rank != reporting and rank not in values and rank not in expendable
                    and worker.exitcode not in (None, 0, 1)):
                return rank
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _stop(workers: list, grace_s: float) -> None:
    """Let workers exit for `grace_s`, terminate what is still running (after a failure: the
    ranks stuck waiting for the failed one), then reap."""
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
            worker.join()


def check_layout(config: TrainConfig, world_size: int) -> None:
    """What can be wrong with a distributed run's layout, as one ConfigError saying the fix."""
    from tetrad.parallel.mesh import ParallelDims
    from tetrad.parallel.parallelize import check_parallel
    from tetrad.presets import resolve_model

    parallel = config.parallel
    if parallel.strategy == "ps":
        check_ps_layout(config, world_size)
        return
    dims = ParallelDims.from_config(parallel)
    if world_size != dims.world_size:
        raise ConfigError(
            f"{world_size} processes but dp {dims.dp} x pp {dims.pp} x cp {dims.cp} x tp "
            f"{dims.tp} = {dims.world_size}: make --nproc (or torchrun's world size) the product "
            f"of the degrees, e.g. --dp {world_size // (dims.pp * dims.cp * dims.tp) or 1}")
    # A rank's rows go through grad_accum steps of `microbatches` (1 without a pipeline).
    splits = dims.dp * config.grad_accum * parallel.microbatches
    if config.batch_size % splits:
        raise ConfigError(
            f"--batch-size {config.batch_size} does not split into dp {dims.dp} x grad-accum "
            f"{config.grad_accum} x microbatches {parallel.microbatches} equal microbatches: "
            f"make it a multiple of {splits}")
    check_parallel(resolve_model(config.model, config.model_overrides), parallel, config.seq_len)


def check_ps_layout(config: TrainConfig, world_size: int) -> None:
    from tetrad.parallel.ps.protocol import check_run

    parallel = config.parallel
    if world_size != parallel.num_processes:
        hint = (f"e.g. --dp {world_size - parallel.servers}" if world_size > parallel.servers
                else f"e.g. --nproc {parallel.num_processes}")
        raise ConfigError(
            f"{world_size} processes but --strategy ps runs dp {parallel.dp} workers + "
            f"{parallel.servers} servers = {parallel.num_processes}: make --nproc (or torchrun's "
            f"world size) dp + servers, {hint}")
    check_run(config.batch_size, config.grad_accum, config.dtype,
              local_device(0, world_size), parallel.dp)


def ps_options(config: TrainConfig):
    from tetrad.parallel.ps import PSOptions

    parallel = config.parallel
    return PSOptions(num_servers=parallel.servers, mode=parallel.ps_mode,
                     staleness=parallel.staleness)


def is_distributed(config: TrainConfig) -> bool:
    """Whether a run needs worker processes (ZeRO needs a process group even on one rank)."""
    return (config.nproc > 1 or config.parallel.num_processes > 1 or config.parallel.zero > 0
            or started_by_torchrun())


def train_worker(rank: int, world_size: int, config: TrainConfig):
    """One rank of `tetrad train`: its mesh, its byte counter, the trainer. Rank 0 returns the
    TrainResult (report with every rank's entry, checkpoint, sample), the others None."""
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import ParallelDims, build_mesh
    from tetrad.train.strategy import build_strategy
    from tetrad.train.trainer import train

    if config.parallel.strategy == "ps":
        return ps_rank(rank, world_size, config)
    mesh = build_mesh(ParallelDims.from_config(config.parallel), rank, world_size)
    collectives = Comm(CommCounter(), config.parallel.collectives)
    result = train(config, partial(build_strategy, mesh=mesh, collectives=collectives),
                   show_progress=rank == 0)
    return result if rank == 0 else None


def ps_rank(rank: int, world_size: int, config: TrainConfig):
    """One rank of `tetrad train --strategy ps`: workers (the first dp ranks) run the trainer with
    the parameter-server strategy, servers serve until every worker said goodbye or died."""
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import Group
    from tetrad.parallel.ps import ParameterServer
    from tetrad.train import checkpoint as ckpt
    from tetrad.train.optim import build_optimizer, parameter_groups
    from tetrad.train.ps_strategy import ParameterServerStrategy
    from tetrad.train.trainer import build_model, prepare, train

    options = ps_options(config)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    comm = Comm(CommCounter())
    if not options.roles(world_size).is_server(rank):
        result = train(config, partial(ParameterServerStrategy, world=world, comm=comm,
                                       options=options), show_progress=rank == 0)
        return result if rank == 0 else None
    model_config, _, resume_from = prepare(config)
    model = build_model(model_config, config)  # the seed's initial parameters, as the workers'
    defaults = build_optimizer([torch.empty(0)], config).defaults
    server = ParameterServer(model, parameter_groups(model, config.weight_decay), world, comm,
                             options, defaults["betas"], defaults["eps"])
    if resume_from is not None:
        server.load_state_dict(ckpt.load_checkpoint(resume_from, model_config)[1])
    server.serve()  # its entry and the summary reach rank 0's report through the scheduler
    return None


def launch_training(config: TrainConfig):
    """Run `config` on config.nproc local workers, or as this process's rank under torchrun.
    Returns rank 0's TrainResult (None on the other torchrun ranks)."""
    if started_by_torchrun():
        rank, world_size, local_rank, local_world_size = torchrun_ranks()
        check_layout(config, world_size)
        init_worker(rank, world_size, local_rank, local_world_size, COLLECTIVE_TIMEOUT_S)
        try:
            return train_worker(rank, world_size, config)
        finally:
            dist.destroy_process_group()
    from tetrad.train.trainer import prepare

    check_layout(config, config.nproc)
    prepare(config)  # model, tokenizer and checkpoint problems: one line, no workers started
    parallel = config.parallel
    # Asynchronous parameter servers drop a dead worker and go on; rank 0 writes the report.
    expendable = (frozenset(range(1, parallel.dp))
                  if parallel.strategy == "ps" and parallel.ps_mode != "sync" else frozenset())
    return spawn(train_worker, config.nproc, (config,), expendable=expendable)[0]


def run_training(config: TrainConfig):
    """One training run as `tetrad train` runs it: in this process, on config.nproc local
    workers, or as this process's rank under torchrun. Returns the TrainResult (None on torchrun
    ranks other than 0, whose rank 0 reports)."""
    from tetrad.train.trainer import train

    return launch_training(config) if is_distributed(config) else train(config)


def train_model(config: TrainConfig | str | None = None, **settings):
    """Python's `tetrad train`: a TrainConfig, or the path of a TOML config and/or settings
    named like its fields and the parallel degrees (`train_model(model="tiny", steps=50, dp=2,
    nproc=2)`); settings win over the TOML file's."""
    from tetrad.config import build_train_config

    if isinstance(config, TrainConfig):
        if settings:
            raise ConfigError(f"pass settings ({', '.join(settings)}) or a TrainConfig, not both: "
                              f"use dataclasses.replace on the TrainConfig")
        return run_training(config)
    return run_training(build_train_config(config, settings))
