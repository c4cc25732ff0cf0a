"""The paged attention backends (tetrad.inference.worker.attention) against torch's own
scaled_dot_product_attention over each sequence's gathered contiguous K/V (causal, bottom-right
for a chunk over a cached prefix): plain multi-head, GQA and MLA's narrower values; tiles smaller
than a block; tables padded with one of the sequence's own blocks; and every branch of backend
choice. The CUDA-only kernel (varlen) runs in tests/test_paged_attention.py where CUDA is."""

import pytest
import torch
import torch.nn.functional as F

from tetrad.errors import ConfigError
from tetrad.inference.worker import attention, triton_attention
from tetrad.inference.worker.attention import varlen

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def sequences(heads, kv_heads, value_dim, pad_with_own_block, seed=0):
    """Contexts of 11, 3 and 8 tokens (blocks of 4) whose last 4, 1 and 2 tokens are queries,
    in shuffled blocks; each table padded to 4 entries with the sequence's own first block (a
    valid id, as the engine may pad) or with block 15, which no sequence holds."""
    torch.manual_seed(seed)
    head_dim, block_size, num_blocks = 8, 4, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)[..., :value_dim]
    context, new = [11, 3, 8], [4, 1, 2]
    order = torch.randperm(num_blocks - 1).tolist()
    tables, used, start = [], [], 0
    for length in context:
        count = -(-length // block_size)
        own = order[start:start + count]
        start += count
        tables.append(own + [own[0] if pad_with_own_block else 15] * (4 - count))
        used.append(count)
    positions = torch.tensor([[length - n + min(i, n - 1) for i in range(4)]
                              for length, n in zip(context, new)])
    q = torch.randn(3, 4, heads, head_dim)
    return (q, k_cache, v_cache, torch.tensor(tables), torch.tensor(used), positions, context,
            new)


def reference(q, k_cache, v_cache, tables, context, new):
    """SDPA per sequence on its contiguous keys: the last `new` of `context` tokens are queries."""
    rows = []
    for row, (length, count) in enumerate(zip(context, new)):
        k = k_cache[tables[row]].flatten(0, 1)[:length].transpose(0, 1)  # [kv_heads, keys, d]
        v = v_cache[tables[row]].flatten(0, 1)[:length].transpose(0, 1)
        queries = q[row, :count].transpose(0, 1)  # [heads, count, d]
        group = queries.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        mask = torch.ones(count, length, dtype=torch.bool).tril(length - count)  # bottom-right
        rows.append(F.scaled_dot_product_attention(queries, k, v, attn_mask=mask).transpose(0, 1))
    return rows


LAYOUTS = [(4, 4, 8), (6, 2, 8), (4, 1, 5)]  # multi-head, GQA, MLA-like narrower values


@pytest.mark.parametrize("heads,kv_heads,value_dim", LAYOUTS)
@pytest.mark.parametrize("pad_with_own_block", [False, True])
def test_every_gathering_and_flex_backend_equals_sdpa_on_contiguous_keys(
        heads, kv_heads, value_dim, pad_with_own_block):
    q, k_cache, v_cache, tables, used, positions, context, new = sequences(
        heads, kv_heads, value_dim, pad_with_own_block)
    expected = reference(q, k_cache, v_cache, tables, context, new)
    mask = attention.visible_keys(tables, positions, 4)
    block_mask = attention.paged_block_mask(tables, used, positions, k_cache.shape[0], 4)
    outputs = {
        "sdpa": attention.sdpa_paged_attention(q, k_cache, v_cache, tables, positions),
        "sdpa with its mask": attention.sdpa_paged_attention(q, k_cache, v_cache, tables,
                                                             positions, mask),
        "tiled, a block a tile": attention.tiled_paged_attention(q, k_cache, v_cache, tables,
                                                                 positions, 4),
        "tiled, tiles under a block": attention.tiled_paged_attention(q, k_cache, v_cache,
                                                                      tables, positions, 2),
        "tiled, 3 blocks a tile": attention.tiled_paged_attention(q, k_cache, v_cache, tables,
                                                                  positions, 12),
        "tiled, one tile": attention.tiled_paged_attention(q, k_cache, v_cache, tables,
                                                           positions),
        "flex": attention.flex_paged_attention(q, k_cache, v_cache, block_mask),
    }
    for name, out in outputs.items():
        assert out.shape == (3, 4, heads, value_dim), name
        for row, count in enumerate(new):
            torch.testing.assert_close(out[row, :count], expected[row], msg=name)


def test_visible_keys_is_each_querys_causal_prefix_over_the_whole_table():
    tables = torch.tensor([[3, 1, 0], [2, 2, 2]])
    positions = torch.tensor([[0, 5], [10, 11]])
    mask = attention.visible_keys(tables, positions, 4)
    assert mask.shape == (2, 1, 2, 12)
    for b in range(2):
        for i in range(2):
            assert mask[b, 0, i].tolist() == [key <= positions[b, i] for key in range(12)]


def test_a_bf16_tiled_result_keeps_the_query_dtype_and_matches_float32():
    q, k_cache, v_cache, tables, used, positions, context, new = sequences(6, 2, 8, False)
    out = attention.tiled_paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                                          tables, positions, 4)
    assert out.dtype == torch.bfloat16
    expected = reference(q, k_cache, v_cache, tables, context, new)
    for row, count in enumerate(new):
        torch.testing.assert_close(out[row, :count].float(), expected[row], atol=3e-2,
                                   rtol=3e-2)


def test_every_backend_choice_and_refusal(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only the device's type is read
    monkeypatch.setattr(varlen, "flash_takes_block_tables", lambda: True)
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: True)
    assert attention.resolve_backend("auto", cuda, 512) == "triton"  # asked before varlen
    assert attention.resolve_backend("auto", cuda, 256, latent=True) == "triton"
    assert attention.resolve_backend("auto", cpu, 256) == "cpu"  # the CPU's kernel first
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: False)
    for explicit in ("sdpa", "tiled", "flex"):
        assert attention.resolve_backend(explicit, cpu, 16) == explicit
        assert attention.resolve_backend(explicit, cuda, 16) == explicit
        assert attention.resolve_backend(explicit, cuda, 256, latent=True) == explicit
    assert attention.resolve_backend("varlen", cuda, 512) == "varlen"
    assert attention.resolve_backend("auto", cuda, 512) == "varlen"
    assert attention.resolve_backend("auto", cuda, 256, latent=True) == "auto"
    assert attention.resolve_backend("auto", cpu, 256) == "cpu"
    assert attention.resolve_backend("cpu", cpu, 16) == "cpu"
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert attention.resolve_backend("auto", cuda, 128) == "auto"
    with pytest.raises(ConfigError, match="latent cache"):
        attention.resolve_backend("varlen", cuda, 256, latent=True)
    for device, block_size in ((cpu, 256), (cuda, 16), (cuda, 128), (cuda, 384)):
        with pytest.raises(ConfigError, match="multiple of 256"):
            attention.resolve_backend("varlen", device, block_size)
    with pytest.raises(ConfigError, match="the CPU's decode kernel"):
        attention.resolve_backend("cpu", cuda, 16)
