"""FP8 (E4M3) numerics in DeepSeek-V3's fine-grained recipe, for training matmuls (`--dtype fp8`)
and for FP8 checkpoint weights (tetrad.models.hf_fp8), which serving keeps in FP8
(tetrad.models.fp8_weights).

Scales are amax-based, `scale = amax / 448` (448 is E4M3's largest finite value), one fp32 scale
per group of elements, and a value is stored as `round_e4m3(x / scale)`, so `x ≈ q * scale`
(DeepSeek calls that scale `weight_scale_inv`). The groups are DeepSeek-V3's (arXiv 2412.19437,
section 3.3): weights per 128x128 block, activations and gradients per 1x128 tile along the
dimension the matmul sums over. E4M3 everywhere, gradients included: the small groups make its
narrow range enough, so E5M2 is not needed.

The product. On a GPU whose cuBLASLt scales blocks itself (CUDA 12.9+, Hopper), a block-scaled
product is one `torch._scaled_mm` with block-shaped scales (`block_scaled_mm`: the weight as its
128x128 grid, the output written in the dtype its consumer wants), after a check on the device
that it equals the loop below. Elsewhere - the CPU, where torch 2.13's `_scaled_mm` takes one
scale per tensor or per row and column, and refuses block-shaped ones - it is computed as
DeepSeek's kernel does: K is cut into 128-wide blocks, inside one of which every row of `a` and
column of `b` has a single scale, so each block is one row-wise `_scaled_mm` with fp32 output,
and the partial products are summed in fp32.

The linear layer (`fp8_linear`), for Y = X W^T with X [M, K] and W [N, K]:
  forward  X in 1x128 tiles along K, W in 128x128 blocks
  dX = dY W     dY in 1x128 tiles along N, W's fp8 copy from the forward (a block grid's transpose
                is a block grid: the same scales serve)
  dW = dY^T X   dY and X in tiles of 128 tokens (128x1 tiles of the [M, *] tensors), quantized
                from their high-precision values, not from the forward's fp8 X
Saved for backward: X's token-tiled fp8 copy and W's fp8 copy, with their fp32 scales. The master
weight stays in its own dtype (fp32, or bf16 under ZeRO) and the optimizer updates it; the output
is in the autocast dtype (bf16), the bias added in fp32 before that cast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The planner counts the same blocks and tiles (scales it holds, FP8 bytes of backward).
from tetrad.spec.runtime_rules import FP8_BLOCK as BLOCK

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Rounding to E4M3 (3 mantissa bits) moves a normal value by at most half a unit in the last
# place, 2^-4 of it; a subnormal (below 2^-6) by at most half the subnormal spacing 2^-9.
E4M3_RELATIVE_ERROR = 2.0 ** -4
E4M3_SUBNORMAL_ERROR = 2.0 ** -10


def scale_of(amax: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """amax / the format's largest value (448 for E4M3) in fp32; an all-zero group gets scale 1
    (any scale stores zeros exactly)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    # Clamped: x / scale can pass the largest value by an ulp of fp32, which would round to NaN
    # (E4M3 has no infinity) or to infinity (E5M2).
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(dtype)


def pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    if x.dtype in (E4M3, torch.float8_e5m2):  # no CUDA F.pad for fp8; either's +0 is byte 0
        return F.pad(x.view(torch.uint8), pad).view(x.dtype)
    return F.pad(x, pad)


