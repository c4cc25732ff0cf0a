"""Parameter and FLOP counts of the planner, checked against published totals and by independent
arithmetic."""

from __future__ import annotations

import pytest

from tetrad.spec.model import ModelConfig
from tetrad.planner.flops import six_n_d, training_flops, training_flops_per_sequence
from tetrad.planner.model_stats import active_parameters, count_parameters, parameter_breakdown
from tetrad.spec.presets import preset

# Hugging Face model cards / safetensors metadata (total parameters). DeepSeek-V3's 671,026,419,200
# includes 256 router score-correction biases in each of its 58 MoE layers (tetrad's router.bias);
# its multi-token-prediction module is not part of the served model.
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704, "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
    "deepseek-v3": 671_026_419_200, "deepseek-r1": 671_026_419_200,
    "opt-13b": 12_853_473_280,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    assert count_parameters(preset(name)) == PUBLISHED[name]


def test_gpt3_parameters_and_breakdown_sum():
    config = preset("gpt3-175b")
    h, layers = 12288, 96
    per_layer = 12 * h * h + 13 * h  # QKV, out, two MLP matrices; their biases; two LayerNorms
    expected = layers * per_layer + 50257 * h + 2048 * h + 2 * h
    assert count_parameters(config) == expected
    assert sum(parameter_breakdown(config).values()) == expected


def test_active_parameters_of_moe_models():
    # Mixtral: "12.9B active" (Mistral AI); DeepSeek-V3: "37B activated" (technical report).
    assert active_parameters(preset("mixtral-8x7b")) / 1e9 == pytest.approx(12.88, abs=0.01)
    assert active_parameters(preset("deepseek-v3")) / 1e9 == pytest.approx(37.5, abs=0.1)


def test_gpt3_training_flops_published():
    # Brown et al. 2020, table D.1: GPT-3 175B trained on 300B tokens took 3.14e23 FLOPs.
    assert six_n_d(preset("gpt3-175b"), 300e9) == pytest.approx(3.14e23, rel=0.005)


def _gpt(hidden=512, layers=4, heads=8, vocab=1000, seq=256) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * hidden, max_seq_len=seq, norm="layernorm",
                       position="learned", mlp="gelu", bias=True, tie_embeddings=True)


def test_training_flops_by_hand():
    h, layers, vocab, s = 512, 4, 1000, 256
    config = _gpt(h, layers, 8, vocab, s)
    matmuls = layers * s * 24 * h * h  # QKV 6h^2, out 2h^2, MLP 16h^2 per token, forward
    attention = layers * 2 * 2 * h * s * (s + 1) / 2  # QK^T and AV over the causal pairs
    head = s * 2 * h * vocab
    model, hardware = training_flops_per_sequence(config, s, "none")
    assert model == pytest.approx(3 * (matmuls + attention + head))
    assert hardware == model
    _, selective = training_flops_per_sequence(config, s, "selective")
    assert selective == pytest.approx(model + attention)
    _, full = training_flops_per_sequence(config, s, "full")
    assert full == pytest.approx(model + matmuls + attention)
    total, _ = training_flops(config, 1e6, s)
    assert total == pytest.approx(model * 1e6 / s)


def test_moe_flops_count_only_routed_experts():
    config = preset("mixtral-8x7b")
    s = 4096
    h, q, kv, f = 4096, 4096, 1024, 14336
    per_token = config.num_layers * 2 * (h * (q + 2 * kv) + q * h + h * 8 + 2 * 3 * h * f)
    attention = config.num_layers * 2 * 32 * 256 * (s + 1) / 2
    head = 2 * h * config.vocab_size
    model, _ = training_flops_per_sequence(config, s)
    assert model == pytest.approx(3 * (s * (per_token + head) + s * attention), rel=1e-9)


def test_parameter_count_matches_tetrad_transformer():
    """Needs torch (this file is in tests/, the planner itself never imports it)."""
    torch = pytest.importorskip("torch")
    from tetrad.models.transformer import Transformer

    variants = [preset("tiny"), preset("small"), preset("tiny-moe"),
                _gpt(64, 2, 4, 300, 64),
                preset("tiny").replace(qkv_bias=True, tie_embeddings=True),
                preset("tiny-moe").replace(num_dense_layers=1, num_shared_experts=2)]
    torch.manual_seed(0)
    for config in variants:
        model = Transformer(config)
        assert count_parameters(config) == sum(p.numel() for p in model.parameters()), config
