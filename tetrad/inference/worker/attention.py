"""Attention of new query tokens over K/V that live in the paged cache, read through block tables.

Reading in place (what serving on a GPU uses; no copy of any context is made):
- `varlen_paged_attention`: torch's flash-attention varlen kernel (CUDA only) over every token of
  the step at once, the K/V pool passed as pages with the block tables (block size a multiple of
  256: flash-attention's rule for paged K/V), as vLLM and nano-vllm call it;
- `flex_paged_attention`: FlexAttention with a block mask that lists each sequence's physical
  blocks (`paged_block_mask`, built once per step), so the kernel visits only those blocks of the
  pool. Compiled (torch.compile; a Triton kernel on GPU, C++ on CPU) it reads in place; run eagerly
  torch evaluates it densely over the whole pool, which only tests use.

- `kernel_paged_decode`: the CPU's decode attention, a C++ kernel (paged_decode.cpp, built on
  first use by cpu_kernels.py) that walks each sequence's block table and reads every K and V
  row of its context once, straight from the pool, with a running max and sum per head.

Gathering (the CPU path for prefill chunks over a cached context, and the reference the tests
hold the others to):
- `sdpa_paged_attention` gathers each sequence's K/V into one contiguous tensor and calls torch's
  fused scaled_dot_product_attention with a mask;
- `tiled_paged_attention` is the flash-attention algorithm written in torch: it walks the block
  table a tile of blocks at a time, keeping a running max and log-sum-exp per query, so neither
  the [queries, context] score matrix nor a contiguous copy of the whole context is built.

`resolve_backend` picks among them for a device (the engine's --attention).

Shapes of the batched functions: q [batch, queries, heads, head_dim]; k_cache, v_cache
[num_blocks, block_size, kv_heads, head_dim]; block_tables [batch, max_blocks], as wide as the
longest context (the caller sizes it once per step, so nothing here waits on the device) and
padded with any valid block id; query_positions [batch, queries]: a query attends to keys at
positions <= its own, which also bounds it to its own context (padded queries repeat a real
position). Returns [batch, queries, heads, v_cache's head_dim]: MLA's values (the latent, a view
of the first columns of its cache entries) are narrower than its keys.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tetrad.errors import ConfigError
from tetrad.inference.worker.cpu_kernels import KernelUnavailable, load_cpu_kernels

VARLEN_BLOCK_MULTIPLE = 256  # flash-attention's rule for paged K/V: blocks of a multiple of it


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
    k = k_cache[block_tables].flatten(1, 2)  # [batch, max_blocks * block_size, kv_heads, head_dim]
    v = v_cache[block_tables].flatten(1, 2)
    if mask is None:
        mask = visible_keys(block_tables, query_positions, k_cache.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
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



def kernel_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        rows_read: torch.Tensor | None = None,
                        new: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """One query per sequence, on a CPU, in the model's layout: q [1, heads, seqs, head_dim] over
    keys 0..context_lens[b] - 1 of sequence b (int64 block_tables and context_lens) -> [1, heads,
    seqs, v's head_dim]. `new`: (k, v, slots), the step's keys and values [1, kv_heads, seqs,
    head_dim] (v None for MLA, whose values live in its keys), written at `slots` first, in the
    same call. `rows_read` (int64 [1]), when given, gains the K and V rows the kernel read (one
    per token and KV head each): what tests and the benchmark count. Raises KernelUnavailable
    where the kernel cannot be built."""
    load_cpu_kernels()  # built or loaded once per process; a cached no-op after that
    new_k, new_v, slots = new or (None, None, None)
    return torch.ops.tetrad.paged_decode(q, k_cache, v_cache, block_tables, context_lens,
                                         q.shape[-1] ** -0.5, new_k, new_v, slots, rows_read)


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


def resolve_backend(attention: str, device: torch.device, block_size: int,
                    latent: bool = False) -> str:
    """"auto" on a GPU: flash-attention's varlen kernel when the block size suits it (a multiple
    of 256) and this torch's kernel reads paged K/V, the gathering kernels otherwise; on a CPU
    the C++ decode kernel ("cpu"), or where it cannot be built (no C++ compiler) the gathering
    kernels (sdpa or tiled by size).
    `latent`: MLA's cache, whose values are narrower than its keys, which flash-attention's
    kernel does not take."""
    if attention == "varlen" and latent:
        raise ConfigError("--attention varlen cannot read an MLA model's latent cache "
                          "(flash-attention needs keys and values of one width): use --attention "
                          "flex or auto")
    if attention == "varlen" and (device.type != "cuda" or block_size % VARLEN_BLOCK_MULTIPLE):
        raise ConfigError(f"--attention varlen needs a GPU and a --block-size that is a multiple "
                          f"of {VARLEN_BLOCK_MULTIPLE} (flash-attention's paged K/V rule)")
    if attention == "varlen" and not flash_takes_block_tables():
        raise ConfigError(f"--attention varlen: torch {torch.__version__}'s flash-attention takes "
                          "no block tables; use --attention flex or auto")
    if attention == "cpu" and device.type != "cpu":
        raise ConfigError("--attention cpu is the CPU's decode kernel: on a GPU use --attention "
                          "auto, flex or varlen")
    if attention in ("auto", "cpu") and device.type == "cpu":
        try:
            load_cpu_kernels()
        except KernelUnavailable as error:
            if attention == "cpu":
                raise ConfigError(f"--attention cpu: {error}") from None
            warnings.warn(f"gathering attention on the CPU: {error}", stacklevel=2)
            return "auto"
        return "cpu"
    if attention != "auto":
        return attention
    if latent:  # flash-attention takes keys and values of one width only
        return "auto"
    if block_size % VARLEN_BLOCK_MULTIPLE == 0 and flash_takes_block_tables():
        return "varlen"
    # FlexAttention's GPU kernels refused the engine's pages and prefill chunks on an H100 with
    # torch 2.11 (16-token pages: no kernel config for decode; Q blocks of a chunk's length, such
    # as 300, not a multiple of its tiles), so auto gathers: slower (a copy of each context per
    # step, no CUDA graphs) but correct. --attention flex stays for those who try it.
    warnings.warn("gathering attention on the GPU: paged flash-attention needs --block-size 256 "
                  "and a torch whose flash-attention op takes block tables (2.13)", stacklevel=2)
    return "auto"
