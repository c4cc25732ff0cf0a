"""Attention in place on the paged pool and decode steps from static buffers: the CPU decode
kernel equals gathered attention (GQA, MLA's narrower values, bf16) and reads each context's K/V
rows exactly once (counted by the kernel), and the engine decodes with it like full recompute;
FlexAttention over a paged block mask equals gathered attention on ragged batches and on chunks
over cached context, and visits only each sequence's own blocks; the engine decodes greedily like
full recompute with it, with decode steps padded to batch-size buckets (the CUDA-graph path,
replayed eagerly on CPU), and with a compiled forward."""

import warnings

import pytest
import torch
from test_engine import GREEDY, PROMPTS, engine, naive_paged_attention, random_model, \
    reference_greedy

from tetrad.errors import ConfigError
from tetrad.inference.worker import cpu_kernels, triton_attention
from tetrad.inference.worker.attention import (flex_paged_attention, kernel_paged_decode,
                                               paged_block_mask, resolve_backend,
                                               sdpa_paged_attention, varlen_paged_attention)
from tetrad.inference.worker.attention import varlen as attention_module
from tetrad.inference.worker.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets
from tetrad.inference.worker.runner import StepPlan

# Eager FlexAttention (the dense reference form) warns that it is not compiled.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def ragged_batch(seed=0):
    """Three sequences with contexts of 23, 9 and 14 tokens whose last 5, 1 and 3 tokens are new
    (a chunk over cached context, a decode, another chunk), queries padded to 5."""
    torch.manual_seed(seed)
    num_blocks, block_size, kv_heads, heads, head_dim = 20, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    context, new = torch.tensor([23, 9, 14]), torch.tensor([5, 1, 3])
    used = -(-context // block_size)
    order = torch.randperm(num_blocks).tolist()  # disjoint tables, padded with block 19
    tables = torch.full((3, 6), 19)
    for row, first in enumerate(torch.cumsum(used, 0) - used):
        tables[row, :used[row]] = torch.tensor(order[first:first + used[row]])
    offsets = torch.arange(5).clamp(max=new[:, None] - 1)  # padded queries repeat the last
    positions = context[:, None] - new[:, None] + offsets
    q = torch.randn(3, 5, heads, head_dim)
    return q, k_cache, v_cache, tables, used, positions, new


@pytest.mark.parametrize("dtype,latent", [(torch.float32, False), (torch.float32, True),
                                          (torch.bfloat16, False)])
def test_the_cpu_kernel_equals_gathered_attention_reading_each_context_row_once(dtype, latent):
    """Ragged contexts (1 to 37 tokens) in shuffled blocks, tables padded with other sequences'
    blocks; GQA (3 query heads per KV head), or MLA's one latent head whose values are the first
    columns of its keys (a strided view of the pool). The call first writes each sequence's
    newest K/V row at its slot, as the engine's decode steps do."""
    torch.manual_seed(0)
    num_blocks, block_size, head_dim = 40, 8, 16
    kv_heads, heads = (1, 4) if latent else (2, 6)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = k_cache[..., :10] if latent else torch.randn_like(k_cache)
    context = torch.tensor([37, 1, 8, 9, 20])
    tables = torch.randperm(num_blocks)[:25].view(5, 5)  # every row 5 wide, padding included
    q = torch.randn(5, heads, head_dim).to(dtype)
    new_k = torch.randn(1, kv_heads, 5, head_dim).to(dtype)
    new_v = None if latent else torch.randn(1, kv_heads, 5, head_dim).to(dtype)
    last = context - 1
    slots = tables[torch.arange(5), last // block_size] * block_size + last % block_size
    k_written = k_cache.clone()
    v_written = k_written[..., :10] if latent else v_cache.clone()
    k_written.view(-1, kv_heads, head_dim)[slots] = new_k[0].transpose(0, 1)
    if not latent:
        v_written.view(-1, kv_heads, head_dim)[slots] = new_v[0].transpose(0, 1)
    expected = sdpa_paged_attention(q.unsqueeze(1), k_written, v_written, tables,
                                    last[:, None])[:, 0]
    rows_read = torch.zeros(1, dtype=torch.long)
    out = kernel_paged_decode(q.transpose(0, 1)[None], k_cache, v_cache, tables, context,
                              rows_read, (new_k, new_v, slots))[0].transpose(0, 1)
    assert torch.equal(k_cache, k_written) and torch.equal(v_cache, v_written)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, expected, **tolerance)
    # K and V, each context token once per KV head: no padding, no block read twice.
    assert rows_read.item() == 2 * kv_heads * int(context.sum())


def test_the_cpu_kernel_refuses_tables_that_leave_the_pool():
    cache, q = torch.randn(4, 2, 1, 8), torch.randn(1, 1, 1, 8)  # 4 blocks of 2 slots
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        kernel_paged_decode(q, cache, cache, torch.tensor([[7]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="context longer than its table"):
        kernel_paged_decode(q, cache, cache, torch.tensor([[1]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        kernel_paged_decode(q, cache, cache, torch.tensor([[1]]), torch.tensor([2]), None,
                            (torch.randn(1, 1, 1, 8), None, torch.tensor([8])))


def test_the_engine_decodes_with_the_cpu_kernel_like_full_recompute():
    model = random_model()
    prompts = PROMPTS[:3]
    expected = [reference_greedy(model, prompt, 6) for prompt in prompts]
    llm = engine(model, max_num_batched_tokens=7)  # decodes beside prefill chunks, then alone
    assert llm.runner.backend == "cpu"  # the CPU's auto
    assert [o.token_ids for o in llm.generate(prompts, GREEDY.replace(max_tokens=6))] == expected


def test_without_a_compiler_auto_gathers_and_cpu_stops(monkeypatch, tmp_path):
    monkeypatch.setenv("TETRAD_KERNEL_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    cpu_kernels.load_cpu_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="gathering attention"):
            assert resolve_backend("auto", torch.device("cpu"), 16) == "auto"
        with pytest.raises(ConfigError, match="--attention cpu: cannot run the C"):
            resolve_backend("cpu", torch.device("cpu"), 16)
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()


def test_flex_over_a_paged_block_mask_equals_gathered_attention_on_a_ragged_batch():
    q, k_cache, v_cache, tables, used, positions, new = ragged_batch()
    mask = paged_block_mask(tables, used, positions, k_cache.shape[0], k_cache.shape[1])
    out = flex_paged_attention(q, k_cache, v_cache, mask)
    expected = naive_paged_attention(q, k_cache, v_cache, tables, positions)
    for row, count in enumerate(new.tolist()):
        torch.testing.assert_close(out[row, :count], expected[row, :count])


def test_the_block_mask_lists_exactly_each_sequences_blocks():
    """What a compiled kernel reads: the blocks the mask lists, each sequence's table and no
    other, so the bytes attention reads per step are the K/V bytes of the contexts' blocks."""
    q, k_cache, v_cache, tables, used, positions, new = ragged_batch()
    mask = paged_block_mask(tables, used, positions, k_cache.shape[0], k_cache.shape[1])
    counts = mask.kv_num_blocks[:, 0, 0]
    assert counts.tolist() == used.tolist()
    for row, count in enumerate(counts.tolist()):
        assert mask.kv_indices[row, 0, 0, :count].tolist() == tables[row, :count].tolist()
    assert mask.full_kv_num_blocks is None  # the mask function bounds every visited block


def test_engine_with_flex_attention_decodes_like_full_recompute():
    model = random_model()
    prompts, greedy = PROMPTS[:3], GREEDY.replace(max_tokens=6)
    expected = [reference_greedy(model, prompt, 6) for prompt in prompts]
    # A small pool: eager FlexAttention (the dense reference form) scores every pool slot.
    llm = engine(model, attention="flex", max_num_batched_tokens=7, num_blocks=32)  # chunks
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    # Again: the prompts' blocks now come from the prefix cache (chunks over cached context).
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    assert llm.block_manager.num_prefix_hits > 0


def test_batch_size_buckets():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(3) == [1, 2, 3]
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 33, 64, 65)] == [1, 4, 8, 16, 48, 64,
                                                                           None]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_decode_steps_padded_to_buckets_equal_eager_steps(attention):
    model = random_model()
    prompts = PROMPTS[:3]
    expected = [reference_greedy(model, prompt, 5) for prompt in prompts]
    llm = engine(model, attention=attention, max_num_seqs=5, num_blocks=32)
    runner = llm.runner
    runner.graphs = DecodeGraphs(runner, 5, llm.max_model_len)
    runner.graphs.capture()  # no CUDA: records the forward over the static buffers
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda plan: used.append(len(plan.starts)) or run(plan)
    outputs = llm.generate(prompts, GREEDY.replace(max_tokens=5))
    assert [o.token_ids for o in outputs] == expected
    assert used and set(used) == {3}  # every decode step of 3 sequences, padded to bucket 4
    # Padding rows wrote only the pad block: the engine's own blocks were all freed.
    assert llm.block_manager.num_used_blocks == 0


def test_a_decode_plan_fits_a_bucket_only_when_every_sequence_computes_one_token():
    llm = engine(random_model(), max_num_seqs=4)
    graphs = DecodeGraphs(llm.runner, 4, llm.max_model_len)
    decode = StepPlan([1, 2], [5, 9], [1, 1], [1, 1], [[0, 1], [2, 3, 4]])
    assert graphs.fits(decode)
    assert not graphs.fits(StepPlan([1, 2, 3], [5, 0], [1, 2], [1, 1], [[0, 1], [2]]))
    assert not graphs.fits(StepPlan([1] * 5, [0] * 5, [1] * 5, [1] * 5, [[0]] * 5))


@pytest.mark.slow
def test_a_compiled_forward_decodes_like_eager():
    model = random_model()
    expected = [reference_greedy(model, prompt, 4) for prompt in PROMPTS[:2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = engine(model, compile=True)
        outputs = llm.generate(PROMPTS[:2], GREEDY.replace(max_tokens=4))
    assert [o.token_ids for o in outputs] == expected


def test_without_paged_flash_attention_a_gpu_gathers(monkeypatch):
    """The public varlen wrapper changed its arguments between torch releases (the GPU machines
    have torch 2.11, whose flash-attention op takes no block tables): the engine asks the op's
    schema. Where it reads no paged K/V, or the block size is not a multiple of 256, auto gathers
    with a warning (FlexAttention's GPU kernels refused the engine's pages on torch 2.11), and an
    explicit --attention varlen stops with one line."""
    assert attention_module.flash_takes_block_tables()  # torch 2.13, the pinned one
    cuda = torch.device("cuda")  # resolve_backend only reads the device's type
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: True)
    assert resolve_backend("auto", cuda, 16) == "triton"  # where triton runs, it reads in place
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: False)
    assert resolve_backend("auto", cuda, 256) == "varlen"
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert resolve_backend("auto", cuda, 16) == "auto"
    monkeypatch.setattr(attention_module, "flash_takes_block_tables", lambda: False)
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert resolve_backend("auto", cuda, 256) == "auto"
    with pytest.raises(ConfigError, match="takes no block tables"):
        resolve_backend("varlen", cuda, 256)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or not attention_module.flash_takes_block_tables(),
                    reason="flash-attention varlen needs CUDA and a torch whose op reads pages")
def test_varlen_reads_the_pool_in_place_like_gathered_attention():
    q, k_cache, v_cache, tables, used, positions, new = ragged_batch()
    device, dtype = torch.device("cuda"), torch.bfloat16
    block = 256  # flash-attention's paged K/V wants blocks of a multiple of 256 tokens
    k_big = torch.randn(20, block, *k_cache.shape[2:], device=device, dtype=dtype)
    v_big = torch.randn_like(k_big)
    context = positions[:, -1] + 1 + torch.tensor([300, 0, 600])
    q_rows = torch.cat([q[row, :count] for row, count in enumerate(new.tolist())])
    cu_q = torch.tensor([0, *torch.cumsum(new, 0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.cumsum(context, 0).tolist()], dtype=torch.int32,
                        device=device)
    out = varlen_paged_attention(q_rows.to(device, dtype), k_big, v_big,
                                 tables.int().to(device), cu_q, cu_k,
                                 context.int().to(device), int(new.max()), int(context.max()))
    query_positions = context[:, None] - new[:, None] + torch.arange(5).clamp(
        max=new[:, None] - 1)
    expected = naive_paged_attention(q.double(), k_big.cpu().double(), v_big.cpu().double(),
                                     tables, query_positions)
    expected = torch.cat([expected[row, :count] for row, count in enumerate(new.tolist())])
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=2e-2)


def test_a_decode_step_reads_one_device_value_back_the_sampled_ids(monkeypatch):
    """Host syncs, counted: ops that read a device value (item, nonzero, ...) and tolist calls,
    in a decode step of greedy, sampled, seeded and penalized rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero", "is_nonzero"):
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda tensor: reads.append("tolist") or tolist(tensor))
    llm = engine(random_model())
    for params in (GREEDY, GREEDY.replace(temperature=0.8, top_p=0.9, top_k=5),
                   GREEDY.replace(temperature=1.0, seed=3, repetition_penalty=1.2)):
        llm.add_request(PROMPTS[0], params)
    llm.step()  # prefill
    reads.clear()
    with Reads():
        llm.step()
    assert reads == ["tolist"]
