"""Calibrated rounding for `--quantization int8|int4`: GPTQ (Frantar et al. 2022) on activations
the model produces itself.

Round-to-nearest (with int4's clipping search) minimises each weight's own error. What serving
needs small is the layer's output error on the inputs it sees, ||X W^T - X Q^T||: GPTQ rounds the
columns of W one at a time and spreads each column's rounding error over the columns not yet
rounded, weighted by the inverse of the inputs' Hessian H = X^T X, so that the next roundings
cancel what the earlier ones changed in the output. Input channels with large activations (the
outlier channels of trained models) get their error compensated instead of dominating it.

Calibration data, with no network and no file: sequences the 16-bit model samples itself
(temperature 1) from a random first token each (LLM-QAT's data-free calibration). They are
activations of the model's own distribution, which is what the greedy tokens of serving come
from, for any model the engine loads, tokenizer or not; a fixed seed makes them, and so the
quantized values, the same on every rank and every load.

The stored layout and grid are round-to-nearest's (int8: one scale per output row, max |w| / 127;
int4: a scale and offset per group of 128 inputs from Int4Linear.quantize's clipping search), so
the bytes a model holds do not change: GPTQ only picks which of the levels each weight takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.models.quant import INT4_GROUP, INT4_MIDPOINT, Int4Linear, Int8Linear, int8_scales

CALIBRATION_SEQUENCES = 32
CALIBRATION_TOKENS = 128  # per sequence (at most the model's max_seq_len)
CALIBRATION_SEED = 0
GPTQ_DAMPING = 0.01  # of the mean diagonal of H, added to it (GPTQ's default)
GPTQ_BLOCK = 128  # columns updated eagerly; the rest lazily, once per block
HESSIAN_BUDGET = 1 << 30  # bytes of fp32 Hessians gathered in one pass over the data


@dataclass
class QuantizedWeight:
    """A whole projection's quantized values, before any tensor-parallel cut: `values` [N, K]
    (int8 -127..127, or int4 levels 0..15 as uint8) and `grid`: int8's scales [N], int4's
    (scale, offset) pairs [K / group, N, 2], in the activation dtype."""

    method: str
    values: torch.Tensor
    grid: torch.Tensor

    def select(self, dim: int, indices: torch.Tensor) -> "QuantizedWeight":
        """The rows (dim 0) or columns (dim 1) a tensor-parallel shard holds; int4's column
        shards hold whole groups (the planner's rule), so they take those groups' pairs."""
        values = self.values.index_select(dim, indices.to(self.values.device))
        if dim == 0:
            grid_dim = 0 if self.method == "int8" else 1
            grid = self.grid.index_select(grid_dim, indices.to(self.grid.device))
        elif self.method == "int8":
            grid = self.grid  # whole rows: their scales
        else:
            group = self.values.shape[1] // self.grid.shape[0]
            grid = self.grid.index_select(0, indices[::group].to(self.grid.device) // group)
        return QuantizedWeight(self.method, values, grid)

    def layer(self, bias: torch.Tensor | None, packed: bool) -> nn.Module:
        if self.method == "int8":
            return Int8Linear(self.values, self.grid, bias, packed)
        group = self.values.shape[1] // self.grid.shape[0]
        return Int4Linear._build(self.values.to(torch.int32), self.grid, group, bias, packed)


class _KVCache:
    """A contiguous K/V per layer for sampling one token per sequence per call: the
    Transformer's `cache` interface (attend, logits_indices) without the engine's pages."""

    logits_indices = slice(-1, None)

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        if layer in self.keys:
            k = self.keys[layer] = torch.cat((self.keys[layer], k), dim=2)
            v = self.values[layer] = torch.cat((self.values[layer], v), dim=2)
        else:
            self.keys[layer], self.values[layer] = k, v
        # One new query per sequence: every cached token is in its past, no mask.
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])


@torch.no_grad()
def self_generated_tokens(model: nn.Module, sequences: int = CALIBRATION_SEQUENCES,
                          length: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED
                          ) -> torch.Tensor:
    """[sequences, length] token ids the model samples itself at temperature 1, each from a
    uniformly drawn first token."""
    config = model.config
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    length = min(length, config.max_seq_len)
    tokens = torch.randint(config.vocab_size, (sequences, 1), generator=generator)
    cache = _KVCache()
    for position in range(length - 1):
        logits = model(tokens[:, -1:].to(device), torch.tensor([position], device=device),
                       cache=cache)[:, -1].float().cpu()
        drawn = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat((tokens, drawn), dim=1)
    return tokens


@torch.no_grad()
def input_hessians(model: nn.Module, projections: dict[str, nn.Module], tokens: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """X^T X [K, K] (fp32) of every named projection's inputs over one forward of `tokens`."""
    hessians: dict[str, torch.Tensor] = {}

    def gather(name: str):
        def hook(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            if name in hessians:
                hessians[name].addmm_(x.t(), x)
            else:
                hessians[name] = x.t() @ x
        return hook

    handles = [module.register_forward_pre_hook(gather(name))
               for name, module in projections.items()]
    try:
        device = next(model.parameters()).device
        for start in range(0, len(tokens), 8):  # a few sequences per forward: bounded memory
            model(tokens[start:start + 8].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return hessians


class _Int8Grid:
    """int8's levels: the round-to-nearest scale of each whole row, fixed up front. The held
    weight is Int8Linear's (value x scale, rounded to the activation dtype)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.dtype, self.scales = dtype, int8_scales(weight, dtype)
        self.step = self.scales.float()

    def round(self, column: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        value = torch.round(column / self.step).clamp(-127, 127)
        return value, (value.to(self.dtype) * self.scales).float()

    def quantized(self, values: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight("int8", values.to(torch.int8), self.scales)


class _Int4Grid:
    """int4's levels per group of 128 inputs: Int4Linear.quantize's clipping search on the
    weight before GPTQ moves it (GPTQ's "static groups": its columns are visited out of order)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.dtype = dtype
        self.pairs = Int4Linear.quantize(weight, group=INT4_GROUP, dtype=dtype,
                                         packed=False).scales_and_offsets

    def round(self, column: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        step, offset = self.pairs[index // INT4_GROUP].float().unbind(-1)
        value = (torch.round((column - offset) / step) + INT4_MIDPOINT).clamp(0, 15)
        return value, ((value - INT4_MIDPOINT) * step + offset).to(self.dtype).float()

    def quantized(self, values: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight("int4", values.to(torch.uint8), self.pairs)


def _inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of (H + damping)^-1 (fp64, then fp32): row j holds what
    rounding column j moves the later columns by. An input never active (H_jj = 0: an expert no
    calibration token reached) gets a unit diagonal, so its column is rounded to nearest; with H
    = 0 the factor is diagonal and every column is."""
    hessian = hessian.double().clone()
    diagonal = hessian.diagonal()
    diagonal[diagonal == 0] = 1
    diagonal += GPTQ_DAMPING * diagonal.mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(hessian))
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq(weight: torch.Tensor, hessian: torch.Tensor, method: str, dtype: torch.dtype
         ) -> QuantizedWeight:
    """Round `weight` [N, K] to `method`'s layout, column by column, each column's error
    (divided by its inverse-Hessian diagonal) subtracted from the columns after it along that
    row of the inverse factor: the OBS update GPTQ takes, eager inside a block of 128 columns
    and applied to the later blocks once per block. The columns go in decreasing order of their
    inputs' energy (H's diagonal, GPTQ's "act order"): the outlier channels are rounded first,
    while every other column is still free to absorb their error. The grid is fixed before."""
    grid = (_Int8Grid if method == "int8" else _Int4Grid)(weight, dtype)
    w = weight.detach().float().clone()
    hessian = hessian.to(w.device)
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True)
    w, factor = w[:, order], _inverse_hessian_factor(hessian[order][:, order])
    values = torch.empty_like(w)
    for first in range(0, w.shape[1], GPTQ_BLOCK):
        last = min(first + GPTQ_BLOCK, w.shape[1])
        block, inverse = w[:, first:last].clone(), factor[first:last, first:last]
        errors = torch.empty_like(block)
        for i in range(last - first):
            value, held = grid.round(block[:, i], int(order[first + i]))
            values[:, order[first + i]] = value
            errors[:, i] = (block[:, i] - held) / inverse[i, i]
            block[:, i:] -= errors[:, i, None] * inverse[i, i:]
        w[:, last:] -= errors @ factor[first:last, last:]
    return grid.quantized(values)


def calibrated_weights(model: nn.Module, projections: dict[str, nn.Module], method: str,
                       dtype: torch.dtype, tokens: torch.Tensor | None = None
                       ) -> dict[str, QuantizedWeight]:
    """Each named projection of the whole `model` (in `dtype`, 16-bit) quantized by GPTQ on the
    inputs `tokens` give it (default: self_generated_tokens). The Hessians are gathered in as
    many passes over the tokens as HESSIAN_BUDGET needs."""
    if tokens is None:
        tokens = self_generated_tokens(model)
    names, quantized = list(projections), {}
    while names:
        batch, held = [], 0
        for name in names:
            width = projections[name].weight.shape[1]
            if batch and held + 4 * width * width > HESSIAN_BUDGET:
                break
            batch.append(name)
            held += 4 * width * width
        names = names[len(batch):]
        hessians = input_hessians(model, {name: projections[name] for name in batch}, tokens)
        for name in batch:
            weight = projections[name].weight.detach()
            # A projection no token reached through a call of its own (an expert no token was
            # routed to): H = 0, which gptq rounds to nearest.
            hessian = hessians.pop(name, None)
            if hessian is None:
                hessian = weight.new_zeros(weight.shape[1], weight.shape[1], dtype=torch.float32)
            quantized[name] = gptq(weight, hessian, method, dtype)
    return quantized
