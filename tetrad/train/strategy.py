"""The seam between the training loop and the way a model is spread over processes.

The trainer only talks to a strategy: it asks for this rank's share of the global batch, runs
forward through `strategy.model`, hands each microbatch's loss to `backward`, then calls
`finish_gradients`, `clip_grad_norm` and `step`. `LocalStrategy` does all of it in one process and
is the reference every parallel strategy must reproduce; data, tensor, pipeline ... parallel
strategies implement the same methods.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from tetrad.config import TrainConfig
from tetrad.parallel.comm import Comm
from tetrad.parallel.data_parallel import DEFAULT_BUCKET_BYTES, DataParallel
from tetrad.parallel.fsdp import FullyShardedDataParallel
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.zero import ZeroDataParallel
from tetrad.planner.precision import TrainingPrecision, training_precision
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = {"fp32": torch.float32, **AUTOCAST_DTYPES}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values()
                        if torch.is_tensor(value))


class LocalStrategy:
    """Everything in one process: full model, full optimizer, no communication."""

    rank = 0
    world_size = 1
    coords = {"dp": 0, "pp": 0, "cp": 0, "tp": 0, "ep": 0}

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device):
        self.model = model
        self.device = device
        self.config = config
        self.optimizer = build_optimizer(parameter_groups(model, config.weight_decay), config)
        # fp16 needs loss scaling: its small exponent range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "fp16")
        self.comm = None  # no collectives: the run report's comm_bytes stay zero

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global batch [batch_size, seq_len + 1]."""
        return batch

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        dtype = AUTOCAST_DTYPES.get(self.config.dtype)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            yield

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.scaler.scale(loss).backward()

    def finish_gradients(self) -> None:
        """Wait for gradient communication; gradients are final (and unscaled) afterwards."""
        self.scaler.unscale_(self.optimizer)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to max_norm (0 means no clipping) and return the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                    max_norm if max_norm > 0 else float("inf")))

    def step(self, lr: float) -> bool:
        """Apply the update; False when fp16 loss scaling found inf/nan and skipped it."""
        set_learning_rate(self.optimizer, lr)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._zero_grad()
        return scale_before is None or self.scaler.get_scale() >= scale_before

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def global_mean(self, value: float) -> float:
        """Average of a per-rank number over the ranks that split the batch."""
        return value

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (collective): the run report's per-rank entries."""
        return [value]

    def whole_model(self) -> nn.Module:
        """The model with every parameter whole on this rank, for using it on one rank alone
        (sampling at the end of a run). Collective: every rank calls it."""
        return self.model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by kind. Called while gradients are live."""
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optimizer": optimizer_state_bytes(self.optimizer)}


class DataParallelRanks:
    """What the data-parallel strategies share: where this rank sits in the mesh, its slice of
    the global batch, and means over the ranks that split the batch."""

    def _join_mesh(self, mesh: Mesh, collectives: Comm) -> None:
        self.mesh, self.collectives = mesh, collectives
        self.comm = collectives.counter  # the trainer reports comm.totals_per_step()
        self.rank, self.world_size, self.coords = mesh.rank, mesh.dims.world_size, mesh.coords
        # Context-parallel ranks hold the same weights as data-parallel ones: reduce over both.
        self.group = mesh["dp_cp"]

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        dp = self.mesh["dp"]
        rows = batch.shape[0] // dp.size
        return batch[dp.index * rows:(dp.index + 1) * rows]

    def global_mean(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.collectives.all_reduce(total, self.mesh["dp"], "metrics")
        return total.item() / self.mesh["dp"].size

    def gather(self, value: Any) -> list[Any]:
        return self.collectives.all_gather_object(value, self.mesh["world"], "report")


class DataParallelStrategy(DataParallelRanks, LocalStrategy):
    """ZeRO-0 (DDP): the single-process strategy plus bucketed gradient all-reduce overlapped
    with backward; the optimizer, loss scaler and clipping stay LocalStrategy's."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, mesh: Mesh,
                 collectives: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        LocalStrategy.__init__(self, model, config, device)
        self._join_mesh(mesh, collectives)
        self.ddp = DataParallel(model, self.group, collectives, bucket_bytes)

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.ddp.prepare_backward(is_last_microbatch)
        super().backward(loss, is_last_microbatch)

    def finish_gradients(self) -> None:
        self.ddp.finish()
        super().finish_gradients()

    def step(self, lr: float) -> bool:
        applied = super().step(lr)
        self.comm.end_step()
        return applied

    def _zero_grad(self) -> None:
        self.ddp.zero_grad()  # in place: the .grad tensors are views of the buckets


class ZeroStrategy(DataParallelRanks):
    """ZeRO stage 1, 2 or 3 (optionally with the optimizer offloaded to host memory). The engine
    owns the sharded optimizer; AdamW's hyper-parameters come from build_optimizer, as in the
    single-process run, and the weight-decay groups from parameter_groups."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, mesh: Mesh,
                 collectives: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model, self.config, self.device = model, config, device
        self._join_mesh(mesh, collectives)
        defaults = build_optimizer([torch.empty(0)], config).defaults
        options = dict(param_groups=parameter_groups(model, config.weight_decay),
                       betas=defaults["betas"], eps=defaults["eps"],
                       compute_dtype=COMPUTE_DTYPES[config.dtype],
                       offload=config.parallel.offload)
        if config.parallel.zero == 3:
            self.engine = FullyShardedDataParallel(model, self.group, collectives, **options)
        else:
            self.engine = ZeroDataParallel(model, self.group, collectives, config.parallel.zero,
                                           bucket_bytes=bucket_bytes, **options)

    autocast = LocalStrategy.autocast

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.engine.backward(loss, is_last_microbatch)

    def finish_gradients(self) -> None:
        self.engine.finish_gradients()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.engine.clip_grad_norm(max_norm)

    def step(self, lr: float) -> bool:
        applied = self.engine.step(lr)
        self.comm.end_step()
        return applied

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def bytes_held(self) -> dict[str, int]:
        return self.engine.bytes_held()

    def whole_model(self) -> nn.Module:
        if isinstance(self.engine, FullyShardedDataParallel):
            self.engine.gather_full_model()
        return self.model


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
        return LocalStrategy(model, config, device)
    if config.parallel.zero == 0:
        return DataParallelStrategy(model, config, device, mesh, collectives)
    return ZeroStrategy(model, config, device, mesh, collectives)
