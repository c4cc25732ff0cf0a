"""`--dtype fp8` in the model: which linears run in FP8, and in which recipe (`--fp8-recipe`):
"block", DeepSeek-V3's 128x128 weight blocks and 1x128 activation tiles (tetrad.models.fp8), or
"tensor", one scale per tensor (tetrad.models.fp8_tensorwise)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tetrad.models.fp8 import fp8_linear
from tetrad.models.fp8_tensorwise import tensorwise_fp8_linear

RECIPES: dict[str, Callable[..., torch.Tensor]] = {"block": fp8_linear,
                                                   "tensor": tensorwise_fp8_linear}


class FP8Linear(nn.Linear):
    """An nn.Linear (same parameters, same names) whose matmuls run in FP8 by `recipe`."""

    recipe = "block"

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """F.linear in this layer's recipe (tensor parallelism's shards call it on theirs)."""
        return RECIPES[self.recipe](x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


def is_quantized_linear(name: str, module: nn.Module) -> bool:
    """DeepSeek-V3's choice: the projections of attention, MLPs and experts are FP8; embeddings,
    norms, the router's gate and the LM head stay in 16 bits."""
    return (type(module) is nn.Linear and name.startswith("layers.")
            and not name.endswith("router.gate"))


def convert_to_fp8(model: nn.Module, recipe: str = "block") -> nn.Module:
    """Swap the quantized linears of a tetrad Transformer for FP8Linear in `recipe`, in place,
    keeping their parameter objects (and so their names, initial values and any optimizer built
    on them)."""
    for name, module in list(model.named_modules()):
        if is_quantized_linear(name, module):
            fp8 = FP8Linear(module.in_features, module.out_features, bias=False, device="meta")
            fp8.weight, fp8.bias, fp8.recipe = module.weight, module.bias, recipe
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, fp8)
    return model
