"""Launching `tetrad train`: arguments -> config -> a job prepared once -> ranks. The launcher
checks the layout against the number of ranks, decides --overlap for their backend and prepares
the job (tetrad.train.job: model, layout and pipeline cut, tokenizer, checkpoint) before any
process starts, so bad input costs one line, not a traceback per rank; then the workers
(tetrad.parallel.launch: `--nproc N` local processes, or this process's rank under torchrun, whose
rank 0 prepares the job for all) each run tetrad.train.ranks on that job. The device is resolved
once: by the launcher for its ranks (rank r on cuda:r), by each torchrun process for itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tetrad.errors import ConfigError, TetradError
from tetrad.parallel.launch import (COLLECTIVE_TIMEOUT_S, WorkerFailed, init_worker, local_device,
                                    spawn, started_by_torchrun, torchrun_ranks)
from tetrad.planner.rules import ResolvedLayout
from tetrad.spec.model import TrainConfig
from tetrad.train.job import PreparedJob, prepare_job, resolve_run
from tetrad.train.ranks import train_worker
from tetrad.train.trainer import train

__all__ = ["WorkerFailed", "check_layout", "is_distributed", "launch_training", "run_training",
           "train_model", "train_worker"]


def check_layout(config: TrainConfig, world_size: int) -> ResolvedLayout:
    """What can be wrong with a distributed run's layout, as one ConfigError saying the fix;
    else the layout resolved for the run (tetrad.train.job.resolve_run)."""
    parallel = config.parallel
    if parallel.strategy == "ps":
        check_ps_processes(config, world_size)
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


def check_ps_processes(config: TrainConfig, world_size: int) -> None:
    parallel = config.parallel
    if world_size != parallel.num_processes:
        others = parallel.servers + parallel.ps_spares
        spares = f" + {parallel.ps_spares} spares" if parallel.ps_spares else ""
        hint = (f"e.g. --dp {world_size - others}" if world_size > others
                else f"e.g. --nproc {parallel.num_processes}")
        raise ConfigError(
            f"{world_size} processes but --strategy ps runs dp {parallel.dp} workers + "
            f"{parallel.servers} servers{spares} = {parallel.num_processes}: make --nproc (or "
            f"torchrun's world size) dp + servers{' + spares' if spares else ''}, {hint}")


def is_distributed(config: TrainConfig) -> bool:
    """Whether a run needs worker processes (ZeRO needs a process group even on one rank)."""
    return (config.nproc > 1 or config.parallel.num_processes > 1 or config.parallel.zero > 0
            or started_by_torchrun())


def with_overlap_decided(config: TrainConfig, device_type: str) -> TrainConfig:
    """--overlap unset: on with NCCL, where collectives run on their own stream beside the
    matmuls; off on gloo, where the CPU cores that compute also move the bytes (a tp2 step of the
    time-prediction benchmark's model took 2x as long chunked). Decided before the layout is
    resolved, so the ranks and the planner's prediction see the same choice."""
    if config.parallel.overlap is not None:
        return config
    parallel = dataclasses.replace(config.parallel, overlap=device_type == "cuda")
    return dataclasses.replace(config, parallel=parallel)


def prepare_for_ranks(config: TrainConfig, world_size: int, device: torch.device) -> PreparedJob:
    """The job `world_size` ranks on `device`'s kind of device train: --overlap decided for their
    backend, the layout checked against their number, then prepared."""
    config = with_overlap_decided(config, device.type)
    layout = check_layout(config, world_size)
    if config.parallel.strategy == "ps":
        from tetrad.parallel.ps.protocol import check_run

        check_run(config.batch_size, config.grad_accum, config.dtype, device, config.parallel.dp)
    return prepare_job(config, layout)


def job_of_rank_zero(config: TrainConfig, world_size: int, device: torch.device) -> PreparedJob:
    """Under torchrun every process runs the command; rank 0 alone prepares the job and the
    others receive it, so the inputs are read once per job. A TetradError of rank 0's is raised
    on every rank (one line each); any other failure is rank 0's traceback and the others'
    WorkerFailed."""
    outcome: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = prepare_for_ranks(config, world_size, device)
        except Exception as error:  # noqa: BLE001 - the other ranks wait for an outcome
            failure = error
            outcome[0] = error if isinstance(error, TetradError) else WorkerFailed(
                f"rank 0 failed while preparing the run: {type(error).__name__}: {error}")
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if isinstance(outcome[0], TetradError):
        raise outcome[0]
    return outcome[0]


def launch_training(config: TrainConfig):
    """Run `config` on config.nproc local workers, or as this process's rank under torchrun.
    Returns rank 0's TrainResult (None on the other torchrun ranks)."""
    if started_by_torchrun():
        rank, world_size, local_rank, local_world_size = torchrun_ranks()
        device = local_device(local_rank, local_world_size, config.device)
        init_worker(rank, world_size, local_rank, local_world_size, COLLECTIVE_TIMEOUT_S,
                    device=device)
        try:
            return train_worker(rank, world_size, job_of_rank_zero(config, world_size, device))
        finally:
            dist.destroy_process_group()
    # Decided once here (a missing GPU is one line, not a traceback per rank): rank r on cuda:r.
    device = local_device(0, config.nproc, config.device)
    job = prepare_for_ranks(config, config.nproc, device)
    parallel = job.config.parallel
    # Asynchronous parameter servers drop a dead worker (or spare) and go on, and a sync run with
    # spares gives a dead worker's slot to one; rank 0 writes the report. Replicated servers
    # (--ps-replicas 1) but the scheduler may die: standbys take over.
    scheduler = parallel.dp + parallel.ps_spares
    workers_may_die = parallel.ps_mode != "sync" or parallel.ps_spares > 0
    expendable = (frozenset(range(1, scheduler))
                  if parallel.strategy == "ps" and workers_may_die else frozenset())
    if parallel.strategy == "ps" and parallel.ps_replicas:
        expendable |= frozenset(range(scheduler + 1, scheduler + parallel.servers))
    return spawn(train_worker, config.nproc, (job,), expendable=expendable,
                 device_type=device.type, forward_signals=True)[0]


def run_training(config: TrainConfig):
    """One training run as `tetrad train` runs it: in this process, on config.nproc local
    workers, or as this process's rank under torchrun. Returns the TrainResult (None on torchrun
    ranks other than 0, whose rank 0 reports)."""
    if is_distributed(config):
        return launch_training(config)
    device = local_device(0, 1, config.device)
    return train(prepare_job(config), device=device)


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
