"""Tiled attention (`--attention tiled`): the flash-attention algorithm written in torch. It walks
each block table a tile of blocks at a time, keeping a running max and log-sum-exp per query, so
neither the [queries, context] score matrix nor a contiguous copy of the whole context is built.

Also the gathering that `auto` falls back to where no in-place backend runs: SDPA on gathered
K/V, or this kernel when the copy would be large.
"""

from __future__ import annotations

import math

import torch

from tetrad.inference.worker.attention.sdpa import SdpaBackend

# With "auto", a call whose gathered K/V copy would exceed this many bytes goes to the tiled
# kernel, which never builds it. On CPU (benchmarks/bench_serving.py --attention) SDPA is twice
# as fast for prefill chunks over a cached context and on par for small decode batches; the tiled
# kernel ties or wins for decode batches whose contexts add up to 100+ MB of K/V.
GATHER_LIMIT_BYTES = 64 * 2**20


def tiled_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_positions: torch.Tensor,
                          tile_tokens: int = 256) -> torch.Tensor:
    batch, num_queries, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    value_dim = v_cache.shape[-1]  # narrower than head_dim for MLA's latent values
    blocks_per_tile = max(1, tile_tokens // block_size)
    group = num_heads // num_kv_heads
    # The query heads that share a KV head become extra query rows, so each tile is one plain
    # batched matmul per KV head: q [batch, kv_heads, group * queries, head_dim].
    q = q.view(batch, num_queries, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * num_queries, head_dim) * (1.0 / math.sqrt(head_dim))
    rows = group * num_queries
    running_max = torch.full((batch, num_kv_heads, rows, 1), float("-inf"), device=q.device)
    running_sum = torch.zeros((batch, num_kv_heads, rows, 1), device=q.device)
    acc = torch.zeros((batch, num_kv_heads, rows, value_dim), device=q.device)
    for first in range(0, block_tables.shape[1], blocks_per_tile):
        tile = block_tables[:, first:first + blocks_per_tile]  # [batch, tile_blocks]
        k = k_cache[tile].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [b, kv_heads, tile, dim]
        v = v_cache[tile].flatten(1, 2).transpose(1, 2).to(q.dtype)
        key_positions = torch.arange(first * block_size, first * block_size + k.shape[2],
                                     device=q.device)
        visible = key_positions <= query_positions.unsqueeze(-1)  # [batch, queries, tile_tokens]
        visible = visible.unsqueeze(1).expand(batch, group, *visible.shape[1:]).reshape(
            batch, 1, rows, -1)
        scores = (q @ k.transpose(-1, -2)).float()  # [batch, kv_heads, rows, tile_tokens]
        scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        # A query that has seen no visible key yet keeps max -inf; shift by 0 so exp gives 0s.
        shift = torch.where(new_max.isinf(), torch.zeros_like(new_max), new_max)
        probs = torch.exp(scores - shift)
        rescale = torch.exp(running_max - shift)  # earlier tiles were scaled by the older max
        running_sum = running_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc * rescale + (probs.to(v.dtype) @ v).float()
        running_max = new_max
    out = (acc / running_sum).view(batch, num_kv_heads, group, num_queries, value_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, num_heads, value_dim).to(q.dtype)


class TiledBackend(SdpaBackend):
    name = "tiled"

    def gathered(self, q, k_cache, v_cache, tables, positions, make_mask=None) -> torch.Tensor:
        return tiled_paged_attention(q, k_cache, v_cache, tables, positions)


class SizedGatheringBackend(SdpaBackend):
    """SDPA on gathered K/V, or the tiled kernel when the gathered copy would be large. Named
    "auto": what `--attention auto` resolves to where no in-place backend can run."""

    name = "auto"

    def gathered(self, q, k_cache, v_cache, tables, positions, make_mask=None) -> torch.Tensor:
        # K and V of every table entry, as SDPA's contiguous copy would hold them.
        size = 2 * tables.numel() * math.prod(k_cache.shape[1:]) * k_cache.element_size()
        if size > GATHER_LIMIT_BYTES:
            return tiled_paged_attention(q, k_cache, v_cache, tables, positions)
        return super().gathered(q, k_cache, v_cache, tables, positions, make_mask)