def quantize_tiles(x: torch.Tensor, tile: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 1 x `tile` group along the last dimension of x [R, C]: (fp8 [R, C], scales
    [R, ceil(C / tile)]); the last tile of a row may be shorter."""
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return _cpu_quantize_tiles(x, tile)
    return _quantize_tiles(x, tile)


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per `block` x `block` block of w [N, K] (DeepSeek-V3's weights): (fp8 [N, K],
    scale_inv [ceil(N / block), ceil(K / block)])."""
    if w.device.type == "cpu" and torch.compiler.is_compiling():
        return _cpu_quantize_blocks(w, block)
    return _quantize_blocks(w, block)


def _quantize_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    groups = pad_to(x, 1, tile).view(rows, -1, tile)
    scales = scale_of(groups.abs().amax(dim=-1))
    q = to_fp8(groups, scales.unsqueeze(-1)).view(rows, -1)[:, :cols]
    return q.contiguous(), scales  # a copy when padded: what backward keeps is its own size


def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    blocks = pad_to(pad_to(w, 0, block), 1, block)
    grid = blocks.view(blocks.shape[0] // block, block, blocks.shape[1] // block, block)
    scales = scale_of(grid.abs().amax(dim=(1, 3)))
    q = to_fp8(grid, scales[:, None, :, None]).view(blocks.shape)[:rows, :cols]
    return q.contiguous(), scales


# Compiled on the CPU, the quantizers run as ops of their own, eagerly: torch 2.13's inductor C++
# kernels wrote only the whole 128-wide tiles of a tensor cut back to its size (C or N not a
# multiple of 128) and left the rest unwritten, which made compiled fp8 training NaN. On a GPU
# inductor fuses them (Triton).
@torch.library.custom_op("tetrad::quantize_tiles", mutates_args=())
def _cpu_quantize_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_tiles(x, tile)


@_cpu_quantize_tiles.register_fake
def _(x, tile):
    return (x.new_empty(x.shape, dtype=E4M3),
            x.new_empty(x.shape[0], math.ceil(x.shape[1] / tile), dtype=torch.float32))


@torch.library.custom_op("tetrad::quantize_blocks", mutates_args=())
def _cpu_quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_blocks(w, block)


@_cpu_quantize_blocks.register_fake
def _(w, block):
    grid = (math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block))
    return w.new_empty(w.shape, dtype=E4M3), w.new_empty(grid, dtype=torch.float32)


def block_scales_per_row(scales: torch.Tensor, rows: int, block: int = BLOCK) -> torch.Tensor:
    """A block grid's scales [ceil(N / block), nK] as one row of scales per row [N, nK]."""
    return scales.repeat_interleave(block, dim=0)[:rows]


def dequantize_tiles(q: torch.Tensor, scales: torch.Tensor, tile: int = BLOCK) -> torch.Tensor:
    """fp32 values of `quantize_tiles`' output."""
    return q.float() * scales.repeat_interleave(tile, dim=1)[:, :q.shape[1]]


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
                      ) -> torch.Tensor:
    """fp32 values of a block-quantized weight [N, K] (DeepSeek: weight ≈ fp8 * scale_inv)."""
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return q.float() * full[:rows, :cols]


def cublas_multiple(device: torch.device) -> int:
    """cuBLAS(Lt)'s fp8 kernels need every dimension divisible by 16 (for a block-scaled product
    K is a 128-wide block already); the CPU kernel takes any."""
    return 16 if device.type == "cuda" else 1


def block_scaled_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
                    b_scales: torch.Tensor, out_dtype: torch.dtype, b_grid: bool = False
                    ) -> torch.Tensor:
    """a @ b^T in one `torch._scaled_mm` with cuBLASLt's own block scaling (CUDA 12.9+, Hopper):
    a [M, K] and b [N, K] in fp8 (contiguous), a with one scale per row and 128 columns [M, nK];
    b likewise [N, nK], or with `b_grid` one per 128x128 block [N / 128, nK] (DeepSeek-V3's
    weight layout, the faster kernel). The scales are handed over in the layouts cuBLASLt reads:
    per-row scales with the rows fastest, a block grid row-major as seen from b^T."""
    scale_b = b_scales.t() if b_grid else b_scales.t().contiguous()
    return torch._scaled_mm(a, b.t(), scale_a=a_scales.t().contiguous().t(),
                            scale_b=scale_b, out_dtype=out_dtype)


# device -> the (b_grid, output dtype) pairs cuBLASLt's block scaling computes there as the
# blockwise loop does (empty: not there), found once per device by `native_block_scaling`.
_NATIVE_BLOCK_SCALING: dict[str, frozenset] = {}
NATIVE_OUTPUTS = (torch.float32, torch.bfloat16)


def native_block_scaling(device: torch.device) -> frozenset:
    """Which `block_scaled_mm` layouts and output dtypes run on `device` and equal the loop of
    row-wise products: a set of (b_grid, out_dtype) pairs, empty on a CPU or where cuBLASLt has no
    block scaling. Checked once per device, on a small product."""
    if device.type == "cuda" and device.index is None:  # tensors name their GPU: "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _NATIVE_BLOCK_SCALING:
        _NATIVE_BLOCK_SCALING[key] = _probe_block_scaling(device)
    return _NATIVE_BLOCK_SCALING[key]


