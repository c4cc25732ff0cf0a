"""The block-scaled FP8 product on a GPU, at shapes cuBLASLt cannot take unpadded (M and N not
multiples of 16, K not of 128): cuBLASLt's own block scaling where `native_block_scaling` found it
(Hopper, CUDA 12.9+), the loop of row-wise products elsewhere. References: the dequantised
product in fp32 on the CPU, and the loop on the same GPU (the CPU's row-wise `_scaled_mm` is
missing from some torch releases, 2.11 among them). And the per-tensor linear of
`--fp8-recipe tensor` against the CPU's. Skipped without a GPU with FP8 units (compute 8.9+)."""

from __future__ import annotations

import pytest
import torch

from tetrad.models import fp8
from tetrad.models.fp8 import (block_scales_per_row, dequantize_blocks, dequantize_tiles,
                               fp8_linear, quantize_blocks, quantize_tiles, tiled_matmul)
from tetrad.models.fp8_tensorwise import tensorwise_fp8_linear

has_fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not has_fp8_gpu, reason="needs a GPU with FP8 (compute 8.9+)")

# Hopper's FP8 tensor cores keep about 14 bits of the running sum inside each 128-wide block
# (DeepSeek-V3, arXiv 2412.19437, section 3.3.2; the blocks' partial sums are added in fp32): an
# H100 with torch 2.11 put the product 2e-5 of the sum of |products| from the exact value (the
# largest pytest printed), so the bound is 2^-13 of that sum, not tests/test_fp8.py's fp32 1e-5.
TENSOR_CORE_SLACK = 2 ** -13
BF16_ROUNDING = 2 ** -8  # one rounding of a bf16 output, with room


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_rows_per_scale", [1, 128])
def test_odd_shapes_match_the_dequantised_product(b_rows_per_scale, out_dtype):
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 300, generator=generator), torch.randn(70, 300, generator=generator)
    a_q, a_scales = quantize_tiles(a)
    b_q, b_grid = quantize_blocks(b)
    b_scales = b_grid if b_rows_per_scale == 128 else block_scales_per_row(b_grid, 70)
    a_values, b_values = dequantize_tiles(a_q, a_scales), dequantize_blocks(b_q, b_grid)
    exact = a_values @ b_values.t()
    gpu = tiled_matmul(a_q.cuda(), a_scales.cuda(), b_q.cuda(), b_scales.cuda(),
                       b_rows_per_scale=b_rows_per_scale, out_dtype=out_dtype).cpu()
    rounding = BF16_ROUNDING if out_dtype == torch.bfloat16 else 0.0
    bound = TENSOR_CORE_SLACK * (a_values.abs() @ b_values.abs().t()) + rounding * exact.abs()
    assert gpu.shape == (37, 70) and gpu.dtype == out_dtype
    assert ((gpu.float() - exact).abs() <= bound).all()


def linear_on_gpu(x: torch.Tensor, weight: torch.Tensor):
    x = x.cuda().requires_grad_()
    weight = weight.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fp8_linear(x, weight)
    out.float().sum().backward()  # a gradient of ones
    return out.detach().float().cpu(), x.grad.cpu(), weight.grad.cpu()


def test_fp8_linear_with_cublas_block_scaling_equals_the_loop(monkeypatch):
    """Forward and both gradients through cuBLASLt's block scaling (where this GPU has it) equal
    the loop of row-wise products on the same GPU up to fp32 summation order, seen through bf16
    outputs: at most about one bf16 rounding apart."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 13, 200, generator=generator)
    weight = torch.randn(90, 200, generator=generator)
    native = linear_on_gpu(x, weight)
    monkeypatch.setattr(fp8, "native_block_scaling", lambda device: frozenset())
    loop = linear_on_gpu(x, weight)
    for got, expected in zip(native, loop, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=2 * BF16_ROUNDING,
                                   atol=2 * BF16_ROUNDING * expected.abs().max().item())


def test_hopper_has_cublas_block_scaling():
    """Where the device and CUDA have it (compute 9.0, CUDA 12.9+), the fast path is found: one
    GEMM per product with the weight's 128x128 block grid and a bf16 output."""
    version = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    if torch.cuda.get_device_capability() != (9, 0) or version < (12, 9):
        pytest.skip("cuBLASLt block scaling: Hopper with CUDA 12.9+")
    supported = fp8.native_block_scaling(torch.device("cuda"))
    assert (True, torch.bfloat16) in supported and (False, torch.float32) in supported


def test_tensorwise_linear_on_the_gpu_equals_the_cpu():
    """`--fp8-recipe tensor` on cuBLAS's FP8 GEMM, at shapes it cannot take unpadded (every
    dimension padded to 16): the same E4M3/E5M2 operands as the CPU's (the quantizer divides and
    rounds alike), so forward and both gradients differ from the CPU's only by the tensor cores'
    summation: within TENSOR_CORE_SLACK of the sum of |products| (twice the unquantized one)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 25, 300, generator=generator)
    weight = torch.randn(90, 300, generator=generator) * 0.05
    grad_out = torch.randn(3, 25, 90, generator=generator)

    def run(device: str):
        inputs = x.to(device).requires_grad_(), weight.to(device).requires_grad_()
        out = tensorwise_fp8_linear(*inputs)
        out.backward(grad_out.to(device))
        return [tensor.detach().cpu() for tensor in (out, inputs[0].grad, inputs[1].grad)]

    x2, g2 = x.reshape(-1, 300).abs(), grad_out.reshape(-1, 90).abs()
    sums = (x2 @ weight.abs().t(), g2 @ weight.abs(), g2.t() @ x2)
    for gpu, cpu, total in zip(run("cuda"), run("cpu"), sums, strict=True):
        assert ((gpu - cpu).abs().reshape(total.shape) <= 2 * TENSOR_CORE_SLACK * total).all()
