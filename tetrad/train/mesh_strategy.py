"""The strategies over a process mesh. Both take any 4D layout, applied to the model by
tetrad.parallel.parallelize in its one fixed order, and differ only in who owns the optimizer:
`DataParallelStrategy` keeps a whole AdamW on every rank (DDP), `ZeroStrategy` shards it over
dp x cp (ZeRO 1-3). With a pipeline the step's microbatches are the executor's. In a checkpoint each rank
writes its own pieces, described in the single-process tensors' coordinates, so a run resumes
under any layout (tetrad.sharded_tensors)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tetrad.config import TrainConfig
from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.parallelize import DataParallelOptions, ParameterView, parallelize
from tetrad.parallel.zero_optimizer import LossScaler
from tetrad.sharded_tensors import CHECKPOINT_KINDS, Piece, assemble
from tetrad.train.local_strategy import (COMPUTE_DTYPES, LocalStrategy, load_named,
                                         named_moments, named_state, optimizer_state_bytes,
                                         tensor_bytes)
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate


class MeshStrategy(LocalStrategy):
    """What the strategies over a process mesh share: the layout applied to the model, this
    rank's rows of the batch (every cp and tp rank of a dp index reads the same rows), the
    pipeline's step, global means and norms, this rank's pieces for checkpoints."""

    def _join_mesh(self, model: Transformer, config: TrainConfig, device: torch.device,
                   mesh: Mesh, collectives: Comm, bucket_bytes: int) -> None:
        self.config, self.device = config, device
        self.mesh, self.collectives = mesh, collectives
        self.comm = collectives.counter  # the trainer reports comm.totals_per_step()
        self.rank, self.world_size, self.coords = mesh.rank, mesh.dims.world_size, mesh.coords
        defaults = build_optimizer([torch.empty(0)], config).defaults
        options = DataParallelOptions(
            lambda params: parameter_groups(params, config.weight_decay), defaults["betas"],
            defaults["eps"], COMPUTE_DTYPES[config.dtype], bucket_bytes)
        self.parallel = parallelize(model, mesh, collectives, config.parallel, config.seq_len,
                                    options, self.autocast)
        self.model = self.parallel.module
        self.params = self.parallel.params
        self.meter = ActivationMeter(self.model)  # after the engine moved the parameters
        self.grad_norm = 0.0
        self.pipeline_peak, self.idle_fractions = 0, []

    @property
    def activations_peak(self) -> int:
        return self.pipeline_peak if self.parallel.pipeline else self.meter.peak_bytes

    @property
    def idle_fraction(self) -> float:
        """The pipeline's measured bubble, averaged over the steps."""
        return sum(self.idle_fractions) / len(self.idle_fractions) if self.idle_fractions else 0.0

    def loss_scale(self) -> float:
        """What the objective is multiplied by before backward (fp16 loss scaling)."""
        return self.scaler.scale if self.scaler else 1.0

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        pipeline = self.parallel.pipeline
        if pipeline is None:
            return super().forward_backward(batch)
        # The executor runs its own microbatches; --grad-accum repeats whole pipeline steps.
        chunks = self.local_batch(batch).to(self.device).chunk(self.config.grad_accum)
        loss_sum = aux_sum = 0.0
        for index, chunk in enumerate(chunks):
            stats = pipeline.step(chunk, loss_scale=self.loss_scale() / len(chunks),
                                  last_of_step=index == len(chunks) - 1)
            loss_sum += stats.loss / len(chunks)
            aux_sum += (stats.aux_loss or 0.0) / len(chunks)
            self.pipeline_peak = max(self.pipeline_peak, stats.peak_activation_bytes)
            self.idle_fractions.append(stats.idle_fraction)
        aux_mean = self.global_mean(aux_sum) if self.parallel.config.is_moe else None
        return self.global_mean(loss_sum), aux_mean

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        dp = self.mesh["dp"]
        rows = batch.shape[0] // dp.size
        return batch[dp.index * rows:(dp.index + 1) * rows]

    def split(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.parallel.split(window)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.parallel.loss(logits, targets)

    def global_mean(self, value: float) -> float:
        """Mean over dp x cp: each of those ranks scored its own tokens, and the same number of
        them (tp and pp ranks of one position agree already)."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.collectives.all_reduce(total, self.mesh["dp_cp"], "metrics")
        return total.item() / self.mesh["dp_cp"].size

    def gather(self, value: Any) -> list[Any]:
        return self.collectives.all_gather_object(value, self.mesh["world"], "report")

    def finish_gradients(self) -> None:
        """Gradients reduced and unscaled, and their global norm (which also decides, with fp16,
        whether the step is skipped: on every rank alike)."""
        self._reduce_gradients()
        self.grad_norm = self.parallel.grad_norm()

    def _reduce_gradients(self) -> None:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> float:
        self._clip(max_norm)
        return self.grad_norm

    def _clip(self, max_norm: float) -> None:
        """Scale the gradients by clip_coefficient(self.grad_norm, max_norm)."""
        raise NotImplementedError

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """This rank's pieces of the parameters and AdamW moments (what it alone writes in a
        sharded checkpoint), and the state every rank shares (optimizer step, loss scaler)."""
        return self._pieces(CHECKPOINT_KINDS), {
            "optimizer": {"step": self._optimizer_step()},
            "scaler": self.scaler.state_dict() if self.scaler else None}

    def _pieces(self, kinds: tuple[str, ...]) -> list[Piece]:
        """This rank's pieces of `kinds` (of CHECKPOINT_KINDS)."""
        raise NotImplementedError

    def _optimizer_step(self) -> int:
        raise NotImplementedError

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's `value` (collective over the world, tag "checkpoint")."""
        return self.collectives.all_gather_object(value, self.mesh["world"], "checkpoint")

    def _local_pieces(self, state: dict) -> tuple[dict, dict | None]:
        """This rank's pieces of a checkpoint's whole tensors: parameters by name, and the
        optimizer state (step, moments by name) when the checkpoint has it."""
        def local(whole) -> dict:
            return self.parallel.local_named(whole, self.params)

        optimizer = state.get("optimizer")
        return local(state["model"]), optimizer and {
            "step": optimizer["step"], "exp_avg": local(optimizer["exp_avg"]),
            "exp_avg_sq": local(optimizer["exp_avg_sq"])}

    def whole_model(self) -> nn.Module:
        """Every rank's parameter pieces exchanged and assembled: the whole model on each rank."""
        by_name: dict[str, list[Piece]] = {}
        for rank_pieces in self.exchange(self._pieces(("model",))):
            for piece in rank_pieces:
                by_name.setdefault(piece.name, []).append(piece)
        whole = Transformer(self.parallel.config)
        whole.load_state_dict({name: assemble(parts) for name, parts in by_name.items()},
                              strict=False)
        return whole.to(self.device)

    def _named_pieces(self, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                      kinds: tuple[str, ...]) -> list[Piece]:
        """Pieces of `kinds` of parameters a torch AdamW steps whole on this rank."""
        return [piece for kind, tensors in named_state(params, optimizer).items()
                if kind in kinds for piece in self.parallel.pieces(kind, tensors)]


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """torch.nn.utils.clip_grad_norm_'s factor (None: leave the gradients alone)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return None
    return min(max_norm / (norm + 1e-6), 1.0)


def loss_scaler_state(state: dict | None) -> dict | None:
    """A loss scaler's state from any checkpoint (torch's GradScaler counts "_growth_tracker")."""
    return state and {"scale": state["scale"],
                      "clean_steps": state.get("clean_steps", state.get("_growth_tracker", 0))}


class DataParallelStrategy(MeshStrategy):
    """ZeRO-0 (DDP) under any layout: every rank steps a whole AdamW over the parameters it holds
    (its tp shards, its stages, its experts), their gradients averaged over dp x cp by bucketed
    all-reduces overlapped with backward. fp16 scales the loss; a step whose global gradient norm
    is inf/nan is skipped on every rank."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, mesh: Mesh,
                 collectives: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._join_mesh(model, config, device, mesh, collectives, bucket_bytes)
        self.ddp = self.parallel.engine
        self.optimizer = build_optimizer(
            parameter_groups(ParameterView(self.params), config.weight_decay), config)
        self.scaler = LossScaler() if config.dtype == "fp16" else None

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.ddp.prepare_backward(is_last_microbatch)
        (loss * self.scaler.scale if self.scaler else loss).backward()

    def _reduce_gradients(self) -> None:
        self.parallel.reduce_gradients()
        if self.scaler:
            for param in self.params.values():
                if param.grad is not None:
                    param.grad.div_(self.scaler.scale)

    def _clip(self, max_norm: float) -> None:
        coefficient = clip_coefficient(self.grad_norm, max_norm)
        if coefficient is not None:
            for param in self.params.values():
                if param.grad is not None:
                    param.grad.mul_(coefficient)

    def step(self, lr: float) -> bool:
        applied = math.isfinite(self.grad_norm)  # a global norm: every rank decides alike
        if self.scaler:
            self.scaler.update(found_inf=not applied)
        if applied:
            set_learning_rate(self.optimizer, lr)
            self.optimizer.step()
        self.ddp.zero_grad()  # in place: the .grad tensors are views of the buckets
        for name in self.parallel.expert_names:
            self.params[name].grad = None
        self.comm.end_step()
        return applied

    def _pieces(self, kinds: tuple[str, ...]) -> list[Piece]:
        return self._named_pieces(self.params, self.optimizer, kinds)

    def _optimizer_step(self) -> int:
        return named_moments(self.optimizer, self.params)[2]

    def load_state_dict(self, state: dict) -> None:
        load_named(self.optimizer, self.params, *self._local_pieces(state))
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(loss_scaler_state(state["scaler"]))

    def bytes_held(self) -> dict[str, int]:
        params = list(self.params.values())
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optimizer": optimizer_state_bytes(self.optimizer)}


