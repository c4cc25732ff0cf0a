"""The serving engine runs DeepSeek-V3 (MLA) models: its paged pool holds the latent plus the rope
key per token and layer (the planner's kv_bytes_per_token, counted on the pool), decode uses the
absorbed form over it, and greedy output equals HF generate() token for token in fp32."""

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

transformers = pytest.importorskip("transformers")
from deepseek_models import hf_model  # noqa: E402
from test_engine import GREEDY, PROMPTS, hf_greedy  # noqa: E402

from tetrad.inference.worker import triton_attention  # noqa: E402
from tetrad.inference.worker.attention import (resolve_backend, sdpa_paged_attention,  # noqa: E402
                                               tiled_paged_attention)
from tetrad.inference.engine import LLM  # noqa: E402
from tetrad.errors import ConfigError  # noqa: E402
from tetrad.planner.memory import kv_bytes_per_token  # noqa: E402


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    """A tiny random deepseek_v3 (low-rank q, groups, yarn), saved; its HF model for reference."""
    model = hf_model("v3")
    folder = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(folder)
    return folder, model


def test_greedy_equals_hf_generate(deepseek_folder):
    folder, hf_model = deepseek_folder
    expected = hf_greedy(hf_model, PROMPTS)
    for config in (dict(), dict(enable_prefix_caching=False), dict(max_num_batched_tokens=7),
                   dict(num_blocks=12, max_num_batched_tokens=16),
                   dict(num_blocks=12, preemption="swap", attention="tiled"),
                   dict(attention="flex", num_blocks=40)):  # in place: the GPU's path
        llm = LLM(folder, log=None, block_size=4, **config)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected, config
        assert llm.block_manager.num_used_blocks == 0


def test_the_pool_holds_the_latent_and_rope_key_the_planner_counts(deepseek_folder):
    llm = LLM(deepseek_folder[0], log=None, block_size=4, kv_memory="64KiB")
    config, cache = llm.model_config, llm.runner.kv_cache
    one_block = cache.pool[:, :, 0]  # every layer's entries of one block
    per_token = one_block.numel() * one_block.element_size() // llm.kv_plan.block_size
    assert per_token == kv_bytes_per_token(config, 4) == 3 * (12 + 8) * 4
    assert llm.kv_plan.bytes_per_token == per_token
    # What an expanded cache would hold instead: a key and a value per head.
    assert per_token < 3 * 4 * (6 + 8 + 10) * 4


def test_the_attention_kernel_that_cannot_read_the_latent_cache_is_refused(monkeypatch):
    cuda = torch.device("cuda")  # resolve_backend only reads the device's type
    with pytest.raises(ConfigError, match="cannot read an MLA model's latent cache"):
        resolve_backend("varlen", cuda, 256, latent=True)
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: True)
    assert resolve_backend("auto", cuda, 256, latent=True) == "triton"  # reads it in place
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: False)
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert resolve_backend("auto", cuda, 256, latent=True) == "auto"


def test_paged_kernels_take_values_narrower_than_keys():
    """MLA's values are the first columns of its keys (the latent): both kernels read them
    through that view and agree with attention over the gathered context."""
    torch.manual_seed(0)
    cache = torch.randn(10, 4, 1, 20)  # [blocks, block size, one shared head, latent 12 + rope 8]
    values = cache[..., :12]
    tables = torch.tensor([[3, 7, 1], [0, 9, 2]])
    positions = torch.tensor([[9], [5]])
    q = torch.randn(2, 1, 4, 20)
    k, v = cache[tables].flatten(1, 2)[:, :, 0], values[tables].flatten(1, 2)[:, :, 0]
    scores = torch.einsum("bqhd,bkd->bhqk", q, k) / 20 ** 0.5
    visible = torch.arange(k.shape[1]) <= positions.unsqueeze(-1)
    expected = torch.einsum("bhqk,bkd->bqhd",
                            scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1), v)
    torch.testing.assert_close(tiled_paged_attention(q, cache, values, tables, positions, 4),
                               expected)
    torch.testing.assert_close(sdpa_paged_attention(q, cache, values, tables, positions),
                               expected)
