"""FP8 checkpoint weights kept in FP8 for serving: a linear holding E4M3 values and their scales
(tetrad.models.hf_fp8 loads them), and the bytes a model's weights hold so."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.models.fp8 import BLOCK, dequantize_tiles


class FP8WeightLinear(nn.Module):
    """An inference linear (no bias) whose weight stays as an FP8 checkpoint stores it: E4M3
    values [N, K] and one fp32 scale per row and 128 columns [N, ceil(K / 128)] (a 128x128 block's
    scale repeated on each of its rows, so that tetrad's fused and row-permuted weights, cut from
    several blocks, keep theirs: 4 bytes per 128 elements more than DeepSeek's block grid).

    The product dequantises the weight on the fly into `dtype` (the model's) and runs F.linear:
    the same fp32 values, q * scale, and the same cast as dequantising at load, so the outputs
    are bit-identical to that model's while memory holds 1 byte per weight. The block-scaled FP8
    product (`tiled_matmul`, activations in 1x128 tiles) would round the activations to E4M3 as
    well: faster on FP8 tensor cores, not exact. `weight` is the dequantised tensor (MLA's
    absorbed attention reads kv_up's)."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 block: int = BLOCK):
        super().__init__()
        self.out_features, self.in_features = values.shape
        self.dtype, self.block = dtype, block
        self.register_buffer("weight_fp8", values)
        self.register_buffer("weight_scale_inv", scales)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_tiles(self.weight_fp8, self.weight_scale_inv, self.block).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held: its parameters, and the persistent buffers that hold
    weights in other forms (FP8 weights, 1 byte per element, and the int8 / int4 ones of
    tetrad.models.quant, each with their scales); rotary frequencies are not persistent."""
    held = {id(t): t for t in model.parameters()}
    for module in model.modules():
        held.update((id(buffer), buffer) for name, buffer in module.named_buffers(recurse=False)
                    if name not in module._non_persistent_buffers_set)
    return sum(t.numel() * t.element_size() for t in held.values())
