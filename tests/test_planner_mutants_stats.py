"""Parameter counts, matmul shapes and FLOPs of the planner against tetrad's own torch model, tensor
by tensor: every parameter classified by its name (how tensor and expert parallelism split it,
whether quantized checkpoints keep it in 16 bits), every matmul weight's FLOPs at 2 per
multiply-add, and the experts a batch touches against a brute-force expectation."""

from __future__ import annotations

import functools
import itertools
from fractions import Fraction

import pytest

from tetrad.planner.flops import (attention_core_flops, forward_flops_per_sequence, layer_gemms,
                                  six_n_d, training_flops, training_flops_per_sequence)
from tetrad.planner.model_stats import (active_parameters, bias_params, count_parameters,
                                        embedding_params, head_params, layer_params,
                                        parameter_breakdown, position_params,
                                        unquantized_layer_params)
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

torch = pytest.importorskip("torch")

MOE = preset("tiny-moe").replace(num_dense_layers=1, num_shared_experts=2)
CONFIGS = {
    "gpt": ModelConfig(vocab_size=300, hidden_size=48, num_layers=3, num_heads=4,
                       ffn_hidden_size=176, max_seq_len=40, norm="layernorm",
                       position="learned", mlp="gelu", bias=True, tie_embeddings=True),
    "llama": preset("tiny"),
    "qwen": preset("tiny").replace(qkv_bias=True),
    "moe": MOE,
    "moe-bias": MOE.replace(bias=True, norm="layernorm", mlp="gelu", num_shared_experts=1,
                            tie_embeddings=True),
    "mla": MOE.replace(attention="mla", num_kv_heads=4, q_lora_rank=20, kv_lora_rank=12,
                       qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10,
                       router_score="sigmoid", num_shared_experts=1),
    "mla-lite": MOE.replace(attention="mla", num_kv_heads=4, q_lora_rank=0, kv_lora_rank=12,
                            qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10),
}
ROW_PARALLEL_BIASES = ("attn.out.bias", "mlp.down.bias", "shared.down.bias")
UNSPLIT_MATMULS = ("q_down.weight", "kv_down.weight", "router.gate.weight")


@functools.lru_cache(maxsize=None)
def _named(config):
    from tetrad.models.transformer import Transformer

    torch.manual_seed(0)
    return {name: p.numel() for name, p in Transformer(config).named_parameters()}


def _layer(named, layer):
    prefix = f"layers.{layer}."
    return {name[len(prefix):]: n for name, n in named.items() if name.startswith(prefix)}


def _is_norm(name):
    return name.rsplit(".", 2)[-2].endswith("norm")


def _kind(name):
    """How the strategies split a block's tensor: experts over ep, the rest over tp or not."""
    if ".experts." in name:
        return "experts"
    if _is_norm(name) or ".router." in name or name.endswith(ROW_PARALLEL_BIASES) \
            or name.endswith(UNSPLIT_MATMULS):
        return "replicated"
    return "tp_sharded"


