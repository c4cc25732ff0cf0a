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

The blocks go in order, each calibrated on the outputs of the blocks before it already quantized
(GPTQ's sequential order), so that its rounding also compensates the error it is served with.

The stored layout is round-to-nearest's (int8: one scale per output row, max |w| / 127; int4: a
scale and offset per group of 128 inputs), so the bytes a model holds do not change. int8's
scales are round-to-nearest's; int4's start from Int4Linear.quantize's clipping search and, once
GPTQ has chosen the levels, are refitted to them by least squares on the same objective."""

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
                          length: int = CALIBRATION_TOKENS, seed: int | None = None
                          ) -> torch.Tensor:
    """[sequences, length] token ids the model samples itself at temperature 1, each from a
    uniformly drawn first token; `seed` defaults to CALIBRATION_SEED's module value at call
    time (benchmarks/quant_agreement.py sets it to measure the spread over seeds)."""
    seed = CALIBRATION_SEED if seed is None else seed
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


class _Reached(Exception):
    """Raised by the hook that catches the first block's inputs: the rest of the forward is
    not needed."""


@torch.no_grad()
def first_block_inputs(model: nn.Module, tokens: torch.Tensor, chunk: int = 8) -> list[tuple]:
    """The arguments the model's first block is called with, one tuple per `chunk` sequences of
    `tokens` (a few sequences per forward: bounded memory): the embedded tokens, and the rotary
    tables and attention callable the model passes every block."""
    calls: list[tuple] = []

    def catch(module: nn.Module, args: tuple) -> None:
        calls.append(args)
        raise _Reached

    handle = model.layers[0].register_forward_pre_hook(catch)
    device = next(model.parameters()).device
    try:
        for start in range(0, len(tokens), chunk):
            try:
                model(tokens[start:start + chunk].to(device))
            except _Reached:
                pass
    finally:
        handle.remove()
    return calls


@torch.no_grad()
def input_hessians(block: nn.Module, projections: dict[str, nn.Module], calls: list[tuple]
                   ) -> dict[str, torch.Tensor]:
    """X^T X [K, K] (fp32) of every named projection's inputs over `block` called on `calls`."""
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
        for args in calls:
            block(*args)
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

    def refit(self, values: torch.Tensor, weight: torch.Tensor, hessian: torch.Tensor) -> None:
        """Every scale and offset of each row refitted to the levels GPTQ chose: the pairs p
        minimising (w - A p)^T H (w - A p) over the row, A p = (q - 8) * scale + offset group by
        group and H the damped Hessian whole (with act order a group's error is compensated in
        other groups, so their blocks of H couple), solved as one 2G x 2G system per row (G
        groups). It is GPTQ's own objective, the layer's output error on the calibration inputs,
        with the grid free (GPTQ fixes it before it knows the levels; AWQ and llama.cpp fit
        a group's scale to the same end). Cost O(N K^2), as GPTQ's."""
        hessian = _damped(hessian)
        rows, width = weight.shape
        groups = width // INT4_GROUP
        levels = (values.double() - INT4_MIDPOINT).view(rows, groups, INT4_GROUP)
        w = weight.double()
        hw = (w @ hessian).view(rows, groups, INT4_GROUP)
        # The normal equations' blocks: scale-scale [N, G, G], scale-offset [N, G, G],
        # offset-offset [G, G] (H's block sums).
        ss = torch.empty(rows, groups, groups, dtype=torch.float64, device=w.device)
        so = torch.empty_like(ss)
        for g in range(groups):
            columns = slice(g * INT4_GROUP, (g + 1) * INT4_GROUP)
            hq = (levels[:, g] @ hessian[columns]).view(rows, groups, INT4_GROUP)
            ss[:, g] = (hq * levels).sum(-1)
            so[:, g] = hq.sum(-1)
        oo = hessian.view(groups, INT4_GROUP, groups, INT4_GROUP).sum(dim=(1, 3))
        system = torch.cat((torch.cat((ss, so), dim=2),
                            torch.cat((so.transpose(1, 2), oo.expand(rows, -1, -1)), dim=2)),
                           dim=1)
        target = torch.cat(((hw * levels).sum(-1), hw.sum(-1)), dim=1)
        # A group holding one level has no separate scale and offset: a ridge far below the
        # system's own scale picks one of the equivalent pairs instead of failing.
        ridge = 1e-9 * system.diagonal(dim1=1, dim2=2).mean(-1)
        system = system + ridge[:, None, None] * torch.eye(2 * groups, dtype=torch.float64,
                                                           device=w.device)
        solution = torch.linalg.solve(system, target[..., None])[..., 0]
        self.pairs = torch.stack((solution[:, :groups].t(), solution[:, groups:].t()), dim=-1
                                 ).to(self.dtype)  # [G, N, 2], as the pairs are


