"""A CPU decode step as one C++ op (decode_step.cpp), in place of the model's forward, when every
scheduled sequence computes one token: on a CPU what CUDA graphs are on a GPU.

The eager forward of a Llama-family layer at one token is ~30 torch ops (norms, views, rotary,
SiLU, residual adds) around four matmuls; each costs a dispatch and an allocation, and the
bf16 matmuls at one row read their weights several times slower than memory allows. The fused
step does the same arithmetic in one call, from the embedding to the logits, streaming each
weight once (fp32 accumulation) and rounding to the model's dtype where the eager ops do.
`--quantization int8|int4` projections are streamed from the very tensors their layers hold
(quant_rows.cpp reads torch's packed layouts), dequantized in registers. Prefill, mixed steps
and every model this does not cover (below) run the model's own forward.
"""

from __future__ import annotations

import torch
from torch import nn

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
    if model.norm.weight.dtype != dtype:
        return "a final norm of another dtype"
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
    """The decode step of `model` as one decode_model op over `kv_cache`, built straight from the
    step's plan (runner.StepPlan) as CUDA graphs replay theirs: nothing of the eager step's
    preparation (per-backend tables, its context) runs."""

    def __init__(self, model: nn.Module, kv_cache, block_size: int):
        load_cpu_kernels()
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        config = model.config
        dtype = model.embed.weight.dtype
        self.weights, self.scales = [], []
        for block in model.layers:
            linears = (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down)
            streamed = [streamed_weight(linear, dtype) for linear in linears]
            (qkv, _), (out, _), (up, _), (down, _) = streamed
            self.weights += [block.attn_norm.weight, qkv, out, block.mlp_norm.weight, up, down]
            self.scales += [scales for _, scales in streamed]
        self.k_caches, self.v_caches = zip(*(kv_cache.layer(index)
                                             for index in range(len(model.layers))))
        self.head_weight, self.head_scales = (
            (model.embed.weight, None) if model.lm_head is None
            else streamed_weight(model.lm_head, dtype))
        self.constants = dict(eps=config.norm_eps, num_heads=config.num_heads,
                              num_kv_heads=config.num_kv_heads)
        # The K and V rows the attention reads (int64 [1]) when set: what benchmarks count.
        self.rows_read: torch.Tensor | None = None

    @staticmethod
    def fits(plan) -> bool:
        """Every sequence of the step computes one token and samples from it."""
        return max(plan.num_tokens) == 1 and all(plan.samples)

    def run(self, plan) -> torch.Tensor:
        """The step's logits [sequences, vocab], in plan order, as the forward gives them."""
        seqs = len(plan.starts)
        slots, width, tables = plan.decode_slots_and_tables(self.block_size,
                                                            self.kv_cache.pad_block)
        lens = [start + 1 for start in plan.starts]
        ids, positions, lens, slots, tables = torch.tensor(
            plan.token_ids + plan.starts + lens + slots + tables).split(
            [seqs, seqs, seqs, seqs, seqs * width])
        model = self.model
        return torch.ops.tetrad.decode_model(
            ids, positions, model.embed.weight, model.rotary.inv_freq,
            model.rotary.attention_factor, self.weights, self.scales, self.k_caches,
            self.v_caches, tables=tables.view(seqs, width), context_lens=lens,
            slots=slots, norm_w=model.norm.weight, head_w=self.head_weight,
            head_scales=self.head_scales, rows_read=self.rows_read, **self.constants)