def _one_expert(block):
    return sum(n for name, n in block.items() if ".experts.0." in name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_block_tensor_counted_where_parallelism_puts_it(name):
    config = CONFIGS[name]
    named = _named(config)
    for layer in range(config.num_layers):
        block = _layer(named, layer)
        counted = layer_params(config, layer)
        for kind in ("tp_sharded", "replicated", "experts"):
            assert getattr(counted, kind) == sum(n for t, n in block.items() if _kind(t) == kind)
        assert bias_params(config, layer) == sum(
            n for t, n in block.items()
            if t.endswith(".bias") and not _is_norm(t) and ".router." not in t)
        # What quantized checkpoints keep in 16 bits: norms, biases and the router.
        assert unquantized_layer_params(config, layer) == sum(
            n for t, n in block.items()
            if _is_norm(t) or t.endswith(".bias") or ".router." in t)
    assert embedding_params(config) == named["embed.weight"]
    assert position_params(config) == named.get("pos_embed.weight", 0)
    assert head_params(config) == named.get("lm_head.weight", 0)
    assert count_parameters(config) == sum(named.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_breakdown_parts_are_their_tensors_and_active_drops_unchosen_experts(name):
    config = CONFIGS[name]
    named = _named(config)
    parts = parameter_breakdown(config)
    blocks = {t: n for t, n in named.items() if t.startswith("layers.")}
    assert parts["embedding"] == named["embed.weight"] + named.get("pos_embed.weight", 0)
    assert parts["lm_head"] == named.get("lm_head.weight", 0)
    assert parts["experts"] == sum(n for t, n in blocks.items() if ".experts." in t)
    assert parts["attention"] == sum(n for t, n in blocks.items() if ".attn." in t)
    assert parts["norms"] == sum(n for t, n in named.items()
                                 if t.split(".")[-2] in ("attn_norm", "mlp_norm", "norm"))
    assert parts["mlp"] == sum(n for t, n in blocks.items()
                               if ".mlp." in t and ".experts." not in t)
    unchosen = config.num_experts - config.num_experts_per_token
    moe_layers = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
    assert active_parameters(config) == sum(named.values()) - sum(
        unchosen * _one_expert(_layer(named, layer)) for layer in moe_layers)
    assert six_n_d(config, 1000) == 6 * active_parameters(config) * 1000


def _matmul_weights(block, split):
    """Elements of the block's matmul weights, split ones and unsplit ones apart (experts: one)."""
    weights = {t: n for t, n in block.items()
               if t.endswith(".weight") and not _is_norm(t) and ".experts." not in t}
    unsplit = sum(n for t, n in weights.items() if t.endswith(UNSPLIT_MATMULS))
    return (sum(weights.values()) - unsplit) / split + unsplit


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_block_matmul_flops_are_two_per_weight_per_token(name, tp):
    """A token's forward does 2 FLOPs per matmul weight it passes through, k experts' worth of
    routed weights, each split weight 1/tp of it on one rank, for any expert-parallel degree."""
    config = CONFIGS[name]
    named = _named(config)
    tokens = 7
    for layer in range(config.num_layers):
        block = _layer(named, layer)
        expert = sum(n for t, n in block.items()
                     if ".experts.0." in t and t.endswith(".weight"))
        for ep in (1, 2):
            expected = 2 * tokens * (_matmul_weights(block, tp)
                                     + config.num_experts_per_token * expert / tp)
            assert sum(g.flops for g in layer_gemms(config, layer, tokens, tp, ep)) == \
                pytest.approx(expected)
        if expert:  # experts whole on each rank (expert_tp 1) do their whole width
            whole = sum(g.flops for g in layer_gemms(config, layer, tokens, tp, 2, None, 1))
            assert whole == pytest.approx(2 * tokens * (_matmul_weights(block, tp)
                                                        + config.num_experts_per_token * expert))


def _expected_distinct_experts(num_experts, top_k, tokens):
    """Mean number of experts hit by `tokens` tokens each choosing `top_k` of `num_experts`
    uniformly, by enumerating every choice."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    total = sum(len(set().union(*picks)) for picks in itertools.product(choices, repeat=tokens))
    return Fraction(total, len(choices) ** tokens)


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_a_decode_batch_runs_the_experts_its_tokens_choose(tokens):
    config = MOE.replace(num_experts=4, num_experts_per_token=2, num_shared_experts=0)
    gemms = layer_gemms(config, 1, tokens)
    expected = float(_expected_distinct_experts(4, 2, tokens))
    assert [g.count for g in gemms[-2:]] == pytest.approx([expected, expected])
    # Over two expert-parallel ranks, each holds 2 experts and sees both ranks' tokens.
    local = layer_gemms(config, 1, tokens, 1, 2)
    assert local[-1].count == pytest.approx(
        max(1.0, 2 * float(_expected_distinct_experts(4, 2, 2 * tokens)) / 4))


def _causal_pairs_by_count(seq_len):
    return sum(1 for query in range(seq_len) for key in range(seq_len) if key <= query)


@pytest.mark.parametrize("name", ["gpt", "llama", "mla"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_training_flops_are_three_forwards_plus_what_recomputation_repeats(name, recompute):
    config = CONFIGS[name]
    named = _named(config)
    s = 12
    if config.attention == "mla":
        d_qk, d_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        d_qk = d_v = config.head_dim
    attention_per_layer = 2 * config.num_heads * (d_qk + d_v) * _causal_pairs_by_count(s)
    assert attention_core_flops(config, s) == attention_per_layer
    matmuls = sum(2 * s * (_matmul_weights(_layer(named, layer), 1)
                           + config.num_experts_per_token * sum(
                               n for t, n in _layer(named, layer).items()
                               if ".experts.0." in t and t.endswith(".weight")))
                  for layer in range(config.num_layers))
    head = 2 * s * config.vocab_size * config.hidden_size
    parts = forward_flops_per_sequence(config, s)
    assert parts["matmuls"] == pytest.approx(matmuls)
    assert parts["attention"] == attention_per_layer * config.num_layers
    assert parts["lm_head"] == head
    repeated = {"none": 0, "selective": parts["attention"],
                "full": parts["attention"] + parts["matmuls"]}[recompute]
    model, hardware = training_flops_per_sequence(config, s, recompute)
    assert model == pytest.approx(3 * (matmuls + parts["attention"] + head))
    assert hardware == pytest.approx(model + repeated)
    assert training_flops(config, 5 * s, s, recompute) == pytest.approx((5 * model, 5 * hardware))
