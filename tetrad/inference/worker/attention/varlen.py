"""Flash-attention's varlen kernel over the paged pool (`--attention varlen`, auto on a GPU where
it can): every token of the step at once, the K/V pool passed as pages with the block tables, as
vLLM and nano-vllm call it. CUDA only, blocks of a multiple of 256 tokens (flash-attention's rule
for paged K/V), keys and values of one width (so no MLA latent cache).
"""

from __future__ import annotations

import itertools

import torch

from tetrad.inference.worker.attention.base import (AttentionBackend, DeviceStep, HostStep,
                                                    StepAttention)

VARLEN_BLOCK_MULTIPLE = 256  # flash-attention's rule for paged K/V: blocks of a multiple of it


def flash_takes_block_tables() -> bool:
    """Whether this torch's flash-attention op reads paged K/V (a `block_table` argument): torch
    2.13 has it; the public `varlen_attn` wrapper around the op changed its arguments from release
    to release, so the op is called directly and asked first."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(argument.name == "block_table" for argument in schema.arguments)


def varlen_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seq_q: torch.Tensor,
                           cu_seq_k: torch.Tensor, context_lens: torch.Tensor, max_q: int,
                           max_k: int) -> torch.Tensor:
    """Every token of a step at once, on CUDA: q [tokens, heads, head_dim] (sequence after
    sequence, cu_seq_q [batch + 1] int32 their offsets); sequence b attends causally (its queries
    are the last of its context_lens[b] keys) over the pages block_tables[b] (int32) names.
    Flash-attention takes fewer K/V heads than query heads (GQA) as they are."""
    return torch.ops.aten._flash_attention_forward(
        q, k_cache, v_cache, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, True, False,
        seqused_k=context_lens, block_table=block_tables)[0]


class VarlenStep:
    """`args`: varlen_paged_attention's after the pools (int32 tables, cu_seq_q, cu_seq_k,
    context_lens, max_q, max_k)."""

    def __init__(self, kv_cache, slots: torch.Tensor, args: tuple):
        self.kv_cache, self.slots, self.args = kv_cache, slots, args

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.slots, k, v)
        out = varlen_paged_attention(q, k_cache, v_cache, *self.args)
        return out.transpose(0, 1).unsqueeze(0)


class VarlenBackend(AttentionBackend):
    name = "varlen"
    devices = ("cuda",)
    automatic = True
    capturable = True

    @classmethod
    def refusal(cls, device, block_size, latent, dtype=None) -> str | None:
        if latent:
            return ("--attention varlen cannot read an MLA model's latent cache "
                    "(flash-attention needs keys and values of one width): use --attention "
                    "flex or auto")
        if device.type != "cuda" or block_size % VARLEN_BLOCK_MULTIPLE:
            return (f"--attention varlen needs a GPU and a --block-size that is a multiple of "
                    f"{VARLEN_BLOCK_MULTIPLE} (flash-attention's paged K/V rule)")
        if not flash_takes_block_tables():
            return (f"--attention varlen: torch {torch.__version__}'s flash-attention takes no "
                    "block tables; use --attention flex or auto")
        return None

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        lens = [start + num for start, num in zip(host.starts, host.num_tokens)]
        return {"cu_seq_q": [0, *itertools.accumulate(host.num_tokens)],
                "cu_seq_k": [0, *itertools.accumulate(lens)], "lens": lens}

    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        max_k = max(start + num for start, num in zip(host.starts, host.num_tokens))
        return VarlenStep(self.kv_cache, step.slots, (
            step.tables.int(), sent["cu_seq_q"].int(), sent["cu_seq_k"].int(),
            sent["lens"].int(), host.max_q, max_k))

    def graph_step(self, step: DeviceStep) -> StepAttention:
        lens = step.query_positions[:, 0] + 1
        cu_seq_k = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        cu_seq_q = torch.arange(lens.shape[0] + 1, device=lens.device)
        # The tables are as wide as the longest context: its length bounds every sequence's.
        max_k = step.tables.shape[1] * self.block_size
        return VarlenStep(self.kv_cache, step.slots, (
            step.tables.int(), cu_seq_q.int(), cu_seq_k.int(), lens.int(), 1, max_k))
