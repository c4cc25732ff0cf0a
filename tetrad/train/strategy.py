"""The seam between the training loop and the way a model is spread over processes.

The trainer only talks to a `Strategy`: `forward_backward(batch)` runs one step's forward and
backward on this rank's share of the global batch and returns the global-batch loss, then the
trainer calls `finish_gradients`, `clip_grad_norm` and `step`. `LocalStrategy` does all of it in
one process and is the reference every parallel layout must reproduce. `MeshStrategy` takes any 4D
layout and any data-parallel engine (DDP, ZeRO 1-3): the model is spread by
tetrad.parallel.parallelize, in its one fixed order, and with a pipeline the step's microbatches
are the executor's. `ParameterServerStrategy` is a parameter-server worker
(tetrad.train.ps_strategy). All of them run the one microbatch loop of tetrad.train.microbatches.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from tetrad.spec.model import TrainConfig
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.compile import apply_compile
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.kept_inputs import kept_inputs_of
from tetrad.parallel.recompute import apply_recompute
from tetrad.planner.precision import TrainingPrecision, training_precision
from tetrad.sharded_tensors import Piece
from tetrad.train.local_strategy import LocalStrategy
from tetrad.train.mesh_strategy import MeshStrategy
from tetrad.train.microbatches import apply_precision

__all__ = ["Strategy", "LocalStrategy", "MeshStrategy", "build_strategy", "planned_precision"]


class Strategy(Protocol):
    """Everything the trainer (tetrad.train.trainer) asks of a strategy."""

    rank: int
    world_size: int
    coords: dict[str, int]  # this rank's place on the mesh, for the run report
    comm: CommCounter | None  # the bytes it sent (None: no collectives)
    summary: dict | None  # a run summary for the report (the parameter server's), after gather

    @property
    def activations_peak(self) -> int:
        """Most bytes saved for backward at once in any step so far."""

    @property
    def idle_fraction(self) -> float:
        """The pipeline's measured bubble (0 without one)."""

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        """One step's forward and backward on this rank's share of the global batch
        [batch_size, seq_len + 1]: the global batch's mean loss (and MoE load-balance loss) on
        rank 0, which logs it (a parallel rank elsewhere may return its own share's)."""

    def finish_gradients(self) -> None:
        """Gradients final (reduced, unscaled) and their global norm known."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to max_norm (0: no clipping); the global norm before clipping."""

    def step(self, lr: float) -> bool:
        """Apply the update; False when fp16 loss scaling found inf/nan and skipped it."""

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by kind. Called while gradients are live."""

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on rank 0 (collective): the run report's
        per-rank entries (a rank that writes no report may get only its own)."""

    def whole_model(self) -> nn.Module:
        """The model with every parameter whole on this rank (collective)."""

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """This rank's pieces of the parameters and AdamW moments, and the shared state."""

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's `value` (collective): how the ranks agree on a save."""

    def agree_on_signal(self, signum: int) -> int:
        """The stop signal any rank received (0: none), the same on every rank (collective, once
        per step: tetrad.train.stop)."""

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint of any layout: whole tensors by name (tetrad.sharded_tensors)."""


def planned_precision(config: TrainConfig) -> TrainingPrecision:
    """Bytes per parameter and activation element of the strategy build_strategy picks, for the
    planner's prediction: single-process and DDP autocast over fp32 parameters (no separate master
    copy); ZeRO keeps low-precision parameters and gradients beside fp32 master weights."""
    if config.dtype == "fp32" or config.parallel.zero > 0:
        return training_precision(config.dtype, fp8_recipe=config.fp8_recipe)
    return TrainingPrecision(config.dtype, param_bytes=4, grad_bytes=4, master_bytes=0,
                             optimizer_bytes=8, activation_bytes=2, fp8_recipe=config.fp8_recipe)


def build_strategy(model: nn.Module, config: TrainConfig, device: torch.device,
                   mesh: Mesh | None = None, collectives: Comm | None = None) -> Strategy:
    """The strategy for config.parallel on this rank's mesh (none: single process)."""
    apply_precision(model, config.dtype, config.fp8_recipe)
    if mesh is None:
        # One process still honours --compile and --recompute, in parallelize's order: they
        # change how a step runs and what backward keeps (compiled fp32 arithmetic differs from
        # eager by about 1e-7 relative, docs/compile.md).
        if config.compile:
            apply_compile(model)
        apply_recompute(model, config.parallel.recompute,
                        kept=kept_inputs_of(config.parallel))
        return LocalStrategy(model, config, device)
    return MeshStrategy(model, config, device, mesh, collectives)
