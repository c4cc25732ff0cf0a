"""FlexAttention over the paged pool (`--attention flex`): a block mask lists each sequence's
physical blocks (`paged_block_mask`, built once per step), so the kernel visits only those blocks
of the pool. Compiled (torch.compile; a Triton kernel on GPU, C++ on CPU) it reads in place; run
eagerly torch evaluates it densely over the whole pool, which only tests use.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tetrad.inference.worker.attention.base import (AttentionBackend, DeviceStep, HostStep,
                                                    StepAttention)


def paged_block_mask(block_tables: torch.Tensor, num_table_blocks: torch.Tensor,
                     query_positions: torch.Tensor, num_blocks: int, block_size: int
                     ) -> BlockMask:
    """FlexAttention's block mask for a step: query row q of sequence b sees pool slot s when s's
    block is one of b's first num_table_blocks[b] table entries and its position in the sequence
    is <= query_positions[b, q]. The mask lists exactly those blocks, so a compiled kernel reads
    each sequence's own blocks and nothing else; the mask function (applied within them, and
    everywhere by the eager fallback) maps a pool slot back to its position through
    `logical` [batch, num_blocks]: the table index of each block in b's table, -1 elsewhere."""
    batch, width = block_tables.shape
    num_queries = query_positions.shape[1]
    entries = torch.arange(width, device=block_tables.device).expand(batch, width)
    used = entries < num_table_blocks[:, None]
    # Padding entries scatter into an extra column, so they never overwrite a used block's index.
    logical = torch.full((batch, num_blocks + 1), -1, dtype=torch.long,
                         device=block_tables.device)
    logical.scatter_(1, torch.where(used, block_tables, num_blocks), entries)
    logical = logical[:, :num_blocks]
    kv_indices = torch.zeros((batch, num_blocks), dtype=torch.int32, device=block_tables.device)
    kv_indices[:, :width] = block_tables

    def visible(b, h, q_index, kv_index):
        table_index = logical[b, kv_index // block_size]
        position = table_index * block_size + kv_index % block_size
        return (table_index >= 0) & (position <= query_positions[b, q_index])

    return BlockMask.from_kv_blocks(
        num_table_blocks.to(torch.int32).view(batch, 1, 1), kv_indices.view(batch, 1, 1, -1),
        BLOCK_SIZE=(num_queries, block_size), mask_mod=visible,
        seq_lengths=(num_queries, num_blocks * block_size), compute_q_blocks=False)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_mask: BlockMask, attend=flex_attention) -> torch.Tensor:
    """q [batch, queries, heads, head_dim] over the whole pool (viewed, not copied, as one
    batch-1 sequence of num_blocks * block_size slots that every row of q shares) as block_mask
    (paged_block_mask) allows. `attend`: flex_attention, or its compiled form."""
    kv_heads = k_cache.shape[2]
    # flatten(0, 1) is a view even of MLA's value columns: the slice keeps the block strides.
    k, v = (cache.flatten(0, 1).unsqueeze(0).transpose(1, 2) for cache in (k_cache, v_cache))
    out = attend(q.transpose(1, 2), k, v, block_mask=block_mask,
                 enable_gqa=kv_heads != q.shape[2])
    return out.transpose(1, 2)


class FlexStep:
    """Every sequence of the step in one call; a mixed step's queries are padded to max_q per
    sequence (`query_rows` [seqs, max_q] picks each query's token row, `token_index` [tokens]
    each token's place among the padded queries)."""

    def __init__(self, backend: "FlexBackend", step: DeviceStep, block_mask: BlockMask,
                 query_rows: torch.Tensor | None = None, token_index: torch.Tensor | None = None):
        self.backend, self.kv_cache, self.step = backend, backend.kv_cache, step
        self.block_mask, self.query_rows, self.token_index = block_mask, query_rows, token_index

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.step.slots, k, v)
        all_decodes = self.step.all_decodes
        queries = q.unsqueeze(1) if all_decodes else q[self.query_rows]
        out = flex_paged_attention(queries, k_cache, v_cache, self.block_mask, self.backend.flex)
        out = out[:, 0] if all_decodes else out.flatten(0, 1)[self.token_index]
        return out.transpose(0, 1).unsqueeze(0)


class FlexBackend(AttentionBackend):
    name = "flex"
    capturable = True

    def __init__(self, kv_cache, block_size: int, compile: bool = False):
        super().__init__(kv_cache, block_size, compile)
        device = kv_cache.pool.device
        # Eager FlexAttention is a dense reference over the whole pool; compiled it reads the
        # pool in place, so a GPU always compiles it. Inductor's CPU kernel fails to build with
        # dynamic shapes (torch 2.13): on a CPU it compiles once per step shape.
        self.flex = flex_attention
        if compile or device.type == "cuda":
            self.flex = torch.compile(flex_attention,
                                      dynamic=None if device.type == "cuda" else False)

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        if host.all_decodes:
            return {}
        query_rows, token_index, row = [], [], 0
        for index, num_new in enumerate(host.num_tokens):
            padding = host.max_q - num_new  # padded queries repeat the last one
            query_rows += [*range(row, row + num_new), *[row + num_new - 1] * padding]
            token_index += range(index * host.max_q, index * host.max_q + num_new)
            row += num_new
        return {"query_rows": query_rows, "token_index": token_index}

    def _block_mask(self, step: DeviceStep) -> BlockMask:
        num_table_blocks = torch.div(step.query_positions[:, -1], self.block_size,
                                     rounding_mode="floor") + 1
        return paged_block_mask(step.tables, num_table_blocks, step.query_positions,
                                self.kv_cache.pool.shape[2], self.block_size)

    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        rows = sent.get("query_rows")
        return FlexStep(self, step, self._block_mask(step),
                        None if rows is None else rows.view(step.tables.shape[0], host.max_q),
                        sent.get("token_index"))

    def graph_step(self, step: DeviceStep) -> StepAttention:
        return FlexStep(self, step, self._block_mask(step))
