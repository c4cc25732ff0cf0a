"""Paged attention in Triton: every step the engine runs reads K/V in place through block tables.

Two kernels and a merge, after vLLM's and SGLang's Triton backends:
- `triton_paged_attention`: every token of a step at once, decodes and prefill chunks over a
  cached prefix alike. q [tokens, heads, head_dim] holds the step's queries sequence after
  sequence (cu_seq_q [batch + 1] int32, their offsets: the varlen form the runner already sends);
  sequence b's queries are the last of its context_lens[b] keys (causal, bottom-right). A program
  takes up to BLOCK_Q query positions of one sequence times the query heads of one KV head (its
  rows), and walks that sequence's keys a tile at a time through block_tables[b]; the tile size
  is independent of the block size, and each row keeps an fp32 running max and sum.
- `triton_paged_decode`: one query per sequence, q [batch, heads, head_dim]. With few sequences
  the GPU would idle on one program per sequence and KV head, so the context is cut into
  `num_splits` ranges read by separate programs, whose partial outputs and log-sum-exps
  (`split_scratch`) a merge kernel combines. A split that gets no keys writes -inf and is ignored.

Grids depend only on tensor shapes and num_splits, never on lengths: context_lens and cu_seq_q are
read on the device, so a CUDA graph can capture a launch and replay it with new lengths. A row
whose sequence has no keys (a graph's padding rows: context length 0) gets zeros and reads
nothing. Keys past a sequence's length, including the last block's unused slots and padding
table entries, are never loaded.

K/V pools are [num_blocks, block_size, kv_heads, head_dim] with any strides but a contiguous last
dimension, so MLA's value pool (the latent: a view of the first columns of its cache entries) is
read in place: the kernels take keys and values of separate widths. Any block size works; head
dimensions need not be powers of two. On a CPU the kernels run under Triton's interpreter, when
TRITON_INTERPRET=1 was set before triton and this module were imported (the tests do): they then
compute in fp32, because the interpreter's bf16 arithmetic is wrong.
"""

from __future__ import annotations

import math

import torch

from tetrad.errors import ConfigError
from tetrad.models.triton_import import HAS_TRITON, tl, triton

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled into base 2 once


def triton_available(device: torch.device) -> bool:
    """Whether these kernels can run on `device`: triton imports and, on a GPU, a driver is active;
    on a CPU only when this module was defined for Triton's interpreter."""
    if not HAS_TRITON:
        return False
    if device.type == "cpu":
        return INTERPRETED
    try:
        return (device.type == "cuda" and not INTERPRETED
                and triton.runtime.driver.active is not None)
    except RuntimeError:  # no driver for this machine
        return False


