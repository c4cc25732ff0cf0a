"""`--quantization int8|int4` at load: the served model's projections swapped for
tetrad.models.quant's layers, on whatever share of the model this rank holds.

Quantized: every projection of a block (attention, MLPs, routed and shared experts), as the
planner counts them (tetrad/planner/quantized.py); the router's gate, embeddings, norms and the
LM head stay in 16 bits. A tensor-parallel rank quantizes its own shard after the split: a
column-parallel shard's rows keep their own scales; a row-parallel shard, which holds whole rows
but only some of their columns, takes int8's row scales from the whole model (row_scales, before
the split), and its int4 column groups are whole groups of the full matrix (the planner's rule:
widths a multiple of the group). So every rank holds exactly the values one process would, cut
the same way."""

from __future__ import annotations

import torch
from torch import nn

from tetrad.models.fp8_weights import FP8WeightLinear
from tetrad.models.quant import INT4_GROUP, SCALE_DTYPES, Int4Linear, Int8Linear, int8_scales



def _is_projection(name: str, module: nn.Module) -> bool:
    """A block's projection, plain (nn.Linear, an FP8 checkpoint's FP8WeightLinear) or a
    tensor-parallel shard (anything else holding a matrix `weight` it multiplies by through its
    `matmul`); not the router's gate."""
    if not name.startswith("layers.") or name.endswith("router.gate"):
        return False
    if type(module) in (nn.Linear, FP8WeightLinear):
        return True
    weight = getattr(module, "weight", None)
    return (callable(getattr(module, "matmul", None)) and isinstance(weight, nn.Parameter)
            and weight.dim() == 2)


def row_scales(model: nn.Module, method: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """int8's scales of every projection of the whole model, by name, taken before a
    tensor-parallel split: a row-parallel shard holds every row but only some of its columns,
    and takes its rows' scales from here, so it holds the values one process would. (int4's
    groups are whole inside a shard: nothing to take.)"""
    if method != "int8":
        return {}
    return {name: int8_scales(module.weight.to(dtype), dtype)
            for name, module in model.named_modules() if _is_projection(name, module)}


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, method: str,
               dtype: torch.dtype, packed: bool, scales: torch.Tensor | None) -> nn.Module:
    if method == "int8":
        return Int8Linear.quantize(weight, bias, dtype, packed, scales)
    return Int4Linear.quantize(weight, bias, INT4_GROUP, dtype, packed)


def _shard_product(layer: nn.Module):
    """A tensor-parallel shard's `matmul(x, weight, bias)` through its quantized layer (the
    shard keeps its own collectives around it; its weight argument is no longer read)."""

    def product(x: torch.Tensor, weight: None = None, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        y = layer(x)
        return y if bias is None else y + bias

    return product


def quantize_model(model: nn.Module, method: str,
                   whole_rows: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Swap `model`'s projections, in place, for int8 or int4 ones on the device and in the
    16-bit dtype they hold now. `whole_rows`: row_scales of the model before its split, for the
    shards that hold whole rows. MLA's kv_up keeps the reference layout: its absorbed attention
    reads the dequantized weight every step, which that layout gives with one multiply."""
    whole_rows = whole_rows or {}
    if method == "none":
        return model
    for name, module in list(model.named_modules()):
        if not _is_projection(name, module):
            continue
        weight = module.weight.detach()  # an FP8 checkpoint's dequantized
        dtype = weight.dtype
        if dtype not in SCALE_DTYPES:
            raise ValueError(f"--quantization {method} serves 16-bit activations: {name} is "
                             f"{dtype}")
        packed = not name.endswith("attn.kv_up")
        scales = whole_rows.get(name)
        if scales is not None and len(scales) != weight.shape[0]:
            scales = None  # a column-parallel shard: its own rows' scales are the same
        # A shard that takes no collective (MLA's heads enter before it) is a plain linear, and
        # replaced like one, so that absorbed attention reads its `weight`.
        whole = type(module) in (nn.Linear, FP8WeightLinear)
        if whole or getattr(module, "enters", True) is False:
            bias = getattr(module, "bias", None)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    _quantized(weight, bias, method, dtype, packed, scales))
        else:  # a tensor-parallel shard: its weight goes, its bias and collectives stay
            layer = _quantized(weight, None, method, dtype, packed, scales)
            del module.weight
            module.quantized = layer
            module.weight = None
            module.matmul = _shard_product(layer)
    return model
