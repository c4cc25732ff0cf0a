"""Gathered attention (`--attention sdpa`): each sequence's K/V copied out of the pool through its
block table into one contiguous tensor, then torch's fused scaled_dot_product_attention with a
position mask. The CPU path for prefill chunks over a cached context, and the reference the tests
hold every other backend to.

A step's decodes attend together in one batched call; a chunk of several tokens with no cached
context before it is plain causal attention over the chunk (the training path's SDPA); any other
chunk attends over its cached context through its table, gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tetrad.inference.worker.attention.base import (AttentionBackend, DeviceStep, HostStep,
                                                    StepAttention)
from tetrad.models.layers import causal_attention


def visible_keys(block_tables: torch.Tensor, query_positions: torch.Tensor, block_size: int
                 ) -> torch.Tensor:
    """SDPA's mask over the gathered keys [batch, 1, queries, keys]: the same for every layer of
    a step, so the caller can make it once."""
    key_positions = torch.arange(block_tables.shape[1] * block_size, device=block_tables.device)
    return (key_positions <= query_positions.unsqueeze(-1)).unsqueeze(1)


def sdpa_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, query_positions: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """`mask`: visible_keys(block_tables, query_positions, block size), when already made."""
    k = k_cache[block_tables].flatten(1, 2).to(q.dtype)  # [batch, blocks * size, kv_heads, dim]
    v = v_cache[block_tables].flatten(1, 2).to(q.dtype)
    if mask is None:
        mask = visible_keys(block_tables, query_positions, k_cache.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=k.shape[2] != q.shape[2])  # [batch, heads, queries, head_dim]
    return out.transpose(1, 2)


class GatheringStep:
    """A step of a gathering backend: `backend.gathered` attends over a batch of tables."""

    def __init__(self, backend: "SdpaBackend", step: DeviceStep, host: HostStep | None = None,
                 decode_seqs: torch.Tensor | None = None,
                 decode_rows: torch.Tensor | None = None):
        self.backend, self.kv_cache, self.step, self.host = backend, backend.kv_cache, step, host
        self.decode_seqs, self.decode_rows = decode_seqs, decode_rows  # mixed steps' decodes
        self.decode_mask: torch.Tensor | None = None  # decode steps: made once, used by all

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.step.slots, k, v)
        if self.step.all_decodes:
            out = self.backend.gathered(q.unsqueeze(1), k_cache, v_cache, self.step.tables,
                                        self.step.query_positions, self._decode_mask)[:, 0]
        else:
            out = self._mixed(q, k, v, k_cache, v_cache)
        return out.transpose(0, 1).unsqueeze(0)

    def _decode_mask(self) -> torch.Tensor:
        if self.decode_mask is None:
            self.decode_mask = visible_keys(self.step.tables, self.step.query_positions,
                                            self.backend.block_size)
        return self.decode_mask

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> torch.Tensor:
        """The mixed step's decodes: q [decodes, heads, head_dim] -> [decodes, heads, v dim]."""
        seqs = self.decode_seqs
        return self.backend.gathered(q.unsqueeze(1), k_cache, v_cache, self.step.tables[seqs],
                                     self.step.query_positions[seqs, :1])[:, 0]

    def _mixed(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if self.decode_rows is not None:
            out[self.decode_rows] = self.attend_decodes(q[self.decode_rows], k_cache, v_cache)
        tables, positions = self.step.tables, self.step.query_positions
        for start, end, seq in self.host.chunks:
            if seq is None:
                chunk = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                out[start:end] = causal_attention(*chunk)[0].transpose(0, 1)
            else:
                blocks = self.host.num_table_blocks[seq]
                out[start:end] = self.backend.gathered(
                    q[None, start:end], k_cache, v_cache, tables[seq:seq + 1, :blocks],
                    positions[seq:seq + 1, :end - start])[0]
        return out


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    reads_fp8 = True

    def gathered(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, positions: torch.Tensor, make_mask=None) -> torch.Tensor:
        """q [batch, queries, heads, head_dim] over the tables' keys. `make_mask`: returns
        visible_keys(tables, positions, block size), for a caller that keeps it across layers."""
        return sdpa_paged_attention(q, k_cache, v_cache, tables, positions,
                                    None if make_mask is None else make_mask())

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        if host.decodes and not host.all_decodes:
            return {"decode_seqs": host.decodes, "decode_rows": host.decode_rows}
        return {}

    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        return GatheringStep(self, step, host, sent.get("decode_seqs"), sent.get("decode_rows"))

    def graph_step(self, step: DeviceStep) -> StepAttention:
        return GatheringStep(self, step)

