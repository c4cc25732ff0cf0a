"""The block-scaled FP8 product on cuBLASLt against the CPU's, at shapes cuBLASLt cannot take
unpadded (M and N not multiples of 16). Skipped without a GPU with FP8 units (compute 8.9+)."""

from __future__ import annotations

import pytest
import torch

from tetrad.models.fp8 import (block_scales_per_row, fp8_linear, quantize_blocks,
                               quantize_tiles, tiled_matmul)

has_fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not has_fp8_gpu, reason="needs a GPU with FP8 (compute 8.9+)")

FP32_SLACK = 1e-5  # summation order, relative to the sum of |products| (as tests/test_fp8.py)


def test_odd_shapes_match_the_cpu_product():
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 300, generator=generator), torch.randn(70, 300, generator=generator)
    a_q, a_scales = quantize_tiles(a)
    b_q, b_scale_inv = quantize_blocks(b)
    b_scales = block_scales_per_row(b_scale_inv, 70)
    cpu = tiled_matmul(a_q, a_scales, b_q, b_scales)
    gpu = tiled_matmul(a_q.cuda(), a_scales.cuda(), b_q.cuda(), b_scales.cuda()).cpu()
    bound = FP32_SLACK * (a_q.float().abs() * a_scales.repeat_interleave(128, 1)[:, :300]) @ (
        b_q.float().abs() * b_scales.repeat_interleave(128, 1)[:, :300]).t()
    assert gpu.shape == (37, 70)
    assert ((gpu - cpu).abs() <= bound).all()


def linear_on(device: str, x: torch.Tensor, weight: torch.Tensor):
    x = x.to(device).requires_grad_()
    weight = weight.to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = fp8_linear(x, weight)
    out.float().sum().backward()  # a gradient of ones: the same on both devices
    return out.detach().float().cpu(), x.grad.cpu(), weight.grad.cpu()


def test_fp8_linear_at_odd_shapes_matches_the_cpu():
    """Forward and both gradients equal the CPU's up to fp32 summation order, seen through the
    bf16 output: at most one bf16 rounding (2^-8 relative) apart."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 13, 200, generator=generator)
    weight = torch.randn(90, 200, generator=generator)
    for gpu, cpu in zip(linear_on("cuda", x, weight), linear_on("cpu", x, weight), strict=True):
        assert gpu.shape == cpu.shape
        torch.testing.assert_close(gpu, cpu, rtol=2 ** -7, atol=2 ** -7 * cpu.abs().max().item())
