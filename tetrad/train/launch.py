"""Launching `tetrad train`: the layout is resolved (model, rules, pipeline cut) once, before any
process starts, so bad input costs one line, not a traceback per rank; then the workers
(tetrad.parallel.launch: `--nproc N` local processes, or this process's rank under torchrun) each
run the trainer on that resolved layout. Parameter-server runs add their server ranks.
"""

from __future__ import annotations

import dataclasses

from functools import partial

import torch
import torch.distributed as dist

from tetrad.spec.model import TrainConfig
from tetrad.errors import ConfigError
from tetrad.parallel.launch import (COLLECTIVE_TIMEOUT_S, WorkerFailed, init_worker, local_device,
                                    spawn, started_by_torchrun, torchrun_ranks)
from tetrad.planner.rules import ResolvedLayout

__all__ = ["WorkerFailed", "check_layout", "is_distributed", "launch_training", "run_training",
           "train_model", "train_worker"]


def check_layout(config: TrainConfig, world_size: int) -> ResolvedLayout:
    """What can be wrong with a distributed run's layout, as one ConfigError saying the fix;
    else the layout resolved for the run (tetrad.train.trainer.resolve_run)."""
    from tetrad.train.trainer import resolve_run

    parallel = config.parallel
    if parallel.strategy == "ps":
        check_ps_layout(config, world_size)
        return resolve_run(config)
    if world_size != parallel.world_size:
        raise ConfigError(
            f"{world_size} processes but dp {parallel.dp} x pp {parallel.pp} x cp {parallel.cp} x "
            f"tp {parallel.tp} = {parallel.world_size}: make --nproc (or torchrun's world size) "
            f"the product of the degrees, e.g. "
            f"--dp {world_size // (parallel.pp * parallel.cp * parallel.tp) or 1}")
    # A rank's rows go through grad_accum steps of `microbatches` (1 without a pipeline).
    splits = parallel.dp * config.grad_accum * parallel.microbatches
    if config.batch_size % splits:
        raise ConfigError(
            f"--batch-size {config.batch_size} does not split into dp {parallel.dp} x grad-accum "
            f"{config.grad_accum} x microbatches {parallel.microbatches} equal microbatches: "
            f"make it a multiple of {splits}")
    return resolve_run(config)


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
              local_device(0, world_size, config.device), parallel.dp)


def ps_options(config: TrainConfig):
    from tetrad.parallel.ps import PSOptions

    parallel = config.parallel
    return PSOptions(num_servers=parallel.servers, mode=parallel.ps_mode,
                     staleness=parallel.staleness)


def is_distributed(config: TrainConfig) -> bool:
    """Whether a run needs worker processes (ZeRO needs a process group even on one rank)."""
    return (config.nproc > 1 or config.parallel.num_processes > 1 or config.parallel.zero > 0
            or started_by_torchrun())


def train_worker(rank: int, world_size: int, config: TrainConfig,
                 layout: ResolvedLayout | None = None):
    """One rank of `tetrad train`: its mesh, its byte counter, the trainer on `layout` (the
    launcher's check_layout; None resolves it here). Rank 0 returns the TrainResult (report with
    every rank's entry, checkpoint, sample), the others None."""
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import build_mesh
    from tetrad.train.strategy import build_strategy
    from tetrad.train.trainer import train

    if config.parallel.strategy == "ps":
        return ps_rank(rank, world_size, config, layout)
    mesh = build_mesh(config.parallel, rank, world_size)
    collectives = Comm(CommCounter(), config.parallel.collectives)
    result = train(config, partial(build_strategy, mesh=mesh, collectives=collectives),
                   show_progress=rank == 0, layout=layout)
    return result if rank == 0 else None


def ps_rank(rank: int, world_size: int, config: TrainConfig,
            layout: ResolvedLayout | None = None):
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
                                       options=options), show_progress=rank == 0, layout=layout)
        return result if rank == 0 else None
    model_config, _, resume_from = prepare(config, layout.model if layout else None)
    model = build_model(model_config, config)  # the seed's initial parameters, as the workers'
    defaults = build_optimizer([torch.empty(0)], config).defaults
    server = ParameterServer(model, parameter_groups(model, config.weight_decay), world, comm,
                             options, defaults["betas"], defaults["eps"])
    if resume_from is not None:
        server.load_state_dict(ckpt.load_checkpoint(resume_from, model_config)[1])
    server.serve()  # its entry and the summary reach rank 0's report through the scheduler
    return None


def with_overlap_decided(config: TrainConfig, device_type: str) -> TrainConfig:
    """--overlap unset: on with NCCL, where collectives run on their own stream beside the
    matmuls; off on gloo, where the CPU cores that compute also move the bytes (a tp2 step of the
    time-prediction benchmark's model took 2x as long chunked). Decided before the layout is
    resolved, so the ranks and the planner's prediction see the same choice."""
    if config.parallel.overlap is not None:
        return config
    parallel = dataclasses.replace(config.parallel, overlap=device_type == "cuda")
    return dataclasses.replace(config, parallel=parallel)


def launch_training(config: TrainConfig):
    """Run `config` on config.nproc local workers, or as this process's rank under torchrun.
    Returns rank 0's TrainResult (None on the other torchrun ranks)."""
    if started_by_torchrun():
        rank, world_size, local_rank, local_world_size = torchrun_ranks()
        config = with_overlap_decided(
            config, local_device(local_rank, local_world_size, config.device).type)
        layout = check_layout(config, world_size)
        init_worker(rank, world_size, local_rank, local_world_size, COLLECTIVE_TIMEOUT_S,
                    device=local_device(local_rank, local_world_size, config.device))
        try:
            return train_worker(rank, world_size, config, layout)
        finally:
            dist.destroy_process_group()
    from tetrad.train.trainer import prepare

    # Decided once here (a missing GPU is one line, not a traceback per rank): rank r on cuda:r.
    device_type = local_device(0, config.nproc, config.device).type
    config = with_overlap_decided(config, device_type)
    layout = check_layout(config, config.nproc)
    prepare(config, layout.model)  # tokenizer and checkpoint problems: one line, no workers
    parallel = config.parallel
    # Asynchronous parameter servers drop a dead worker and go on; rank 0 writes the report.
    expendable = (frozenset(range(1, parallel.dp))
                  if parallel.strategy == "ps" and parallel.ps_mode != "sync" else frozenset())
    return spawn(train_worker, config.nproc, (config, layout), expendable=expendable,
                 device_type=device_type, forward_signals=True)[0]


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
    from tetrad.spec.model import build_train_config

    if isinstance(config, TrainConfig):
        if settings:
            raise ConfigError(f"pass settings ({', '.join(settings)}) or a TrainConfig, not both: "
                              f"use dataclasses.replace on the TrainConfig")
        return run_training(config)
    return run_training(build_train_config(config, settings))
