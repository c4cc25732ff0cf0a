"""The seam between the training loop and the way a model is spread over processes.

The trainer only talks to a strategy: it asks for this rank's share of the global batch, runs
forward through `strategy.model`, hands each microbatch's loss to `backward`, then calls
`finish_gradients`, `clip_grad_norm` and `step`. `LocalStrategy` does all of it in one process and
is the reference every parallel strategy must reproduce; data, tensor, pipeline ... parallel
strategies implement the same methods.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from tetrad.config import TrainConfig
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
        self.optimizer.zero_grad(set_to_none=True)
        return scale_before is None or self.scaler.get_scale() >= scale_before

    def global_mean(self, value: float) -> float:
        """Average of a per-rank number over the ranks that split the batch."""
        return value

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