def _probe_block_scaling(device: torch.device) -> frozenset:
    if device.type != "cuda":
        return frozenset()
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(64, 512, device=device, generator=generator)
    b = torch.randn(256, 512, device=device, generator=generator)
    (a_q, a_scales), (b_q, b_grid) = quantize_tiles(a), quantize_blocks(b)
    b_rows = block_scales_per_row(b_grid, b.shape[0])
    expected = blockwise_loop_matmul(a_q, a_scales, b_q, b_rows)
    supported = set()
    for grid in (False, True):
        for out_dtype in NATIVE_OUTPUTS:
            try:
                got = block_scaled_mm(a_q, a_scales, b_q, b_grid if grid else b_rows,
                                      out_dtype, b_grid=grid).float()
            except (RuntimeError, ValueError):
                continue
            # bf16 output: one rounding, 2^-9 relative; the loop and cuBLASLt otherwise differ
            # only in fp32 summation order.
            if (got - expected).norm() <= 1e-2 * expected.norm():
                supported.add((grid, out_dtype))
    return frozenset(supported)


def tiled_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
                 b_scales: torch.Tensor, b_rows_per_scale: int = 1,
                 rows_multiple: int | None = None, out_dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """a @ b^T for fp8 a [M, K] and b [N, K], with one scale per row and 128 columns of a
    ([M, nK]) and of every `b_rows_per_scale` rows of b (1: [N, nK]; 128: a weight's block grid
    [ceil(N / 128), nK]), summed in fp32 and returned in `out_dtype`: on a GPU whose cuBLASLt
    scales blocks itself (`native_block_scaling`), one `block_scaled_mm` writing `out_dtype`
    directly; elsewhere `blockwise_loop_matmul`, cast. M and N are padded with zero rows (scale 1)
    to `rows_multiple` (the device's need by default), K with zero columns to whole blocks, and
    the padding is cut from the result."""
    return _tiled_matmul(a, a_scales, b, b_scales, b_rows_per_scale,
                         rows_multiple or cublas_multiple(a.device), out_dtype)


@torch.library.custom_op("tetrad::tiled_matmul", mutates_args=())
def _tiled_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
                  b_scales: torch.Tensor, b_rows_per_scale: int, rows_multiple: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """An op of its own, so that torch.compile calls it as it is. Inductor (torch 2.13, CPU)
    wrote only the whole 128-row repeats of a block grid's scales spread to rows (repeat_interleave,
    expand or a gather, cut to N rows), leaving the last partial block's rows unwritten: NaN and
    1e24 outputs in compiled fp8 training. Here the spreading runs eagerly. (Some torch releases'
    fake-tensor rules for `_scaled_mm` also know no block-shaped scales.)"""
    supported = native_block_scaling(a.device)
    grid = b_rows_per_scale == BLOCK and (True, out_dtype) in supported
    if b_rows_per_scale > 1 and not grid:
        b_scales = block_scales_per_row(b_scales, b.shape[0], b_rows_per_scale)
    direct = (grid, out_dtype) in supported
    if not direct and (False, torch.float32) not in supported:
        return blockwise_loop_matmul(a, a_scales, b, b_scales, rows_multiple).to(out_dtype)
    rows, cols = a.shape[0], b.shape[0]
    a, a_scales = _padded_operand(a, a_scales, rows_multiple, pad_scale_rows=True)
    b, b_scales = _padded_operand(b, b_scales, rows_multiple, pad_scale_rows=not grid)
    out = block_scaled_mm(a, a_scales, b, b_scales, out_dtype if direct else torch.float32,
                          b_grid=grid)
    return out[:rows, :cols].to(out_dtype)


