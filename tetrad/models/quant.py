"""Weight-only integer linears for serving: int8 with one scale per output channel, int4 in groups
along the input with a scale and a zero point per group. Activations, the bias and the output stay
in the model's 16-bit dtype; only the weight is held in few bits.

Each layer picks its product once, when it is built, on the device its values are on: packed
kernels where there is one for that device, shape and dtype (int8: `torch._weight_int8pack_mm` on
a CPU, tetrad.models.int8_triton's on a GPU for decode rows; int4:
`torch._weight_int4pack_mm_for_cpu` on a CPU, `torch._weight_int4pack_mm` on a GPU), otherwise the
reference product (dequantize, then F.linear). Both hold the same bytes per weight, so the bytes a
model holds do not depend on the path: int8 N*K + N scales; int4 N*K/2 + N*(K/group) scale and
zero pairs. A layer is built on its device and stays there (the packed layouts are the device's
own).

`from_quantized` takes values already quantized elsewhere (a GGUF file's Q8_0 / Q4_0 blocks once
regrouped per row); `quantize` rounds a float weight."""

from __future__ import annotations

from importlib.util import find_spec

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to which a GPU's int8 product runs our Triton kernel (int8_triton.py); past them the
# weight is widened once for cuBLAS. The kernel's module is imported at first use: importing
# triton costs a CPU engine ~77 MB of memory it never uses.
MAX_KERNEL_ROWS = 64

INT4_GROUPS = (32, 64, 128, 256)  # what torch's int4 kernels take; GGUF's Q4_0 is 32
INT4_GROUP = 128  # --quantization int4's group (GPTQ/AWQ's), the planner's too
INT4_MIDPOINT = 8  # torch's int4 kernels compute (q - 8) * scale + offset
SCALE_DTYPES = (torch.bfloat16, torch.float16)
# The shares of each group's [min, max] that the int4 quantizer tries (1.0 first).
INT4_CLIP_FACTORS = tuple(1 - i / 40 for i in range(21))


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"quantized linears compute in bf16 or fp16, got {dtype}")


def int8_scales(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One scale per row of a float weight [out, in]: max |w| of the row / 127, rounded to
    `dtype`; an all-zero row gets 1."""
    amax = weight.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(dtype)


class Int8Linear(nn.Module):
    """y = x @ w.T + bias with w[n, k] = scales[n] * values[n, k]: `values` int8 [N, K] (the
    quantizer keeps them in -127..127, symmetric), `scales` [N] in the activation dtype."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, packed: bool = True):
        super().__init__()
        if values.dtype != torch.int8 or values.dim() != 2:
            raise ValueError(f"int8 values must be an int8 matrix [out, in], got {values.dtype} "
                             f"{tuple(values.shape)}")
        self.out_features, self.in_features = values.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"int8 scales must be one per output row ({self.out_features}), "
                             f"got {tuple(scales.shape)}")
        _check_dtype(scales.dtype)
        self.dtype = scales.dtype
        self.register_buffer("values", values.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(self.dtype), False)
        # A CPU takes torch's int8 kernel, a GPU ours (int8_triton.py says why); else the
        # reference product. torch 2.13's CPU kernel reads past rows whose width is not a
        # multiple of 8 when it has more than one row (wrong sums, or a segfault).
        self.packed = packed and (find_spec("triton") is not None if values.is_cuda
                                  else hasattr(torch, "_weight_int8pack_mm")
                                  and self.in_features % 8 == 0)

    @classmethod
    def from_quantized(cls, values: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        """Values int8 [out, in] and one scale per output row [out]: w = scales[:, None] *
        values. The scales are rounded to `dtype`, the activations' (bf16 or fp16)."""
        _check_dtype(dtype)
        return cls(values, scales.to(dtype), bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, packed: bool = True,
                 scales: torch.Tensor | None = None) -> "Int8Linear":
        """Round a float weight [out, in]: value = round(w / scale) in -127..127, with `scales`
        given (a row-parallel shard's: its whole rows') or int8_scales(weight)."""
        _check_dtype(dtype)
        scales = (int8_scales(weight, dtype) if scales is None
                  else scales.to(device=weight.device, dtype=dtype))
        values = torch.round(weight.detach().float() / scales.float()[:, None])
        return cls(values.clamp(-127, 127).to(torch.int8), scales, bias, packed)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] in the activation dtype."""
        return (self.values.to(self.dtype) * self.scales[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.packed or (self.values.is_cuda and rows > MAX_KERNEL_ROWS):
            return F.linear(x, self.weight, self.bias)
        shape, flat = x.shape, x.reshape(rows, self.in_features)
        if self.values.is_cuda:
            from tetrad.models.int8_triton import int8_weight_product
            y = int8_weight_product(flat, self.values, self.scales)
        else:
            y = torch._weight_int8pack_mm(flat, self.values, self.scales)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _int4_round(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups w [N, G, group] rounded onto 16 levels spanning [low, high] [N, G]: the scales and
    offsets in `dtype`, the values 0..15 (float), and each group's squared error of the weight
    the layer will hold (dequantized as `Int4Linear.weight` does, then rounded to `dtype`)."""
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(high)).to(dtype)
    offsets = (low + INT4_MIDPOINT * scales.float()).to(dtype)
    step, offset = scales.float()[..., None], offsets.float()[..., None]
    values = (torch.round((w - offset) / step) + INT4_MIDPOINT).clamp(0, 15)
    held = ((values - INT4_MIDPOINT) * step + offset).to(dtype).float()
    return scales, offsets, values, (held - w).square().sum(dim=-1)


