"""`--quantization int8|int4` at load: the served model's projections swapped for
tetrad.models.quant's layers, on whatever share of the model this rank holds.

Quantized: every projection of a block (attention, MLPs, routed and shared experts), as the
planner counts them (tetrad/planner/quantized.py); the router's gate, embeddings, norms and the
LM head stay in 16 bits. The values come from GPTQ on the whole model
(tetrad.models.quant_calibrate: calibration activations the model samples itself), computed
before any tensor-parallel split (`whole_model_weights`) and cut after it: a column-parallel
shard takes its rows (with their scales or groups), a row-parallel shard its columns (int8's
whole rows' scales; int4's whole groups of the full matrix, the planner's rule: widths a multiple
of the group). So every rank holds exactly the values one process would, cut the same way; GPTQ
carries rounding errors across a row's columns, which no shard could do on its own columns."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tetrad.models.fp8_weights import FP8WeightLinear
from tetrad.models.quant import SCALE_DTYPES
from tetrad.models.quant_calibrate import QuantizedWeight, calibrated_weights


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


def _projections(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if _is_projection(name, module)}


def whole_model_weights(model: nn.Module, method: str, dtype: torch.dtype
                        ) -> dict[str, QuantizedWeight]:
    """Every projection of the whole `model` quantized by `method`, by name, for the shards a
    split of it will hold. Its parameters are turned to `dtype` first, in place (as the runner
    turns a rank's share after the split), so the calibration sees the activations one process
    serving in `dtype` sees."""
    if method == "none":
        return {}
    for param in model.parameters():  # buffers (rotary frequencies) stay fp32
        param.data = param.data.to(dtype)
    return calibrated_weights(model.eval(), _projections(model), method, dtype)


def _shard_product(layer: nn.Module):
    """A tensor-parallel shard's `matmul(x, weight, bias)` through its quantized layer (the
    shard keeps its own collectives around it; its weight argument is no longer read)."""

    def product(x: torch.Tensor, weight: None = None, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        y = layer(x)
        return y if bias is None else y + bias

    return product


def quantize_model(model: nn.Module, method: str,
                   whole: Mapping[str, QuantizedWeight] | None = None) -> nn.Module:
    """Swap `model`'s projections, in place, for int8 or int4 ones on the device and in the
    16-bit dtype they hold now. `whole`: whole_model_weights of the model before its split (or
    the values it was stored with, quant_store), which a split model needs; without it `model`
    is a whole one and is calibrated here. MLA's kv_up keeps the reference layout: its absorbed
    attention reads the dequantized weight every step, which that layout gives with one
    multiply."""
    if method == "none":
        return model
    projections = _projections(model)
    dtypes = {name: module.weight.dtype for name, module in projections.items()}
    for name, dtype in dtypes.items():
        if dtype not in SCALE_DTYPES:
            raise ValueError(f"--quantization {method} serves 16-bit activations: {name} is "
                             f"{dtype}")
    if whole is None and projections:
        whole = calibrated_weights(model, projections, method, next(iter(dtypes.values())))
    for name, module in projections.items():
        held = whole[name]
        if hasattr(module, "indices"):  # a tensor-parallel shard: its rows or columns
            held = held.select(module.dim, module.indices[module.tp.index])
        packed = not name.endswith("attn.kv_up")
        # A shard that takes no collective (MLA's heads enter before it) is a plain linear, and
        # replaced like one, so that absorbed attention reads its `weight`.
        whole_layer = type(module) in (nn.Linear, FP8WeightLinear)
        if whole_layer or getattr(module, "enters", True) is False:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    held.layer(getattr(module, "bias", None), packed))
        else:  # a tensor-parallel shard: its weight goes, its bias and collectives stay
            layer = held.layer(None, packed)
            del module.weight
            module.quantized = layer
            module.weight = None
            module.matmul = _shard_product(layer)
    return model