@_tiled_matmul.register_fake
def _(a, a_scales, b, b_scales, b_rows_per_scale, rows_multiple, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


# cuBLASLt reads block scales in groups of four along K in some releases: K is padded to it.
NATIVE_K_MULTIPLE = 4 * BLOCK


def _padded_operand(x: torch.Tensor, scales: torch.Tensor, rows_multiple: int,
                    pad_scale_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x with zero rows to a multiple of `rows_multiple` and zero columns to a multiple of
    NATIVE_K_MULTIPLE, contiguous; its scales padded with ones to match (a block grid's rows
    already cover the padded rows: `pad_scale_rows` False)."""
    padded = pad_to(pad_to(x, 0, rows_multiple), 1, NATIVE_K_MULTIPLE).contiguous()
    extra_rows = padded.shape[0] - x.shape[0] if pad_scale_rows else 0
    extra_blocks = padded.shape[1] // BLOCK - scales.shape[1]
    scales = F.pad(scales.float(), [0, extra_blocks, 0, extra_rows], value=1.0)
    return padded, scales.contiguous()


def blockwise_loop_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
                          b_scales: torch.Tensor, rows_multiple: int | None = None
                          ) -> torch.Tensor:
    """`tiled_matmul` as DeepSeek's kernel computes it: one row-wise `torch._scaled_mm` per
    128-wide block of K (inside one block every row has a single scale), summed in fp32."""
    rows, cols = a.shape[0], b.shape[0]
    multiple = rows_multiple or cublas_multiple(a.device)
    a, b = pad_to(a, 0, multiple), pad_to(b, 0, multiple)
    a_scales = F.pad(a_scales.float(), [0, 0, 0, a.shape[0] - rows], value=1.0)
    b_scales = F.pad(b_scales.float(), [0, 0, 0, b.shape[0] - cols], value=1.0)
    num_blocks = math.ceil(a.shape[1] / BLOCK)
    # Contiguous [nK, rows, 128] copies: row-major a and column-major b in every block, the
    # layouts cuBLASLt's fp8 kernels need (the CPU takes any).
    a_blocks = pad_to(a, 1, BLOCK).view(a.shape[0], num_blocks, BLOCK).transpose(0, 1)
    b_blocks = pad_to(b, 1, BLOCK).view(b.shape[0], num_blocks, BLOCK).transpose(0, 1)
    a_blocks, b_blocks = a_blocks.contiguous(), b_blocks.contiguous()
    out = None
    for index in range(num_blocks):
        part = torch._scaled_mm(a_blocks[index], b_blocks[index].t(),
                                scale_a=a_scales[:, index:index + 1].contiguous(),
                                scale_b=b_scales[:, index].contiguous().view(1, -1),
                                out_dtype=torch.float32)
        out = part if out is None else out + part
    return out[:rows, :cols]


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would return here: autocast's, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class FP8LinearFunction(torch.autograd.Function):
    """Y = X W^T + b with all three matmuls in block-scaled E4M3 (the module docstring's recipe)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        lead, features = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, features)
        x_q, x_scales = quantize_tiles(rows)
        w_q, w_scales = quantize_blocks(weight)
        # With a bias the product stays fp32 until the bias is added; without, the GEMM writes
        # the output dtype itself.
        out = tiled_matmul(x_q, x_scales, w_q, w_scales, b_rows_per_scale=BLOCK,
                           out_dtype=out_dtype if bias is None else torch.float32)
        if bias is not None:
            out = out + bias.float()
        x_by_tokens = quantize_tiles(rows.t())  # [K, M] for dW's sum over tokens
        ctx.save_for_backward(*x_by_tokens, w_q, w_scales)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        return out.to(out_dtype).view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xt_q, xt_scales, w_q, w_scales = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g_q, g_scales = quantize_tiles(grad)  # 1x128 along N, the sum of dX = dY W
            w_t = w_q.t()  # [K, N]; its rows' scales per 128 of N: the transposed grid
            grad_x = tiled_matmul(g_q, g_scales, w_t, w_scales.t(), b_rows_per_scale=BLOCK,
                                  out_dtype=x_dtype).view(x_shape)
        if ctx.needs_input_grad[1]:
            gt_q, gt_scales = quantize_tiles(grad.t())  # [N, M], 128 tokens per tile
            grad_w = tiled_matmul(gt_q, gt_scales, xt_q, xt_scales, out_dtype=w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.float().sum(dim=0)
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """F.linear with block-scaled FP8 matmuls forward and backward."""
    return FP8LinearFunction.apply(x, weight, bias, output_dtype(x))
