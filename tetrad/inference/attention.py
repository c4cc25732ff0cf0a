"""Attention of new query tokens over K/V that live in the paged cache, read through block tables.

Two implementations of the same function:
- `sdpa_paged_attention` gathers each sequence's K/V into one contiguous tensor and calls torch's
  fused scaled_dot_product_attention with a mask;
- `tiled_paged_attention` is the flash-attention algorithm written in torch: it walks the block
  table a tile of blocks at a time, keeping a running max and log-sum-exp per query, so neither
  the [queries, context] score matrix nor a contiguous copy of the context is ever built.

Shapes: q [batch, queries, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads,
head_dim]; block_tables [batch, max_blocks], as wide as the longest context (the caller sizes it
once per step, so nothing here waits on the device) and padded with any valid block id;
query_positions [batch, queries]: a query attends to keys at positions <= its own, which also
bounds it to its own context (padded queries repeat a real position). Returns [batch, queries,
heads, value head_dim] (the values' width, which MLA's latent makes narrower than the keys').
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sdpa_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, query_positions: torch.Tensor
                         ) -> torch.Tensor:
    k = k_cache[block_tables].flatten(1, 2)  # [batch, max_blocks * block_size, kv_heads, head_dim]
    v = v_cache[block_tables].flatten(1, 2)
    key_positions = torch.arange(k.shape[1], device=q.device)
    mask = key_positions <= query_positions.unsqueeze(-1)  # [batch, queries, keys]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1),
        enable_gqa=k.shape[2] != q.shape[2])  # [batch, heads, queries, head_dim]
    return out.transpose(1, 2)


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
        k = k_cache[tile].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, tile_tokens, head_dim]
        v = v_cache[tile].flatten(1, 2).transpose(1, 2)
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

