"""The FP8 product of `--dtype fp8` on one GPU: what each way of computing a block-scaled matmul,
and the per-tensor one of `--fp8-recipe tensor`, costs against bf16, at the ~1B Llama training
shapes of benchmarks/gpu_training.py.

    python benchmarks/gpu_fp8_matmul.py            # one H100/H200, under a minute

Rows per shape (Y = A B^T, A [M, K] and B [N, K], fp8 E4M3 with DeepSeek-V3's scales):
  bf16           torch.mm of the bf16 operands: the row FP8 must beat
  loop           tetrad.models.fp8.blockwise_loop_matmul: one row-wise `_scaled_mm` per 128-wide
                 block of K, summed in fp32 (what the CPU and a GPU without block scaling run)
  rows-fp32      tiled_matmul with B's scales per row (1x128) and an fp32 output: one
                 `_scaled_mm` with cuBLASLt's own block scaling (CUDA 12.9+, Hopper) where
                 `native_block_scaling` found it, else the loop; `--dtype fp8` runs it for dW
  grid-bf16      tiled_matmul with B's scales as its 128x128 block grid (DeepSeek-V3's weight
                 layout) and a bf16 output: what `--dtype fp8` runs forward and for dX
  tensor-bf16    tetrad.models.fp8_tensorwise.scaled_product: A and B each with one scale, a
                 bf16 output, cuBLAS's plain FP8 GEMM (`--fp8-recipe tensor`)

Each block-scaled row is checked against `loop` (the same quantized inputs, so the same function
up to fp32 summation order and the output's rounding), the per-tensor row against the fp32
product of its own dequantized inputs: relative error ||row - reference|| / ||reference||.
Times are the median of CUDA-event timings after warm-up, on random inputs (never zeros). Prints
a table; writes JSON to $OUT/gpu_fp8_matmul.json where OUT is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from timing import cuda_median_seconds

from tetrad.models.fp8 import (blockwise_loop_matmul, block_scales_per_row,
                               native_block_scaling, quantize_blocks, quantize_tiles,
                               tiled_matmul)
from tetrad.models.fp8_tensorwise import quantize_whole, scaled_product

# (name, M, K, N) of the 1B shape at 16,384 tokens a step: attention's output projection, the
# FFN's up and down projections, the head, and a weight gradient (sums over the tokens).
SHAPES = (("o_proj", 16384, 2048, 2048), ("ffn_up", 16384, 2048, 5632),
          ("ffn_down", 16384, 5632, 2048), ("head", 16384, 2048, 32000),
          ("dW_ffn_up", 5632, 16384, 2048))


def median_ms(fn) -> float:
    return cuda_median_seconds(fn, warmup=3, repeats=20) * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU with FP8 (compute 8.9+)")
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows, results = [], {}
    for name, m, k, n in SHAPES:
        a = torch.randn(m, k, device=device)
        b = torch.randn(n, k, device=device) * 0.02
        a_q, a_scales = quantize_tiles(a)
        b_q, b_grid = quantize_blocks(b)
        b_rows = block_scales_per_row(b_grid, n)
        a16, b16 = a.bfloat16(), b.bfloat16()
        flops = 2 * m * k * n
        (a_t, a_scale), (b_t, b_scale) = quantize_whole(a), quantize_whole(b)
        loop = blockwise_loop_matmul(a_q, a_scales, b_q, b_rows)
        references = {"tensor-bf16": (a_t.float() * a_scale) @ (b_t.float() * b_scale).t()}
        products = {
            "loop": lambda: blockwise_loop_matmul(a_q, a_scales, b_q, b_rows),
            "rows-fp32": lambda: tiled_matmul(a_q, a_scales, b_q, b_rows),
            "grid-bf16": lambda: tiled_matmul(a_q, a_scales, b_q, b_grid, b_rows_per_scale=128,
                                              out_dtype=torch.bfloat16),
            "tensor-bf16": lambda: scaled_product(a_t, a_scale, b_t, b_scale, torch.bfloat16)}
        shape_rows, errors = {"bf16": median_ms(lambda: a16 @ b16.t())}, {}
        for variant, product in products.items():
            try:
                out = product().float()
            except (RuntimeError, ValueError) as error:
                errors[variant] = str(error).splitlines()[0][:160]
                continue
            reference = references.get(variant, loop)
            errors[variant] = float((out - reference).norm() / reference.norm())
            shape_rows[variant] = median_ms(product)
        results[name] = {"m": m, "k": k, "n": n, "ms": shape_rows, "error": errors}
        for variant, ms in shape_rows.items():
            error = errors.get(variant)
            rows.append(f"| {name} {m}x{k}x{n} | {variant} | {ms:.3f} | "
                        f"{flops / ms / 1e9:.0f} | {shape_rows['bf16'] / ms:.2f}x | "
                        f"{'-' if error is None else f'{error:.1e}'} |")
        for variant, error in errors.items():
            if isinstance(error, str):
                rows.append(f"| {name} | {variant} | refused: {error} | | | |")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"cuBLASLt block scaling (B's scales as a grid?, output): "
          f"{sorted(native_block_scaling(device), key=str) or 'none (the loop runs)'}")
    print("| shape MxKxN | product | ms | TFLOP/s | bf16 time / this | error vs reference |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    out = Path(os.environ.get("OUT") or "runs") / "gpu_fp8_matmul.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                               "torch": torch.__version__,
                               "native_block_scaling": sorted(map(str, native_block_scaling(device))),
                               "shapes": results}, indent=2))


if __name__ == "__main__":
    main()
