"""One step's microbatches, forward and backward on this rank's replica of the model: the one
loop every strategy without a pipeline runs (single process, a process mesh, a parameter-server
worker). What differs between them comes in as functions: how a window is cut (`split`), scored
(`loss`) and sent backward (`backward`: loss scaling, gradient reduction hooks)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tetrad.memory import ActivationMeter
from tetrad.models.fp8_layers import convert_to_fp8

# fp8 autocasts to bf16 around its FP8 linears (tetrad.models.fp8): the rest of the model is bf16.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
COMPUTE_DTYPES = {"fp32": torch.float32, **AUTOCAST_DTYPES}

Split = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, Any]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Backward = Callable[[torch.Tensor, bool], None]


def apply_precision(model: nn.Module, dtype: str, fp8_recipe: str = "block") -> nn.Module:
    """What `dtype` changes in the model itself before any layout splits it: fp8 swaps the
    block linears for FP8 ones in `fp8_recipe` (their tensor-parallel shards inherit it)."""
    return convert_to_fp8(model, fp8_recipe) if dtype == "fp8" else model


@contextlib.contextmanager
def autocast(device: torch.device, dtype: str) -> Iterator[None]:
    """Mixed precision for `dtype` ("fp32": none) on `device`."""
    compute = AUTOCAST_DTYPES.get(dtype)
    with torch.autocast(device.type, dtype=compute, enabled=compute is not None):
        yield


class MicrobatchLoop:
    """`grad_accum` microbatches of a rank's rows, each forward, scored and sent backward, with
    the activation bytes saved for backward measured (`meter`)."""

    def __init__(self, model: nn.Module, device: torch.device, grad_accum: int, dtype: str,
                 split: Split, loss: Loss, backward: Backward):
        self.model, self.device, self.grad_accum, self.dtype = model, device, grad_accum, dtype
        self.split, self.loss, self.backward = split, loss, backward
        self.meter = ActivationMeter(model)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.dtype)

    def run(self, rows: torch.Tensor, global_mean: Callable[[float], float] = float
            ) -> tuple[float, float | None]:
        """Forward and backward of every microbatch of `rows` [rows, seq_len + 1]; returns the
        mean loss (and mean MoE load-balance loss), each averaged over the ranks that split the
        batch by `global_mean` (a collective)."""
        microbatches = rows.to(self.device).chunk(self.grad_accum)
        loss_sum, aux_sum = 0.0, None
        for index, window in enumerate(microbatches):
            inputs, targets, positions = self.split(window)
            with self.meter.measure(), self.autocast():
                logits = self.model(inputs, positions=positions)
                loss = self.loss(logits, targets)
                aux = self.model.aux_loss()
                objective = (loss if aux is None
                             else loss + self.model.config.router_aux_loss_coef * aux)
            self.meter.finish_microbatch()
            self.backward(objective / len(microbatches), index == len(microbatches) - 1)
            loss_sum += loss.item() / len(microbatches)
            if aux is not None:
                aux_sum = (aux_sum or 0.0) + aux.item() / len(microbatches)
        aux_mean = None if aux_sum is None else global_mean(aux_sum)
        return global_mean(loss_sum), aux_mean


def whole_sequences(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """A microbatch window [batch, seq + 1] -> inputs, targets, positions (None: 0..seq-1)."""
    return window[:, :-1], window[:, 1:], None
