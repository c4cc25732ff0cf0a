"""The Triton paged-attention kernels equal gathered attention (sdpa_paged_attention) on ragged
batches: decodes, chunks with and without a cached prefix, a graph's padding rows (no keys: zeros,
nothing read); block sizes 16, 32 and 256; GQA groups 1, 4 and 8; head dims 64 and 80 / 96;
fp32 and fp16 (bf16 on a GPU); MLA's values narrower than its keys; shuffled block ids that reach
the pool's last block; split-KV decodes whose splits may get no keys. Every pool slot a kernel
must not read holds NaN, which any read would spread into its output.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
Triton reads the variable when triton.language and the kernels are defined, and again at launch:
this file sets it around both and restores it, so that the rest of the session does not run
under the interpreter. When triton was already imported without it (by another test file of the
session), its own functions are compiled-only, and the cases run in a fresh process instead.
On a GPU the same tests run the compiled kernels.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tetrad.errors import ConfigError
from tetrad.inference.worker.attention import sdpa_paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_FILE = Path(__file__).parents[1] / "tetrad/inference/worker/triton_attention.py"


def load_kernels(name="triton_attention_under_test"):
    """A copy of the kernel module, defined under the interpreter without a GPU; None when
    triton was already imported without the interpreter."""
    before = os.environ.get("TRITON_INTERPRET")
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        if DEVICE.type == "cpu" and not isinstance(tl.zeros, InterpretedFunction):
            return None
        spec = importlib.util.spec_from_file_location(name, KERNEL_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


kernels = load_kernels()
in_this_process = pytest.mark.skipif(
    kernels is None, reason="triton was imported without the interpreter: "
    "test_the_cases_run_in_a_fresh_interpreter_process runs them")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(kernels is not None, reason="the cases ran in this process")
def test_the_cases_run_in_a_fresh_interpreter_process():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1],
        env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              DEVICE.type != "cuda", reason="the interpreter's bf16 arithmetic is wrong"))]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def paged_batch(contexts, block_size, kv_heads, head_dim, dtype, value_dim=None, seed=0):
    """K/V pools holding each context in shuffled blocks taken from the end of the pool (its last
    block among them), tables padded with an unused block; unused blocks and slots past each
    context hold NaN. Returns the poisoned pools, the same pools with NaN replaced by 0 (for the
    reference, which reads every table entry), and int32 tables."""
    generator = torch.Generator().manual_seed(seed)
    used = [-(-context // block_size) for context in contexts]
    num_blocks = sum(used) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    latent = value_dim is not None
    v_cache = None if latent else torch.full_like(k_cache, float("nan"))
    blocks = (torch.randperm(sum(used), generator=generator) + 3).tolist()
    tables = torch.zeros(len(contexts), max(max(used), 1), dtype=torch.int32)  # pads: block 0
    for row, context in enumerate(contexts):
        mine, blocks = blocks[:used[row]], blocks[used[row]:]
        tables[row, :len(mine)] = torch.tensor(mine, dtype=torch.int32)
        for index, block in enumerate(mine):
            slots = min(block_size, context - index * block_size)
            for cache in (k_cache, v_cache) if not latent else (k_cache,):
                cache[block, :slots] = torch.randn(slots, kv_heads, head_dim, generator=generator)
    k_cache = k_cache.to(DEVICE, dtype)
    v_cache = k_cache[..., :value_dim] if latent else v_cache.to(DEVICE, dtype)
    clean = [torch.nan_to_num(cache, nan=0.0) for cache in (k_cache, v_cache)]
    return k_cache, v_cache, *clean, tables.to(DEVICE)


def reference(q, k_clean, v_clean, tables, contexts, query_lens):
    """Gathered attention, sequence by sequence, over the NaN-free pools, in fp32; zeros for
    sequences without keys (the kernels' answer for padding rows)."""
    rows, start = [], 0
    k32, v32 = k_clean.float(), v_clean.float()
    for row, (context, num_queries) in enumerate(zip(contexts, query_lens)):
        queries = q[start:start + num_queries].float()
        start += num_queries
        if context == 0:
            rows.append(queries.new_zeros(num_queries, q.shape[1], v_clean.shape[-1]))
            continue
        positions = torch.arange(context - num_queries, context, device=q.device)
        blocks = -(-context // k_clean.shape[1])
        table = tables[row:row + 1, :blocks].long()
        rows.append(sdpa_paged_attention(queries[None], k32, v32, table, positions[None])[0])
    return torch.cat(rows)


# (block size, GQA group, head dim, dtype): every block size, group and head dim appears.
SHAPES = [(16, 1, 64, torch.float32), (32, 4, 80, torch.float16), (256, 8, 64, torch.float32),
          (16, 8, 96, torch.float16)]


@in_this_process
@pytest.mark.parametrize("block_size,group,head_dim,dtype", SHAPES)
def test_one_kernel_attends_decodes_chunks_and_padding_rows_like_gathered_attention(
        block_size, group, head_dim, dtype):
    """One step as the engine runs it: a decode over 17 keys, a prefill chunk with no cached
    prefix (20 queries over 20 keys), a chunk of 7 over a cached prefix of 33, a decode of a
    1-key context, a sequence with no queries, and a padding row (one query, no keys)."""
    contexts, query_lens = [17, 20, 40, 1, 9, 0], [1, 20, 7, 1, 0, 1]
    kv_heads = 2
    k_cache, v_cache, k_clean, v_clean, tables = paged_batch(contexts, block_size, kv_heads,
                                                             head_dim, dtype)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim).to(DEVICE, dtype)
    cu_seq_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32)
    out = kernels.triton_paged_attention(q, k_cache, v_cache, tables, cu_seq_q.to(DEVICE),
                                         torch.tensor(contexts, dtype=torch.int32, device=DEVICE))
    expected = reference(q, k_clean, v_clean, tables, contexts, query_lens)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_decode_merges_to_gathered_attention_empty_splits_and_padding_rows_included(
        dtype, num_splits):
    """Contexts of 200 keys (4 splits of 64 keys, the last partly masked), 5 and 1 (splits that
    get no keys), 64 (one whole tile), and two padding rows of a graph bucket (no keys)."""
    contexts = [200, 5, 1, 64, 0, 0]
    block_size, kv_heads, group, head_dim = 16, 2, 4, 64
    k_cache, v_cache, k_clean, v_clean, tables = paged_batch(contexts, block_size, kv_heads,
                                                             head_dim, dtype)
    q = torch.randn(len(contexts), kv_heads * group, head_dim).to(DEVICE, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = kernels.triton_paged_decode(q, k_cache, v_cache, tables, lens, num_splits=num_splits)
    expected = reference(q, k_clean, v_clean, tables, contexts, [1] * len(contexts))
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@in_this_process
def test_mla_values_narrower_than_keys_are_read_in_place_by_both_kernels():
    """MLA's absorbed form: one KV head of width 80 whose first 48 columns are the values (a
    strided view of the key pool), 8 query heads."""
    contexts, query_lens = [30, 12, 3], [1, 5, 1]
    k_cache, v_cache, k_clean, v_clean, tables = paged_batch(contexts, 16, 1, 80, torch.float32,
                                                             value_dim=48)
    q = torch.randn(sum(query_lens), 8, 80, device=DEVICE)
    cu_seq_q = torch.tensor([0, 1, 6, 7], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = kernels.triton_paged_attention(q, k_cache, v_cache, tables, cu_seq_q, lens)
    expected = reference(q, k_clean, v_clean, tables, contexts, query_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    decodes = q[[0, 6]]
    out = kernels.triton_paged_decode(decodes, k_cache, v_cache, tables[[0, 2]], lens[[0, 2]],
                                      num_splits=2)
    torch.testing.assert_close(out, expected[[0, 6]], atol=1e-5, rtol=0)


@in_this_process
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_decode_replays_with_new_lengths_and_tables():
    """Grids depend only on shapes: a decode captured in a CUDA graph with one step's lengths
    and tables gives, replayed after they are overwritten in place, the next step's answer."""
    block_size, kv_heads, group, head_dim = 16, 2, 4, 64
    first, second = [40, 3, 0, 0], [41, 4, 90, 0]
    k_cache, v_cache, k_clean, v_clean, tables = paged_batch(second, block_size, kv_heads,
                                                             head_dim, torch.float16)
    q = torch.randn(4, kv_heads * group, head_dim, device=DEVICE, dtype=torch.float16)
    lens = torch.tensor(first, dtype=torch.int32, device=DEVICE)
    static_tables = torch.zeros_like(tables)
    scratch = kernels.split_scratch(4, kv_heads * group, 4, head_dim, DEVICE)
    out = torch.empty(4, kv_heads * group, head_dim, device=DEVICE, dtype=torch.float16)

    def step():
        kernels.triton_paged_decode(q, k_cache, v_cache, static_tables, lens, 4, scratch, out)

    step()  # compiles every kernel variant before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor(second, dtype=torch.int32))
    static_tables.copy_(tables)
    graph.replay()
    expected = reference(q, k_clean, v_clean, tables, second, [1] * 4)
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=0)


@in_this_process
def test_launchers_refuse_heads_that_do_not_share_kv_heads_evenly():
    k_cache, v_cache, _, _, tables = paged_batch([4], 16, 2, 64, torch.float32)
    q = torch.randn(1, 3, 64, device=DEVICE)
    with pytest.raises(ConfigError, match="3 query heads"):
        kernels.triton_paged_decode(q, k_cache, v_cache, tables,
                                    torch.tensor([4], dtype=torch.int32, device=DEVICE))


def test_the_module_imports_without_triton_and_says_the_kernels_cannot_run(monkeypatch):
    """The engine runs where triton is absent: the module still imports, reports itself
    unavailable, and a launch is one ConfigError."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "tetrad.models.triton_import")  # imported again without it
    spec = importlib.util.spec_from_file_location("triton_attention_without_triton", KERNEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.triton_available(torch.device("cpu"))
    with pytest.raises(ConfigError, match="--attention triton"):
        module.triton_paged_decode(torch.zeros(1, 2, 16), torch.zeros(1, 16, 2, 16),
                                   torch.zeros(1, 16, 2, 16), torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32))
