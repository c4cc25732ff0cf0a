"""FP8 training matmuls with one scale per tensor (`--fp8-recipe tensor`), beside DeepSeek-V3's
blocks (tetrad.models.fp8, the default): the "tensorwise" recipe of torchtitan's float8 training
and of FP8 Formats for Deep Learning (Micikevicius et al., 2022).

Each block linear quantizes three tensors, each once, with its own amax: its input X and weight W
in E4M3, its output gradient dY in E5M2 (5 exponent bits: with one scale for a whole tensor, the
gradients' spread of magnitudes needs range more than precision). Each of the three matmuls is one
`torch._scaled_mm` with two scalar scales - on a GPU cuBLAS's plain FP8 GEMM, the fastest FP8
product there is, where the block-scaled one measured only 1.03-1.26x bf16 on a 1B model's block
shapes (BENCHMARKS.md). A scale per tensor is the same read either way, so X's copy serves the
forward and dW, and dY's serves dX and dW: three quantizations per linear against the block
recipe's five. The price is range: one outlier sets the scale of its whole tensor, and values
below half its smallest subnormal (2^-10 x amax / 448 in E4M3, 2^-17 x amax / 57344 in E5M2)
become zero.

Saved for backward: X's and W's E4M3 copies and their two fp32 scales. The master weight stays in
its own dtype and the output is in the autocast dtype (bf16), the bias added in fp32 before that.
"""

from __future__ import annotations

import torch

from tetrad.models.fp8 import E4M3, cublas_multiple, output_dtype, pad_to, scale_of, to_fp8

E5M2 = torch.float8_e5m2
# Before 2.13 the CPU kernel takes scalar scales only (an assertion otherwise; seen on 2.11).
CPU_TAKES_ROW_SCALES = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def quantize_whole(x: torch.Tensor, dtype: torch.dtype = E4M3
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale for all of x, amax / the format's largest value (1 for an all-zero or
    empty tensor): (x in `dtype`, scale []), x ≈ q * scale."""
    amax = x.abs().amax() if x.numel() else x.new_zeros(())
    scale = scale_of(amax, dtype)
    return to_fp8(x, scale, dtype), scale


def scaled_product(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                   b_scale: torch.Tensor, out_dtype: torch.dtype, multiple: int | None = None
                   ) -> torch.Tensor:
    """a @ b^T for fp8 a [M, K] and b [N, K], each with one scale, in one `torch._scaled_mm`
    written in `out_dtype`. cuBLAS wants a row-major and b^T column-major (b contiguous) and every
    dimension a multiple of 16: they are padded with zeros to `multiple` (by default 16 on a GPU,
    1 on the CPU, whose kernel takes any shape), and the padding cut from the result."""
    multiple = multiple or cublas_multiple(a.device)
    rows, cols = a.shape[0], b.shape[0]
    a = pad_to(pad_to(a, 0, multiple), 1, multiple).contiguous()
    b = pad_to(pad_to(b, 0, multiple), 1, multiple).contiguous()
    if a.device.type == "cpu" and CPU_TAKES_ROW_SCALES:
        # torch 2.13's CPU kernel for two E4M3 operands with scalar scales is a slow fallback
        # (0.65 s for 512x128x344, against 0.8 ms with one scale per row and column): the same
        # scale handed over for every row of a and every column of b^T takes the fast one.
        # (repeat, not expand: the kernel checks strides, and a 1 x 1 expansion keeps stride 0)
        a_scale = a_scale.float().reshape(1, 1).repeat(a.shape[0], 1)
        b_scale = b_scale.float().reshape(1, 1).repeat(1, b.shape[0])
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return out[:rows, :cols]


class TensorwiseFP8LinearFunction(torch.autograd.Function):
    """Y = X W^T + b with all three matmuls in FP8, one scale per tensor (the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        lead, features = x.shape[:-1], x.shape[-1]
        x_q, x_scale = quantize_whole(x.reshape(-1, features))
        w_q, w_scale = quantize_whole(weight)
        out = scaled_product(x_q, x_scale, w_q, w_scale,
                             out_dtype if bias is None else torch.float32)
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x_q, x_scale, w_q, w_scale)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        return out.to(out_dtype).view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_q, x_scale, w_q, w_scale = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        g_q, g_scale = quantize_whole(grad, E5M2)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # dX = dY W: W^T's rows are the columns summed over
            grad_x = scaled_product(g_q, g_scale, w_q.t(), w_scale, x_dtype).view(x_shape)
        if ctx.needs_input_grad[1]:  # dW = dY^T X: the sum runs over the tokens
            grad_w = scaled_product(g_q.t(), g_scale, x_q.t(), x_scale, w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.float().sum(dim=0)
        return grad_x, grad_w, grad_b, None


def tensorwise_fp8_linear(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with per-tensor-scaled FP8 matmuls forward and backward."""
    return TensorwiseFP8LinearFunction.apply(x, weight, bias, output_dtype(x))