@triton.jit
def _find_sequence(cu_seq_q, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    # Sequence b's query blocks start at program cu_seq_q[b] // BLOCK_Q + b: the grid has
    # tokens // BLOCK_Q + batch programs, enough for every sequence's cdiv(len, BLOCK_Q) blocks.
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        if tl.load(cu_seq_q + middle) // BLOCK_Q + middle <= q_block:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _attend_tile(acc, running_max, running_sum, q_tile, keys, key_ok, visible, table_row,
                 k_cache, v_cache, kv_head, stride_kb, stride_ks, stride_kh, stride_vb,
                 stride_vs, stride_vh, qk_scale, dim_k, dim_v, BLOCK_SIZE: tl.constexpr,
                 HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, COMPUTE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One tile of keys into the rows' online softmax: their running max and sum (base 2) and
    the unnormalized output."""
    blocks = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slots = keys % BLOCK_SIZE
    k_tile = tl.load(k_cache + blocks[None, :] * stride_kb + slots[None, :] * stride_ks
                     + kv_head * stride_kh + dim_k[:, None],
                     mask=key_ok[None, :] & (dim_k[:, None] < HEAD_K), other=0.0).to(COMPUTE)
    scores = tl.dot(q_tile, k_tile, input_precision=PRECISION) * qk_scale  # [rows, keys]
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    # A row that has seen no visible key keeps max -inf: shift by 0 so exp2 gives 0s, not NaNs.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(scores - shift[:, None])
    rescale = tl.exp2(running_max - shift)
    v_tile = tl.load(v_cache + blocks[:, None] * stride_vb + slots[:, None] * stride_vs
                     + kv_head * stride_vh + dim_v[None, :],
                     mask=key_ok[:, None] & (dim_v[None, :] < HEAD_V), other=0.0).to(COMPUTE)
    acc = acc * rescale[:, None] + tl.dot(probs.to(COMPUTE), v_tile, input_precision=PRECISION)
    return acc, new_max, running_sum * rescale + tl.sum(probs, 1)


@triton.jit
def _paged_attention_kernel(
        out, q, k_cache, v_cache, block_tables, cu_seq_q, context_lens, num_seqs, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_table,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_K: tl.constexpr,
        HEAD_K_PAD: tl.constexpr, HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr,
        COMPUTE: tl.constexpr, PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seq_q, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_seq_q + seq)
    q_len = tl.load(cu_seq_q + seq + 1) - q_start
    first_query = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first_query < q_len:
        context = tl.load(context_lens + seq)
        rows = tl.arange(0, BLOCK_M)
        query = first_query + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (query < q_len)
        position = context - q_len + query  # the queries are the context's last keys
        dim_k = tl.arange(0, HEAD_K_PAD)
        dim_v = tl.arange(0, HEAD_V_PAD)
        q_tile = tl.load(q + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh
                         + dim_k[None, :], mask=row_ok[:, None] & (dim_k[None, :] < HEAD_K),
                         other=0.0).to(COMPUTE)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_V_PAD], tl.float32)
        # Keys up to the block's last query position: later ones are masked for every row.
        num_keys = tl.maximum(tl.minimum(context, context - q_len + first_query + BLOCK_Q), 0)
        table_row = block_tables + seq.to(tl.int64) * stride_table
        for first_key in range(0, num_keys, TILE_N):
            keys = first_key + tl.arange(0, TILE_N)
            key_ok = keys < num_keys
            visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= position[:, None])
            acc, running_max, running_sum = _attend_tile(
                acc, running_max, running_sum, q_tile, keys, key_ok, visible, table_row,
                k_cache, v_cache, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, qk_scale, dim_k, dim_v, BLOCK_SIZE, HEAD_K, HEAD_V, COMPUTE, PRECISION)
        result = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh
                 + dim_v[None, :], result.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & (dim_v[None, :] < HEAD_V))


@triton.jit
def _paged_decode_kernel(
        out, lse, q, k_cache, v_cache, block_tables, context_lens, qk_scale,
        stride_qs, stride_qh, stride_os, stride_oh, stride_osplit, stride_ls, stride_lh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_K: tl.constexpr, HEAD_K_PAD: tl.constexpr,
        HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
        COMPUTE: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens + seq)
    # Whole tiles per split, so that only the last split's last tile is partly masked.
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), TILE_N) * TILE_N
    first = split * per_split
    last = tl.minimum(first + per_split, context)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_k = tl.arange(0, HEAD_K_PAD)
    dim_v = tl.arange(0, HEAD_V_PAD)
    q_tile = tl.load(q + seq * stride_qs + head[:, None] * stride_qh + dim_k[None, :],
                     mask=row_ok[:, None] & (dim_k[None, :] < HEAD_K), other=0.0).to(COMPUTE)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_V_PAD], tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_table
    for first_key in range(first, last, TILE_N):
        keys = first_key + tl.arange(0, TILE_N)
        key_ok = keys < last
        acc, running_max, running_sum = _attend_tile(
            acc, running_max, running_sum, q_tile, keys, key_ok,
            row_ok[:, None] & key_ok[None, :], table_row, k_cache, v_cache, kv_head, stride_kb,
            stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, dim_k, dim_v,
            BLOCK_SIZE, HEAD_K, HEAD_V, COMPUTE, PRECISION)
    result = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(out + seq * stride_os + head[:, None] * stride_oh + split * stride_osplit
             + dim_v[None, :], result.to(out.dtype.element_ty),
             mask=row_ok[:, None] & (dim_v[None, :] < HEAD_V))
    if NUM_SPLITS > 1:
        log_sum = tl.where(running_sum == 0.0, float("-inf"),
                           running_max + tl.log2(tl.where(running_sum == 0.0, 1.0, running_sum)))
        tl.store(lse + seq * stride_ls + head * stride_lh + split, log_sum, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out, partial, lse, stride_os, stride_oh, stride_ps, stride_ph,
                         stride_psplit, stride_ls, stride_lh, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, HEAD_V: tl.constexpr,
                         HEAD_V_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dim_v = tl.arange(0, HEAD_V_PAD)
    log_sums = tl.load(lse + seq * stride_ls + head * stride_lh + splits, mask=split_ok,
                       other=float("-inf"))
    top = tl.max(log_sums, 0)
    weights = tl.exp2(log_sums - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty splits
    parts = tl.load(partial + seq * stride_ps + head * stride_ph + splits[:, None] * stride_psplit
                    + dim_v[None, :], mask=split_ok[:, None] & (dim_v[None, :] < HEAD_V),
                    other=0.0)
    total = tl.sum(weights, 0)
    result = tl.sum(weights[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out + seq * stride_os + head * stride_oh + dim_v, result.to(out.dtype.element_ty),
             mask=dim_v < HEAD_V)


# Whether the kernels above and triton's own functions were defined for the interpreter (the
# decorators read TRITON_INTERPRET when they run): both must be, for CPU tensors.
INTERPRETED = all(type(function).__name__ == "InterpretedFunction"
                  for function in (_paged_attention_kernel, getattr(tl, "zeros", None)))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not triton_available(q.device):
        raise ConfigError(f"--attention triton: Triton kernels cannot run on {q.device} here "
                          "(no triton, or no GPU driver); use --attention auto")
    if q.shape[1] % k_cache.shape[2]:
        raise ConfigError(f"{q.shape[1]} query heads do not share {k_cache.shape[2]} KV heads")
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "rows must be contiguous"


def _launch_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """Constexprs the kernels share: padded head widths, and the compute dtype (the cache's on a
    GPU, fp32 in the interpreter and for fp32 caches, whose dots stay in IEEE fp32)."""
    on_gpu = q.device.type == "cuda"
    compute = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(k_cache.dtype)
    compute = compute if on_gpu and compute is not None else tl.float32
    return dict(BLOCK_SIZE=k_cache.shape[1], HEAD_K=q.shape[-1],
                HEAD_K_PAD=max(16, triton.next_power_of_2(q.shape[-1])), HEAD_V=v_cache.shape[-1],
                HEAD_V_PAD=max(16, triton.next_power_of_2(v_cache.shape[-1])), COMPUTE=compute,
                PRECISION="ieee" if compute == tl.float32 else "tf32")


def _tile_keys(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32  # wider heads: a smaller tile keeps K and V in registers


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seq_q: torch.Tensor,
                           context_lens: torch.Tensor, out: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """q [tokens, heads, head_dim], sequence after sequence (cu_seq_q [batch + 1] int32 their
    offsets); sequence b's queries are the last of its context_lens[b] (int32) keys, read through
    block_tables[b] (int32 [batch, width]) from k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim]. Returns (or fills `out`) [tokens, heads, v_cache's head_dim]."""
    _check(q, k_cache, v_cache)
    tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // k_cache.shape[2]
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    if out is None:
        out = q.new_empty(tokens, num_heads, v_cache.shape[-1])
    grid = (tokens // block_q + num_seqs, k_cache.shape[2])
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_seq_q, context_lens, num_seqs,
        head_dim ** -0.5 * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=_tile_keys(head_dim),
        **_launch_shapes(q, k_cache, v_cache))
    return out


def decode_splits(batch: int, kv_heads: int, head_dim: int, max_context: int,
                  multiprocessors: int) -> int:
    """How many ranges to cut each context into so that a decode step keeps every
    multiprocessor busy (about two programs each), no range shorter than one tile of keys."""
    wanted = math.ceil(2 * multiprocessors / (batch * kv_heads))
    return max(1, min(wanted, math.ceil(max_context / _tile_keys(head_dim)), 32))


def split_scratch(batch: int, num_heads: int, num_splits: int, value_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split decode's fp32 partial outputs [batch, heads, splits, value_dim] and their
    base-2 log-sum-exps [batch, heads, splits]: made once per graph bucket, refilled each step."""
    return (torch.empty(batch, num_heads, num_splits, value_dim, device=device),
            torch.empty(batch, num_heads, num_splits, device=device))


def triton_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        num_splits: int = 1,
                        scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [batch, heads, head_dim] over keys 0..context_lens[b] - 1 of
    sequence b (the query's own key included), through block_tables (int32 [batch, width]).
    num_splits > 1 reads each context in that many ranges (decode_splits) into `scratch`
    (split_scratch; made here when not given) and merges them. Returns (or fills `out`)
    [batch, heads, v_cache's head_dim]."""
    _check(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    value_dim = v_cache.shape[-1]
    group = num_heads // k_cache.shape[2]
    if out is None:
        out = q.new_empty(batch, num_heads, value_dim)
    if num_splits > 1:
        partial, lse = scratch or split_scratch(batch, num_heads, num_splits, value_dim, q.device)
        target, lse_strides = partial, lse.stride()[:2]
    else:  # one range: the kernel's normalized output is the answer
        target, lse, lse_strides = out.unsqueeze(2), out, (0, 0)
    _paged_decode_kernel[(batch, k_cache.shape[2], num_splits)](
        target, lse, q, k_cache, v_cache, block_tables, context_lens, head_dim ** -0.5 * LOG2E,
        q.stride(0), q.stride(1), *target.stride()[:3], *lse_strides, *k_cache.stride()[:3],
        *v_cache.stride()[:3], block_tables.stride(0), GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=_tile_keys(head_dim),
        NUM_SPLITS=num_splits, **_launch_shapes(q, k_cache, v_cache))
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            out, partial, lse, out.stride(0), out.stride(1), *partial.stride()[:3],
            *lse.stride()[:2], NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_V=value_dim,
            HEAD_V_PAD=max(16, triton.next_power_of_2(value_dim)))
    return out