def _cuda_inner_k_tiles(in_features: int) -> int:
    """The widest k tiling torch's CUDA int4 layout takes for K (0: none)."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0), 0)


def _pack_pairs(values: torch.Tensor) -> torch.Tensor:
    """[N, K] of 0..15 -> [N, K/2] uint8: even k in the low nibble, odd k in the high one."""
    return (values[:, 0::2] | (values[:, 1::2] << 4)).to(torch.uint8)


def _unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)


class Int4Linear(nn.Module):
    """y = x @ w.T + bias with, for input column k in group g = k // group,

        w[n, k] = scales[n, g] * (values[n, k] - zeros[n, g])

    `values` in 0..15 (4 bits), `scales` and `zeros` [N, K / group]. Held as torch's int4
    kernels take them: the values packed two per byte (the kernel's own layout when it runs),
    and per group `scale` and `offset = scale * (8 - zero)` in the activation dtype, so that
    w = (values - 8) * scale + offset, [K / group, N, 2]."""

    def __init__(self, packed_values: torch.Tensor, scales_and_offsets: torch.Tensor,
                 in_features: int, group: int, kernel: str,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = scales_and_offsets.shape[1], in_features
        self.group = group
        self.kernel, self.dtype = kernel, scales_and_offsets.dtype
        self.register_buffer("values", packed_values)
        self.register_buffer("scales_and_offsets", scales_and_offsets.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(self.dtype), False)

    @classmethod
    def from_quantized(cls, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group: int, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.bfloat16, packed: bool = True
                       ) -> "Int4Linear":
        """values [out, in] (any integer dtype, 0..15), scales and zeros [out, in / group]:
        w = scales * (values - zeros) per group (the class docstring). `zeros` may be
        fractional (GGUF's Q4_K stores a minimum: zero = min / scale); the offset is computed in
        fp32 and rounded, with the scale, to `dtype`."""
        _check_dtype(dtype)
        if values.dim() != 2:
            raise ValueError(f"int4 values must be a matrix [out, in], got {tuple(values.shape)}")
        out_features, in_features = values.shape
        if group not in INT4_GROUPS or in_features % group:
            raise ValueError(f"int4 groups must be one of {INT4_GROUPS} and divide the input "
                             f"width {in_features}, got {group}")
        expected = (out_features, in_features // group)
        if scales.shape != expected or zeros.shape != expected:
            raise ValueError(f"int4 scales and zeros must be [out, in / group] = {expected}, got "
                             f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
        if values.min() < 0 or values.max() > 15:
            raise ValueError("int4 values must lie in 0..15")
        offsets = scales.float() * (INT4_MIDPOINT - zeros.float())
        pairs = torch.stack((scales.float().t(), offsets.t()), dim=-1).to(dtype)
        return cls._build(values.to(torch.int32), pairs, group, bias, packed)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = INT4_GROUP, dtype: torch.dtype = torch.bfloat16,
                 packed: bool = True) -> "Int4Linear":
        """Round a float weight [out, in], asymmetric per group over a clipped range [f * min,
        f * max]: scale = f * (max - min) / 15 and offset = f * min + 8 * scale, both rounded to
        `dtype` first; value = round((w - offset) / scale) + 8, clamped to 0..15. Each group's
        f is the one of INT4_CLIP_FACTORS (1 first, so ties keep the full range) whose
        dequantized group has the least squared error against the weight: a few outliers no
        longer stretch the step that every other weight of the group is rounded to. A constant
        group gets scale 1."""
        _check_dtype(dtype)
        out_features, in_features = weight.shape
        if group not in INT4_GROUPS or in_features % group:
            raise ValueError(f"int4 groups must be one of {INT4_GROUPS} and divide the input "
                             f"width {in_features}, got {group}")
        w = weight.detach().float().view(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales, offsets, values, error = _int4_round(w, low, high, dtype)
        for factor in INT4_CLIP_FACTORS[1:]:
            clipped = _int4_round(w, low * factor, high * factor, dtype)
            better = clipped[3] < error
            scales = torch.where(better, clipped[0], scales)
            offsets = torch.where(better, clipped[1], offsets)
            values = torch.where(better[..., None], clipped[2], values)
            error = torch.minimum(error, clipped[3])
        values = values.to(torch.int32).view(out_features, -1)
        pairs = torch.stack((scales.t(), offsets.t()), dim=-1)
        return cls._build(values, pairs, group, bias, packed)

    @classmethod
    def _build(cls, values: torch.Tensor, pairs: torch.Tensor, group: int,
               bias: torch.Tensor | None, packed: bool) -> "Int4Linear":
        """Pack the int32 values [N, K] for the kernel this device, shape and dtype allow."""
        out_features, in_features = values.shape
        device = values.device
        if packed and device.type == "cpu" and out_features % 16 == 0 and hasattr(
                torch, "_weight_int4pack_mm_for_cpu"):
            stored = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.contiguous(), 1)
            return cls(stored, pairs, in_features, group, "cpu", bias)
        tiles = _cuda_inner_k_tiles(in_features)
        if (packed and device.type == "cuda" and pairs.dtype == torch.bfloat16 and tiles
                and out_features % 8 == 0):
            stored = torch.ops.aten._convert_weight_to_int4pack(
                _pack_pairs_high_first(values), tiles)
            return cls(stored, pairs, in_features, group, "cuda", bias)
        return cls(_pack_pairs(values), pairs, in_features, group, "reference", bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] in the activation dtype. On a packed path it is read
        back through the kernel (x = I), so it is what the kernel multiplies by."""
        if self.kernel != "reference":
            eye = torch.eye(self.in_features, dtype=self.dtype, device=self.values.device)
            return self._packed_product(eye).t().contiguous()
        values = _unpack_pairs(self.values).view(self.out_features, -1, self.group)
        scales, offsets = self.scales_and_offsets.float().permute(2, 1, 0)
        w = (values.float() - INT4_MIDPOINT) * scales[..., None] + offsets[..., None]
        return w.view(self.out_features, self.in_features).to(self.dtype)

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu":
            return torch._weight_int4pack_mm_for_cpu(x, self.values, self.group,
                                                     self.scales_and_offsets)
        return torch._weight_int4pack_mm(x, self.values, self.group, self.scales_and_offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "reference":
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        y = self._packed_product(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _pack_pairs_high_first(values: torch.Tensor) -> torch.Tensor:
    """torch's CUDA int4 layout's input: [N, K/2] uint8, even k in the high nibble."""
    return ((values[:, 0::2] << 4) | values[:, 1::2]).to(torch.uint8)
