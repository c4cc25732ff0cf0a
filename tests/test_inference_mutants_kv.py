"""The KV cache's sizes and layout (tetrad.inference.worker.kv_cache) against hand-counted bytes and
slots: every memory unit, the tokenizer-fit boundary, a tensor-parallel rank's and a pipeline
stage's pool, and where each write, block copy and swap lands in the pool."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.inference.worker import kv_cache
from tetrad.inference.worker.kv_cache import KVCache, KVPlan
from tetrad.spec.presets import resolve_model


@pytest.mark.parametrize("text,expected", [
    ("7", 7), ("5b", 5), ("3k", 3_000), ("2KB", 2_000), ("4m", 4_000_000), ("1MB", 1_000_000),
    ("2g", 2_000_000_000), ("3GB", 3_000_000_000), ("1KiB", 1024), (" 1.5 kib ", 1536),
    ("2MiB", 2 * 1024 * 1024), ("1GiB", 1024 ** 3), ("1e3", 1000), ("2.5e2KB", 250_000)])
def test_every_memory_unit_is_read_as_its_bytes(text, expected):
    assert kv_cache.parse_bytes(text) == expected
    assert kv_cache.parse_bytes(expected) == expected


def test_a_tokenizer_fits_until_the_model_vocabulary_is_twice_as_large():
    tokenizer = SimpleNamespace(vocab_size=256)
    kv_cache.check_tokenizer_fits(tokenizer, 511)  # rounded up past the tokenizer: fine
    with pytest.raises(ConfigError, match="only 256"):
        kv_cache.check_tokenizer_fits(tokenizer, 512)
    kv_cache.check_tokenizer_fits(object(), 4096)  # no vocab_size: nothing to compare


def test_auto_dtype_is_the_models_and_an_unsupported_one_is_refused():
    assert kv_cache.resolve_dtype("fp16", nn.Linear(2, 2)) == "fp16"
    assert kv_cache.resolve_dtype("auto", nn.Linear(2, 2).to(torch.bfloat16)) == "bf16"
    assert kv_cache.resolve_dtype("auto", nn.Linear(2, 2)) == "fp32"
    with pytest.raises(ConfigError, match="float64"):
        kv_cache.resolve_dtype("auto", nn.Linear(2, 2).double())


@pytest.mark.parametrize("dtype,element_bytes", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_a_token_costs_its_layers_heads_and_element_bytes(dtype, element_bytes):
    config = resolve_model("tiny")
    plan = kv_cache.plan_kv_pool(config, dtype, torch.device("cpu"), 4, 2**16, 0, 64)
    assert plan.bytes_per_token == (config.num_layers * 2 * config.num_kv_heads
                                    * config.head_dim * element_bytes)
    assert kv_cache.TORCH_DTYPES[dtype].itemsize == element_bytes


def test_a_tensor_parallel_stage_pool_counts_its_own_heads_and_layers():
    config = resolve_model("tiny")  # 2 layers, 2 KV heads of 16
    layers, kv_heads, head_dim = config.num_layers, config.num_kv_heads, config.head_dim
    whole = kv_cache.plan_kv_pool(config, "bf16", torch.device("cpu"), 8, 2**20, 2**16, 64)
    per_token = layers * 2 * kv_heads * head_dim * 2  # K and V, bf16
    assert whole.bytes_per_token == per_token and whole.num_layers == layers
    assert whole.num_blocks == 2**20 // (per_token * 8)
    assert whole.num_cpu_blocks == 2**16 // (per_token * 8)
    # TP 2: one KV head per rank; a one-layer pipeline stage.
    stage = kv_cache.plan_kv_pool(config, "bf16", torch.device("cpu"), 8, 2**20, 0, 64, tp=2,
                                  num_layers=1)
    assert stage.bytes_per_token == 1 * 2 * (kv_heads // 2) * head_dim * 2
    assert stage.num_blocks == 2**20 // (stage.bytes_per_token * 8) and stage.num_cpu_blocks == 0
    assert stage.num_layers == 1 and "per rank on each of 2" in stage.describe()
    assert "per rank" not in whole.describe()
    cache = KVCache(config, stage, torch.float32, torch.device("cpu"))
    assert cache.pool.shape == (1, 2, stage.num_blocks + 1, 8, kv_heads // 2, head_dim)
    # Exactly one block of budget: it fits; one byte less: nothing fits.
    one_block = per_token * 8
    assert kv_cache.plan_kv_pool(config, "bf16", torch.device("cpu"), 8, one_block, 0,
                                 64).num_blocks == 1
    with pytest.raises(ConfigError, match="raise --kv-memory"):
        kv_cache.plan_kv_pool(config, "bf16", torch.device("cpu"), 8, one_block - 1, 0, 64)


def test_writes_copies_and_swaps_land_in_the_right_slots_of_every_layer():
    config = resolve_model("tiny")
    plan = KVPlan(num_blocks=5, block_size=4, bytes_per_token=0, num_cpu_blocks=3,
                  max_model_len=16)
    cache = KVCache(config, plan, torch.float32, torch.device("cpu"))
    heads, width = config.num_kv_heads, config.head_dim
    assert cache.pool.shape == (config.num_layers, 2, 6, 4, heads, width)
    assert cache.pad_block == 5 and cache.cpu_pool.shape[2] == 3
    slots = torch.tensor([0, 5, 13])  # block 0 slot 0, block 1 slot 1, block 3 slot 1
    for layer in range(config.num_layers):
        k, v = torch.randn(3, heads, width), torch.randn(3, heads, width)
        cache.write(layer, slots, k, v)
        for row, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, 4)
            assert torch.equal(cache.pool[layer, 0, block, offset], k[row])
            assert torch.equal(cache.pool[layer, 1, block, offset], v[row])
        assert cache.layer(layer)[0].data_ptr() == cache.pool[layer, 0].data_ptr()
    before = cache.pool.clone()
    cache.copy_blocks([(1, 4), (3, 2)])
    assert torch.equal(cache.pool[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.pool[:, :, 2], before[:, :, 3])
    assert torch.equal(cache.pool[:, :, [0, 1, 3]], before[:, :, [0, 1, 3]])
    cache.swap_out([(1, 2), (3, 0)])
    assert torch.equal(cache.cpu_pool[:, :, 2], before[:, :, 1])
    assert torch.equal(cache.cpu_pool[:, :, 0], before[:, :, 3])
    cache.pool.zero_()
    cache.swap_in([(0, 4), (2, 0)])
    assert torch.equal(cache.pool[:, :, 4], before[:, :, 3])
    assert torch.equal(cache.pool[:, :, 0], before[:, :, 1])
    assert not cache.pool[:, :, [1, 2, 3, 5]].any()


def test_an_mla_pool_stores_one_entry_whose_first_columns_are_the_value():
    config = SimpleNamespace(attention="mla", kv_lora_rank=6, qk_rope_head_dim=2, num_layers=2,
                             num_kv_heads=4, head_dim=16)
    plan = KVPlan(num_blocks=3, block_size=2, bytes_per_token=0, num_cpu_blocks=0,
                  max_model_len=6)
    cache = KVCache(config, plan, torch.float32, torch.device("cpu"))
    assert cache.pool.shape == (2, 1, 4, 2, 1, 8) and cache.latent
    entry = torch.randn(1, 1, 8)
    cache.write(1, torch.tensor([3]), entry, torch.full((1, 1, 6), 99.0))
    k, v = cache.layer(1)
    assert torch.equal(k[1, 1], entry[0]) and torch.equal(v[1, 1], entry[0, :, :6])
    assert not cache.pool[0].any()  # the other layer is untouched
