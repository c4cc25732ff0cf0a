"""DeepSeek-V3's FP8 checkpoint layout, read and written (`tetrad export --dtype fp8`).

A quantized linear's `<name>.weight` is float8_e4m3fn and `<name>.weight_scale_inv` holds one fp32
per 128x128 block, ceil(out / 128) x ceil(in / 128), with weight ≈ fp8 * scale_inv block by block
(tetrad.models.fp8.quantize_blocks). Which linears: the projections of attention, MLPs and experts
(`*_proj`, DeepSeek's `kv_a_proj_with_mqa`); embeddings, norms, the router's `mlp.gate` and
`lm_head` stay in 16 bits (bf16), as DeepSeek ships them. config.json carries DeepSeek-V3's
`quantization_config`; a folder whose config has one must say `quant_method: fp8`, and its
`weight_block_size` is the block read. Loading dequantises each weight per block into the
dtype asked for (tetrad.models.hf), or, with `keep_fp8` (the single-rank serving engine), reads
it as an FP8Weight that becomes a tetrad.models.fp8_weights.FP8WeightLinear.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tetrad.errors import ConfigError
from tetrad.models.fp8 import (BLOCK, E4M3, block_scales_per_row, dequantize_blocks,
                               dequantize_tiles, quantize_blocks)

SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V3's config.json, verbatim.
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK]}
UNQUANTIZED_DTYPE = torch.bfloat16
_QUANTIZED = re.compile(r"(^|\.)layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def is_quantized(hf_name: str) -> bool:
    """A projection of attention, an MLP or an expert (not a norm, the router, embeddings or the
    head)."""
    return bool(_QUANTIZED.search(hf_name))


def block_size(hf: dict[str, Any]) -> int:
    """The block an HF config's quantization_config names (128 when absent)."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return BLOCK
    if quantization.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config quant_method {quantization.get('quant_method')!r}"
                          f" is not supported: tetrad reads DeepSeek's block-scaled fp8 only")
    rows, cols = quantization.get("weight_block_size", [BLOCK, BLOCK])
    if rows != cols:
        raise ConfigError(f"quantization_config weight_block_size {[rows, cols]} is not square: "
                          f"tetrad reads square fp8 blocks (DeepSeek-V3's [128, 128])")
    return rows


def quantize_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> DeepSeek's FP8 layout: the quantized linears as E4M3 with their
    weight_scale_inv, every other tensor in bf16."""
    out = {}
    for name, tensor in tensors.items():
        if is_quantized(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(tensor.float())
        else:
            out[name] = tensor.to(UNQUANTIZED_DTYPE)
    return out


def scale_names(names: set[str]) -> set[str]:
    """The weight_scale_inv tensors among `names` that belong to a weight among them."""
    return {name for name in names
            if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in names}


@dataclass(frozen=True)
class FP8Weight:
    """A weight kept in FP8: E4M3 values [N, K] and fp32 scales per row and `block` columns
    [N, ceil(K / block)], the form tetrad's fused (concatenated) and row-permuted weights keep."""
    values: torch.Tensor
    scales: torch.Tensor
    block: int

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantized(self) -> torch.Tensor:
        """fp32, the same products as dequantize_blocks of the stored block grid."""
        return dequantize_tiles(self.values, self.scales, self.block)

    @staticmethod
    def concatenated(parts: list["FP8Weight"], rows: tuple[int, ...]) -> "FP8Weight":
        """The parts stacked along dim 0, then (when given) only `rows`, in that order."""
        values = torch.cat([part.values for part in parts])
        scales = torch.cat([part.scales for part in parts])
        if rows:
            values, scales = values[list(rows)], scales[list(rows)]
        return FP8Weight(values, scales, parts[0].block)


def read_weight(get: Callable[[str], torch.Tensor], name: str, names: set[str],
                block: int, keep_fp8: bool = False) -> torch.Tensor | FP8Weight:
    """Tensor `name` through `get`; an E4M3 weight with a scale_inv dequantised per block (fp32),
    or with `keep_fp8` as an FP8Weight."""
    tensor = get(name)
    if tensor.dtype == E4M3 and name + SCALE_SUFFIX in names:
        scale_inv = get(name + SCALE_SUFFIX)
        expected = tuple(-(-size // block) for size in tensor.shape)
        if tuple(scale_inv.shape) != expected:
            raise ConfigError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, not "
                              f"{expected}: one scale per {block}x{block} block of {name}")
        if keep_fp8:
            return FP8Weight(tensor, block_scales_per_row(scale_inv.float(), tensor.shape[0],
                                                          block), block)
        return dequantize_blocks(tensor, scale_inv.float(), block)
    return tensor