class ZeroStrategy(MeshStrategy):
    """ZeRO stage 1, 2 or 3 (optionally with the optimizer offloaded to host memory) under any
    layout: the engine shards the replicated parameters' optimizer state (and gradients, and
    parameters) over dp x cp; AdamW's hyper-parameters come from build_optimizer, as in the
    single-process run. Experts (ep > 1) are not sharded: they keep a whole AdamW of their own."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, mesh: Mesh,
                 collectives: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._join_mesh(model, config, device, mesh, collectives, bucket_bytes)
        self.engine = self.parallel.engine
        self.scaler = self.engine.scaler
        self.experts = {name: self.params[name] for name in self.parallel.expert_names}
        self.expert_optimizer = build_optimizer(
            parameter_groups(ParameterView(self.experts), config.weight_decay), config) \
            if self.experts else None

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.engine.backward(loss, is_last_microbatch)

    def _reduce_gradients(self) -> None:
        self.parallel.reduce_gradients()
        if self.scaler:  # the engine unscales its shards; the experts' gradients are here
            for param in self.experts.values():
                param.grad.div_(self.scaler.scale)

    def finish_gradients(self) -> None:
        super().finish_gradients()
        self.engine.grad_norm = self.grad_norm  # it clips its shards, skips fp16 overflows by it

    def _clip(self, max_norm: float) -> None:
        self.engine.clip_grad_norm(max_norm)
        coefficient = clip_coefficient(self.grad_norm, max_norm)
        if coefficient is not None:
            for param in self.experts.values():
                param.grad.mul_(coefficient)

    def step(self, lr: float) -> bool:
        applied = self.engine.step(lr)
        if self.expert_optimizer:
            if applied:
                set_learning_rate(self.expert_optimizer, lr)
                self.expert_optimizer.step()
            self.expert_optimizer.zero_grad(set_to_none=True)
        self.comm.end_step()
        return applied

    def _pieces(self, kinds: tuple[str, ...]) -> list[Piece]:
        experts = (self._named_pieces(self.experts, self.expert_optimizer, kinds)
                   if self.experts else [])
        return self.parallel.engine_pieces(kinds) + experts

    def _optimizer_step(self) -> int:
        return self.engine.optimizer.step_count

    def load_state_dict(self, state: dict) -> None:
        params, moments = self._local_pieces(state)
        # The engine looks up only what its shards hold: no experts, and only their own ranges.
        self.engine.load_state_dict({"model": params, "optimizer": moments,
                                     "scaler": loss_scaler_state(state.get("scaler"))})
        if self.experts:
            load_named(self.expert_optimizer, self.experts, params, moments)

    def bytes_held(self) -> dict[str, int]:
        held = self.engine.bytes_held()
        if self.experts:
            experts = list(self.experts.values())
            held["params"] += tensor_bytes(experts)
            held["grads"] += tensor_bytes(p.grad for p in experts)
            held["optimizer"] += optimizer_state_bytes(self.expert_optimizer)
        return held
