"""HF configs of the families the planner reads beyond those tetrad loads (issue 32, item 2):
deepseek_v2, gpt_bigcode and gemma, checked against their publishers' parameter counts, and
every family the serving engine loads."""

from __future__ import annotations

import pytest

from tetrad.errors import ConfigError
from tetrad.planner.model_stats import count_parameters
from tetrad.spec.hf import SUPPORTED, model_config_from_hf

# google/gemma-7b's config.json; the Gemma report (Team Gemma 2024, table 2) counts
# 786,432,000 embedding and 7,751,248,896 non-embedding parameters.
GEMMA_7B = dict(model_type="gemma", vocab_size=256000, hidden_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                intermediate_size=24576, max_position_embeddings=8192, hidden_act="gelu",
                rms_norm_eps=1e-6, rope_theta=10000.0)
# bigcode/starcoder's config.json: 15.5B parameters (Li et al. 2023, StarCoder), one KV head.
STARCODER = dict(model_type="gpt_bigcode", vocab_size=49152, n_embd=6144, n_layer=40, n_head=48,
                 n_inner=24576, n_positions=8192, multi_query=True,
                 activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5)
# deepseek-ai/DeepSeek-V2-Lite's config.json: 15.7B parameters (its model card).
V2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
               n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
               q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
               aux_loss_alpha=0.001, max_position_embeddings=163840, rope_theta=10000,
               rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))


def test_gemma_counts_its_reports_parameters_exactly():
    config = model_config_from_hf(GEMMA_7B, "gemma-7b")
    assert config.tie_embeddings and config.head_dim == 256 and config.q_size == 4096
    assert count_parameters(config) == 786_432_000 + 7_751_248_896


def test_gpt_bigcode_is_gpt2_with_one_kv_head():
    config = model_config_from_hf(STARCODER, "starcoder")
    assert (config.num_kv_heads, config.position, config.norm) == (1, "learned", "layernorm")
    assert count_parameters(config) == pytest.approx(15.5e9, rel=0.005)
    multi_head = model_config_from_hf({**STARCODER, "multi_query": False})
    assert multi_head.num_kv_heads == multi_head.num_heads
    assert count_parameters(multi_head) > count_parameters(config)


def test_deepseek_v2_is_mla_with_softmax_routing_and_an_aux_loss():
    config = model_config_from_hf(V2_LITE, "v2-lite")
    assert (config.attention, config.router_score, config.router_bias_update_rate) == (
        "mla", "softmax", 0.0)
    assert config.router_aux_loss_coef == 0.001 and not config.norm_topk_prob
    assert config.rope_scaling == "yarn" and config.rope_original_max_seq_len == 4096
    assert count_parameters(config) == pytest.approx(15.7e9, rel=0.005)
    grouped = model_config_from_hf({**V2_LITE, "topk_method": "group_limited_greedy",
                                    "n_group": 8, "topk_group": 3})
    assert (grouped.num_expert_groups, grouped.topk_expert_groups) == (8, 3)
    with pytest.raises(ConfigError, match="topk_method must be a string"):
        model_config_from_hf({**V2_LITE, "topk_method": 3})


def test_every_family_the_engine_loads_is_read_by_the_planner():
    from tetrad.models.hf import RUNTIME_TYPES

    assert set(RUNTIME_TYPES) <= set(SUPPORTED)
    assert {"deepseek_v2", "gpt_bigcode", "gemma"} <= set(SUPPORTED)


def test_the_new_families_are_not_loaded_as_weights():
    from tetrad.models.hf import check_runtime_support

    for hf in (GEMMA_7B, STARCODER, V2_LITE):
        with pytest.raises(ConfigError, match="cannot load HF model_type"):
            check_runtime_support(hf)
