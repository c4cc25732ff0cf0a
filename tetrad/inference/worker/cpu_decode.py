"""A CPU decode step with one C++ op per layer (decode_step.cpp), in place of the model's forward,
when every scheduled sequence computes one token: on a CPU what CUDA graphs are on a GPU.

The eager forward of a Llama-family layer at one token is ~30 torch ops (norms, views, rotary,
SiLU, residual adds) around four matmuls; each costs a dispatch and an allocation, and the
bf16 matmuls at one row read their weights several times slower than memory allows. The fused
layer does the same arithmetic in one call, streaming each weight once (fp32 accumulation) and
rounding to the model's dtype where the eager ops do. `--quantization int8|int4` projections are
streamed from the very tensors their layers hold (quant_rows.cpp reads torch's packed layouts),
dequantized in registers. Prefill, mixed steps and every model this does not cover (below) run
the model's own forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tetrad.inference.worker.attention.base import StepContext
from tetrad.inference.worker.cpu_kernels import load_cpu_kernels
from tetrad.models.quant import Int4Linear, Int8Linear


def streamed_weight(module: nn.Module, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What linear_rows multiplies by for an unsharded projection without bias computing in
    `dtype`: (weight, None) for a plain one, (values, scales) for an int8 one on torch's packed
    CPU path, (packed values, scales_and_offsets) for an int4 one in torch's CPU layout; None for
    any other (biased, sharded, fp8, a reference-path quantized layer)."""
    if getattr(module, "bias", None) is not None:
        return None
    if type(module) is nn.Linear:
        weight = module.weight
        return (weight, None) if weight.dtype == dtype and weight.is_contiguous() else None
    if type(module) is Int8Linear and module.packed and not module.values.is_cuda:
        return (module.values, module.scales) if module.dtype == dtype else None
    if type(module) is Int4Linear and module.kernel == "cpu":
        return (module.values, module.scales_and_offsets) if module.dtype == dtype else None
    return None


def fused_decode_refusal(model: nn.Module, pool_dtype: torch.dtype) -> str | None:
    """Why the fused step cannot run `model` (None when it can): it covers single-device
    Llama-family decoders (RMSNorm, rotary, SwiGLU, no biases, no experts, no MLA) in fp32, bf16
    or fp16 whose KV pool holds the model's dtype, their projections plain or quantized on
    torch's packed CPU paths (streamed_weight)."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "layers", None) is None or model.rotary is None:
        return "not a rotary decoder"
    if (config.norm != "rmsnorm" or config.mlp != "swiglu" or config.attention == "mla"
            or config.num_experts or model.pos_embed is not None):
        return "not a Llama-family layer (RMSNorm, SwiGLU, rotary, no experts, no MLA)"
    dtype = model.embed.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or pool_dtype != dtype:
        return "a KV pool or weights of another dtype"
    for block in model.layers:
        linears = (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down)
        norms = (block.attn_norm.weight, block.mlp_norm.weight)
        if any(streamed_weight(linear, dtype) is None for linear in linears) or \
                any(norm.dtype != dtype for norm in norms):
            return "sharded, biased or fp8 projections, or quantized off torch's packed CPU path"
    if model.lm_head is not None and streamed_weight(model.lm_head, dtype) is None:
        return "an output head the kernel does not read"
    return None


class FusedCpuDecode:
    """The decode step of `model` as one decode_layer op per layer over `kv_cache`."""

    def __init__(self, model: nn.Module, kv_cache):
        load_cpu_kernels()
        self.model, self.kv_cache = model, kv_cache
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.eps = config.norm_eps
        dtype = model.embed.weight.dtype
        self.layers = []
        for block in model.layers:
            (qkv, qkv_scales), (out, out_scales), (up, up_scales), (down, down_scales) = (
                streamed_weight(linear, dtype)
                for linear in (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down))
            self.layers.append((
                (block.attn_norm.weight, qkv, out, block.mlp_norm.weight, up, down),
                dict(qkv_scales=qkv_scales, out_scales=out_scales, up_scales=up_scales,
                     down_scales=down_scales)))
        self.head_weight, self.head_scales = (
            (model.embed.weight, None) if model.lm_head is None
            else streamed_weight(model.lm_head, dtype))

    @staticmethod
    def fits(context: StepContext) -> bool:
        """Every sequence of the step computes one token, through the CPU kernel's tables."""
        return (context.attention.step.all_decodes
                and getattr(context.attention, "decode_lens", None) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: StepContext
            ) -> torch.Tensor:
        """input_ids, positions [seqs] -> logits [rows with samples, vocab], as the forward."""
        attention = context.attention
        x = F.embedding(input_ids, self.model.embed.weight)  # [seqs, hidden]
        cos, sin = self.model.rotary(positions)  # [seqs, head_dim] each, fp32
        for index, (weights, scales) in enumerate(self.layers):
            k_cache, v_cache = self.kv_cache.layer(index)
            x = torch.ops.tetrad.decode_layer(
                x, *weights, self.eps, cos, sin, self.num_heads, self.num_kv_heads, k_cache,
                v_cache, attention.decode_tables, attention.decode_lens, attention.step.slots,
                attention.rows_read, **scales)
        x = self.model.norm(x[context.logits_indices])
        return torch.ops.tetrad.linear_rows(x, self.head_weight, scales=self.head_scales)
