"""The seam between the training loop and the way a model is spread over processes.

The trainer only talks to a strategy: `forward_backward(batch)` runs one step's forward and
backward on this rank's share of the global batch and returns the global-batch loss, then the
trainer calls `finish_gradients`, `clip_grad_norm` and `step`. `LocalStrategy` does all of it in
one process and is the reference every parallel layout must reproduce. The two strategies over a
process mesh differ only in who owns the optimizer: `DataParallelStrategy` keeps a whole AdamW on
every rank (DDP), `ZeroStrategy` shards it over dp x cp (ZeRO 1-3). Both take any 4D layout: the
model is spread by tetrad.parallel.parallelize, in its one fixed order, and with a pipeline the
step's microbatches are the executor's.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.config import TrainConfig
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.recompute import apply_recompute
from tetrad.planner.precision import TrainingPrecision, training_precision
from tetrad.train.local_strategy import LocalStrategy
from tetrad.train.mesh_strategy import DataParallelStrategy, ZeroStrategy

__all__ = ["LocalStrategy", "DataParallelStrategy", "ZeroStrategy", "build_strategy",
           "planned_precision"]


def planned_precision(config: TrainConfig) -> TrainingPrecision:
    """Bytes per parameter and activation element of the strategy build_strategy picks, for the
    planner's prediction: single-process and DDP autocast over fp32 parameters (no separate master
    copy); ZeRO keeps low-precision parameters and gradients beside fp32 master weights."""
    if config.dtype == "fp32" or config.parallel.zero > 0:
        return training_precision(config.dtype)
    return TrainingPrecision(config.dtype, param_bytes=4, grad_bytes=4, master_bytes=0,
                             optimizer_bytes=8, activation_bytes=2)


def build_strategy(model: nn.Module, config: TrainConfig, device: torch.device,
                   mesh: Mesh | None = None, collectives: Comm | None = None):
    """The strategy for config.parallel on this rank's mesh (none: single process)."""
    if mesh is None:
        # One process still honours --recompute: it changes what backward keeps, never the
        # numbers (multi-rank layouts apply it in parallelize's fixed order).
        apply_recompute(model, config.parallel.recompute)
        return LocalStrategy(model, config, device)
    if config.parallel.zero == 0:
        return DataParallelStrategy(model, config, device, mesh, collectives)
    return ZeroStrategy(model, config, device, mesh, collectives)
