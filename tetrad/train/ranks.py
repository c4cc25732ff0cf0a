"""What each rank of `tetrad train` runs, on the job the launcher prepared (tetrad.train.job) and
the device its process group was set up on: its mesh, its byte counter and the trainer, or, with
--strategy ps, a worker's trainer or a parameter server."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.launch import rank_device
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.spec.model import TrainConfig
from tetrad.train import checkpoint as ckpt
from tetrad.train.job import PreparedJob, prepare_job
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.strategy import build_strategy
from tetrad.train.trainer import build_model, train


def train_worker(rank: int, world_size: int, job: PreparedJob | TrainConfig):
    """One rank of `tetrad train`. A TrainConfig is prepared on this rank: the multi-rank tests
    and benchmarks that are their own launcher. Rank 0 returns the TrainResult (report with every
    rank's entry, checkpoint, sample), the others None."""
    if isinstance(job, TrainConfig):
        job = prepare_job(job)
    device = rank_device()
    if job.config.parallel.strategy == "ps":
        return ps_rank(rank, world_size, job, device)
    mesh = build_mesh(job.config.parallel, rank, world_size)
    collectives = Comm(CommCounter(), job.config.parallel.collectives)
    result = train(job, partial(build_strategy, mesh=mesh, collectives=collectives),
                   show_progress=rank == 0, device=device)
    return result if rank == 0 else None


def ps_options(config: TrainConfig):
    from tetrad.parallel.ps import PSOptions

    parallel = config.parallel
    return PSOptions(num_servers=parallel.servers, mode=parallel.ps_mode,
                     staleness=parallel.staleness, replicas=parallel.ps_replicas,
                     spares=parallel.ps_spares, join_step=parallel.ps_join_step)


def ps_rank(rank: int, world_size: int, job: PreparedJob, device: torch.device):
    """One rank of `tetrad train --strategy ps`: workers (the first dp ranks) run the trainer with
    the parameter-server strategy, servers serve until every worker said goodbye or died."""
    from tetrad.parallel.ps import ParameterServer
    from tetrad.parallel.ps.worker import await_admission
    from tetrad.train.ps_strategy import ParameterServerStrategy

    options = ps_options(job.config)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    comm = Comm(CommCounter())
    roles = options.roles(world_size)
    if not roles.is_server(rank):
        # A spare waits until it takes a dead worker's place, or the run ends without it.
        admission = await_admission(world, comm, options) if roles.is_spare(rank) else None
        if roles.is_spare(rank) and admission is None:
            return None
        result = train(job, partial(ParameterServerStrategy, world=world, comm=comm,
                                    options=options, admission=admission),
                       show_progress=rank == 0, device=device)
        return result if rank == 0 else None
    model = build_model(job.model_config, job.config)  # the seed's parameters, as the workers'
    defaults = build_optimizer([torch.empty(0)], job.config).defaults
    server = ParameterServer(model, parameter_groups(model, job.config.weight_decay), world, comm,
                             options, defaults["betas"], defaults["eps"])
    if job.resume_from is not None:
        server.load_state_dict(ckpt.load_checkpoint(job.resume_from, job.model_config)[1])
    server.serve()  # its entry and the summary reach rank 0's report through the scheduler
    return None