def _damped(hessian: torch.Tensor) -> torch.Tensor:
    """H (fp64) with GPTQ_DAMPING of its mean diagonal added to the diagonal, and a unit
    diagonal where an input was never active (H_jj = 0)."""
    hessian = hessian.double().clone()
    diagonal = hessian.diagonal()
    diagonal[diagonal == 0] = 1
    diagonal += GPTQ_DAMPING * diagonal.mean()
    return hessian


def _inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of (H + damping)^-1 (fp64, then fp32): row j holds what
    rounding column j moves the later columns by. An input never active (H_jj = 0: an expert no
    calibration token reached) gets a unit diagonal, so its column is rounded to nearest; with H
    = 0 the factor is diagonal and every column is."""
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(_damped(hessian)))
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq(weight: torch.Tensor, hessian: torch.Tensor | None, method: str, dtype: torch.dtype
         ) -> QuantizedWeight:
    """Round `weight` [N, K] to `method`'s layout, column by column, each column's error
    (divided by its inverse-Hessian diagonal) subtracted from the columns after it along that
    row of the inverse factor: the OBS update GPTQ takes, eager inside a block of 128 columns
    and applied to the later blocks once per block. The columns go in decreasing order of their
    inputs' energy (H's diagonal, GPTQ's "act order"): the outlier channels are rounded first,
    while every other column is still free to absorb their error. The grid is fixed before;
    int4's is refitted to the chosen levels after (_Int4Grid.refit). With no activations (H = 0)
    it is round-to-nearest."""
    grid = (_Int8Grid if method == "int8" else _Int4Grid)(weight, dtype)
    w = weight.detach().float().clone()
    if hessian is None:  # no token reached it through a call of its own (an unrouted expert)
        hessian = torch.zeros(w.shape[1], w.shape[1], device=w.device)
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
    if method == "int4" and hessian.any():
        grid.refit(values, weight, hessian)
    return grid.quantized(values)


def calibrated_weights(model: nn.Module, projections: dict[str, nn.Module], method: str,
                       dtype: torch.dtype, tokens: torch.Tensor | None = None
                       ) -> dict[str, QuantizedWeight]:
    """Each named projection of the whole `model` (in `dtype`, 16-bit) quantized by GPTQ on the
    inputs `tokens` give it (default: self_generated_tokens), block after block: a block's
    Hessians are gathered on the outputs of the blocks before it with their projections already
    quantized (GPTQ's sequential order), so that its rounding also compensates the error its
    inputs carry from the earlier blocks, as they will when served. Within a block the
    projections go in as few groups as HESSIAN_BUDGET allows, a group's inputs coming through the
    groups before it already quantized. `model` is left as it was."""
    if tokens is None:
        tokens = self_generated_tokens(model)
    calls, quantized, originals = first_block_inputs(model, tokens), {}, {}
    try:
        for index, block in enumerate(model.layers):
            names = [name for name in projections if name.startswith(f"layers.{index}.")]
            while names:
                batch = _within_budget(names, projections)
                names = names[len(batch):]
                hessians = input_hessians(block, {name: projections[name] for name in batch},
                                          calls)
                for name in batch:
                    quantized[name] = gptq(projections[name].weight.detach(),
                                           hessians.pop(name, None), method, dtype)
                    originals[name] = _swap(model, name,
                                            quantized[name].layer(_bias(projections[name]),
                                                                  packed=False))
            with torch.no_grad():
                calls = [(block(*args), *args[1:]) for args in calls]
    finally:
        for name, module in originals.items():
            _swap(model, name, module)
    return quantized


def _bias(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, "bias", None)


def _swap(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put `module` at `name` in `model`; returns the one that was there."""
    parent, _, child = name.rpartition(".")
    held = model.get_submodule(parent)
    previous = getattr(held, child)
    setattr(held, child, module)
    return previous


def _within_budget(names: list[str], projections: dict[str, nn.Module]) -> list[str]:
    """The first of `names` whose fp32 Hessians fit HESSIAN_BUDGET together (at least one)."""
    batch, held = [], 0
    for name in names:
        width = projections[name].weight.shape[1]
        if batch and held + 4 * width * width > HESSIAN_BUDGET:
            break
        batch.append(name)
        held += 4 * width * width
    return batch
