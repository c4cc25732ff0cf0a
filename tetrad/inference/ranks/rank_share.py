"""This rank's place in a multi-rank serving engine (tetrad.inference.ranks.driver): its process groups,
its share of the model for the layout, what it computes in a step, and what it holds.

Imported by ranks.py (the driver and the worker loop) and by the runner through the RankShare
protocol (inference/config.py): `shard` cuts the rank's share, `agree` sizes the KV pools alike,
`size` is the tensor-parallel degree the pool's kv heads are split by.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tetrad.spec.model import ParallelConfig
from tetrad.inference.ranks.data_parallel import DataParallelStep
from tetrad.inference.worker.kv_cache import KVPlan
from tetrad.spec.serving import ServeLayout
from tetrad.inference.ranks.pipeline import PipelineStep, serving_stage
from tetrad.inference.worker.runner import ModelRunner, StepPlan
from tetrad.inference.worker.tensor_experts import spread_experts
from tetrad.models.fp8_weights import weight_bytes
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.expert_parallel import apply_expert_parallel
from tetrad.parallel.launch import rank_device
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.tensor_parallel import apply_tensor_parallel

IDLE_TIMEOUT = datetime.timedelta(days=365)  # the control group's: an idle engine waits forever
SETUP_TAG = "setup"  # Comm tag of the start-up exchanges

# What a rank computes in a step from every dp rank's plan: its logits block, or None (a pipeline
# stage before the last).
RankStep = Callable[[list[StepPlan]], "torch.Tensor | None"]


def held_bytes(runner: ModelRunner) -> dict[str, int]:
    """What a rank holds, counted on its tensors: weight bytes (FP8 ones at 1 byte plus their
    scales), KV-pool bytes per token slot, and the whole pool's bytes (its pad block included)."""
    pool = runner.kv_cache.pool
    pool_bytes = pool.numel() * pool.element_size()
    return {"weights": weight_bytes(runner.model),
            "kv_per_token": pool_bytes // (pool.shape[2] * pool.shape[3]),
            "kv_pool": pool_bytes}


class ServingRanks:
    """This rank's place in a process group that spans exactly the engine's tp*pp*dp ranks: the
    control group (the step messages), the Comm that counts every byte, the device, and, once
    the layout is known (`build`), the mesh of the distributed core: mesh["tp"] carries the
    tensor-parallel collectives, mesh["pp"] the stages' activations, mesh["ep"] the experts'
    tokens. Collective: every rank constructs it and calls its methods, in the same order."""

    def __init__(self, device: torch.device | None = None):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        ranks = list(range(self.world_size))
        self.control = Group("control", tuple(ranks), self.rank,
                             dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo"))
        self.comm = Comm(CommCounter())
        # In a process group someone else started its backend decides.
        self.device = device or rank_device()
        self.layout = ServeLayout()
        self.dims = ParallelConfig()
        self.mesh = None

    def build(self, layout: ServeLayout) -> None:
        self.layout = layout
        # Experts inside the tp group use mesh["tp"]; the mesh's ep axis is over the dp ranks.
        self.dims = ParallelConfig(tp=layout.tp, pp=layout.pp, dp=layout.dp,
                                   ep=layout.ep if layout.tp == 1 else 1)
        self.mesh = build_mesh(self.dims, self.rank, self.world_size)

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords

    @property
    def size(self) -> int:
        """Tensor-parallel ranks: what the KV pool of one rank is sized for."""
        return self.layout.tp

    def share(self, value):
        """Rank 0's `value` on every rank (the others pass None)."""
        return self.comm.all_gather_object(value, self.control, SETUP_TAG)[0]

    def shard(self, model: nn.Module) -> nn.Module:
        """This rank's share of the whole `model`, whose layers are replaced in place: split over
        tp, its experts kept over ep (inside the tp group, or over the dp ranks), its stage's
        layers under pp."""
        if self.layout.tp > 1:
            split = apply_tensor_parallel(model, self.mesh, self.comm)
            if self.layout.ep > 1:  # ep = tp: whole experts over the tp group
                spread_experts(model, split.tp)
        elif self.layout.ep > 1:
            apply_expert_parallel(model, self.mesh, self.comm)
        if self.layout.pp > 1:
            return serving_stage(model, self.coords["pp"], self.layout.pp)
        return model

    def agree(self, plan: KVPlan) -> KVPlan:
        """Every rank's pool gets the blocks the tightest rank can hold (on GPUs each rank sized
        its pool from its own free memory; stages hold different layers): the block ids rank 0
        hands out must exist on all."""
        blocks = self.comm.all_gather_object(plan.num_blocks, self.control, SETUP_TAG)
        return plan.with_blocks(min(blocks))

    def step_of(self, runner: ModelRunner) -> RankStep:
        if self.layout.pp > 1:
            return PipelineStep(runner, self.mesh["pp"], self.comm)
        if self.layout.dp > 1:
            return DataParallelStep(runner, self.coords["dp"])
        return lambda plans: runner.execute(plans[0])

    def logits_holders(self) -> list[list[int]]:
        """[dp rank][tp rank] -> the global rank that holds that block of the logits: the last
        pipeline stage's."""
        last = self.layout.pp - 1
        return [[self.dims.rank_of(pp=last, dp=d, tp=t) for t in range(self.layout.tp)]
                for d in range(self.layout.dp)]

    @property
    def holds_logits(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    def close(self) -> None:
        dist.destroy_process_group(self.control.handle)
