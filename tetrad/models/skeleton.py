"""A Transformer with no weights yet (every parameter on the meta device), for loaders that put
each weight in from a file: nothing initialized, nothing allocated.

Built plainly under `torch.device("meta")` the model's initializers (nn.init.normal_, ...) and the
rotary frequencies (arange, pow) run on meta tensors, which torch computes with its Python
references; their first call imports torch._dynamo, sympy and the symbolic-shape machinery (~150
MB resident that a served model never uses). Here the initializers are skipped (every parameter
is replaced at load) and the frequencies, recomputed on the device at load, are made on the CPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from tetrad.models.transformer import Transformer
from tetrad.spec.model import ModelConfig


class _NoInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # the tensor, left as it is
        if func is torch.arange and kwargs.get("device") is None:
            kwargs["device"] = "cpu"  # torch.device("meta") fills in only a missing device
        return func(*args, **kwargs)


def empty_model(config: ModelConfig) -> Transformer:
    """`config`'s Transformer with meta parameters (and CPU rotary frequencies)."""
    with torch.device("meta"), _NoInitOnMeta():
        return Transformer(config)
