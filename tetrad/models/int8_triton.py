"""Int8 weight-only products on a GPU in Triton: y = (x @ values.T) * scales, the int8 weight
read as it is stored and widened to the activation dtype in registers, so a decode step reads one
byte per weight instead of two.

Why not torch's own: on an H200 with torch 2.11, `torch._weight_int8pack_mm` on CUDA took 13.2 ms
for a decode step of a 1.1B Llama at batch 1 (bf16: 2.4 ms) and 688 ms at batch 16
(`benchmarks/gpu_quant_decode.py`, BENCHMARKS.md). Decode rows are few and memory-bound: tiles of
16 rows by 16 output columns spread one matrix over hundreds of programs, each streaming its
columns' weights once. Many rows (a prefill) are compute-bound: there the weight is widened once
and cuBLAS multiplies (`Int8Linear.forward`), which costs a pass over the weight but runs at the
matrix units' rate.

On a CPU the kernel runs under Triton's interpreter when TRITON_INTERPRET=1 was set before triton
was imported (the tests do, in a fresh process); the engine never launches it there."""

from __future__ import annotations

import torch

from tetrad.models.triton_import import HAS_TRITON, tl, triton


@triton.jit
def _int8_weight_product(x, values, scales, y, rows, cols, depth, stride_x, stride_w, stride_y,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        k = start + ks
        x_tile = tl.load(x + row[:, None] * stride_x + k[None, :],
                         mask=(row[:, None] < rows) & (k[None, :] < depth), other=0.0)
        w_tile = tl.load(values + col[None, :] * stride_w + k[:, None],
                         mask=(col[None, :] < cols) & (k[:, None] < depth), other=0)
        acc += tl.dot(x_tile, w_tile.to(x_tile.dtype))
    scale = tl.load(scales + col, mask=col < cols, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(y + row[:, None] * stride_y + col[None, :], out.to(y.dtype.element_ty),
             mask=(row[:, None] < rows) & (col[None, :] < cols))


def int8_weight_product(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
                        ) -> torch.Tensor:
    """x [M, K] (16-bit, or fp32 under the interpreter) @ (values [N, K] int8 * scales [N]).T ->
    [M, N] in x's dtype, accumulated in fp32. M up to quant.MAX_KERNEL_ROWS."""
    rows, depth = x.shape
    cols = values.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    block_m = 16 if rows <= 16 else 64
    block_n = 16 if rows <= 16 else 64
    block_k = 256 if rows <= 16 else 64
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _int8_weight_product[grid](x, values, scales, y, rows, cols, depth, x.stride(0),
                               values.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k)
    return y
