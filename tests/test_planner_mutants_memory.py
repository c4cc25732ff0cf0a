"""Activation and model-state bytes of the planner's Megatron accounting, against what each stored
tensor holds (counted by hand per token), against how parallelism must divide them (micro batch,
context and sequence parallelism scale them exactly), and against brute force over every stage."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.planner.layout import TrainLayout, stage_layer_counts
from tetrad.planner.memory import (ActivationOptions, activation_bytes_per_layer,
                                   in_flight_microbatches, kv_bytes_per_token, model_state_bytes,
                                   stage_activation_bytes, stage_params, training_memory)
from tetrad.planner.model_stats import (embedding_params, head_params, layer_params, norm_params,
                                        position_params)
from tetrad.planner.precision import training_precision
from tetrad.planner.weight_copies import gathered_params_bytes
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

BF16 = training_precision("bf16")
FLASH = ActivationOptions()
MEGATRON = ActivationOptions(flash_attention=False, dropout=True)
GPT = ModelConfig(vocab_size=1000, hidden_size=256, num_layers=4, num_heads=8,
                  ffn_hidden_size=1024, max_seq_len=512, norm="layernorm", position="learned",
                  mlp="gelu", bias=True, tie_embeddings=True)
MOE = preset("tiny-moe").replace(num_layers=4, num_dense_layers=1, num_shared_experts=2,
                                 num_experts=8, num_experts_per_token=3)
MLA = MOE.replace(attention="mla", num_kv_heads=4, q_lora_rank=20, kv_lora_rank=12,
                  qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10, num_shared_experts=1)
CASES = [(GPT, 0, MEGATRON), (GPT, 0, FLASH), (preset("small"), 0, FLASH), (MOE, 0, FLASH),
         (MOE, 1, FLASH), (MOE, 1, MEGATRON), (MLA, 1, FLASH), (MLA, 0, MEGATRON)]


def _per_layer(config, layer, options, b=2, s=64, tp=1, cp=1, sp=False, recompute="none"):
    return activation_bytes_per_layer(config, layer, b, s, tp, cp, sp, recompute, options, 2.0)


def _replicated_per_token(config, options, act=2.0):
    """What tensor parallelism leaves whole: the inputs of the two norms and of each sub-block's
    first matmul, the dropout masks, and MLA's latents (q and kv, before and after their norms)
    and its shared rope key."""
    h = config.hidden_size
    total = 4 * h * act + (2 * h if options.dropout else 0)
    if config.attention == "mla":
        total += (2 * config.q_lora_rank + 2 * config.kv_lora_rank
                  + config.qk_rope_head_dim) * act
    return total


def _core_per_token(config, options, s, act=2.0):
    """The attention core's saved state per query: flash keeps an fp32 log-sum-exp per head; the
    unfused core keeps softmax output over all s keys, its dropout mask and the dropped copy."""
    if options.flash_attention:
        return config.num_heads * 4
    return config.num_heads * s * (act + (1 + act if options.dropout else 0))


def _hand_per_token(config, layer, options, s, act=2.0):
    heads = config.num_heads
    if config.attention == "mla":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        attention = heads * (2 * qk + 2 * config.v_head_dim) * act  # q, k, v, out input
    else:
        attention = (2 * heads + 2 * config.num_kv_heads) * config.head_dim * act
    gated = 3 if config.mlp == "swiglu" else 2  # up output(s) and the down projection's input
    if config.is_moe_layer(layer):
        k, ffn = config.num_experts_per_token, config.moe_ffn_hidden_size
        mlp = (k * (2 * config.hidden_size * act + gated * ffn * act)  # in, out, up, down in
               + config.num_experts * 4 * 2  # router logits and probabilities in fp32
               + gated * ffn * config.num_shared_experts * act)
    else:
        mlp = gated * config.ffn_hidden_size * act
    return (_replicated_per_token(config, options, act) + attention
            + _core_per_token(config, options, s, act) + mlp)


@pytest.mark.parametrize("config,layer,options", CASES)
def test_a_block_stores_its_tensors_counted_by_hand(config, layer, options):
    b, s = 2, 64
    assert _per_layer(config, layer, options, b, s) == pytest.approx(
        b * s * _hand_per_token(config, layer, options, s))
    # Selective recomputation drops the attention core; full keeps only the block's input.
    assert _per_layer(config, layer, options, b, s, recompute="selective") == pytest.approx(
        b * s * (_hand_per_token(config, layer, options, s) - _core_per_token(config, options, s)))
    assert _per_layer(config, layer, options, b, s, recompute="full") == pytest.approx(
        b * s * config.hidden_size * 2)


@pytest.mark.parametrize("config,layer,options", CASES)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_batch_context_and_sequence_parallelism_scale_stored_bytes_exactly(config, layer, options,
                                                                           recompute):
    one = _per_layer(config, layer, options, recompute=recompute)
    assert _per_layer(config, layer, options, b=4, recompute=recompute) == pytest.approx(2 * one)
    # Each cp rank keeps its half of the queries (an unfused core still scores all s keys).
    assert _per_layer(config, layer, options, cp=2, recompute=recompute) == pytest.approx(one / 2)
    split = _per_layer(config, layer, options, tp=2, sp=True, recompute=recompute)
    assert split == pytest.approx(one / 2)
    # Without sequence parallelism the replicated tensors stay whole on each rank.
    whole = (config.hidden_size * 2 if recompute == "full"
             else _replicated_per_token(config, options))
    assert _per_layer(config, layer, options, tp=2, recompute=recompute) == pytest.approx(
        split + 2 * 64 * whole / 2)


def _head_bytes(config, layout, s, act=2.0):
    """The head's input and its logits in 16 and 32 bits, one microbatch."""
    split = layout.tp if layout.sequence_parallel else 1
    tokens = layout.micro_batch * s / layout.cp
    return tokens * (config.hidden_size * act / split + config.vocab_size / layout.tp * (act + 4))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("schedule,pp,m", [("1f1b", 2, 4), ("gpipe", 2, 3), ("1f1b", 4, 8)])
def test_a_stage_holds_its_blocks_times_the_microbatches_in_flight(recompute, schedule, pp, m):
    config, s = MOE, 64
    layout = TrainLayout(pp=pp, dp=1, tp=2, sequence_parallel=True, schedule=schedule,
                         microbatches=m, micro_batch=2, recompute=recompute)
    counts = stage_layer_counts(config.num_layers, pp)
    for stage in range(pp):
        layers = range(sum(counts[:stage]), sum(counts[:stage + 1]))
        kept = sum(_per_layer(config, layer, FLASH, 2, s, 2, 1, True, recompute)
                   for layer in layers)
        expected = kept * in_flight_microbatches(layout, stage)
        if recompute == "full":  # the block being recomputed holds its whole set meanwhile
            expected += max(_per_layer(config, layer, FLASH, 2, s, 2, 1, True)
                            for layer in layers)
        if stage == pp - 1:
            expected += _head_bytes(config, layout, s)
        assert stage_activation_bytes(config, layout, s, FLASH, 2.0, stage) == \
            pytest.approx(expected)


@pytest.mark.parametrize("config", [MOE, MLA, GPT, preset("small")])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_a_rank_holds_its_share_of_each_layer_and_the_ends(config, tp, ep):
    if ep > 1 and not config.is_moe:
        return
    for pp in (1, 2):
        counts = stage_layer_counts(config.num_layers, pp)
        for stage in range(pp):
            layers = range(sum(counts[:stage]), sum(counts[:stage + 1]))
            dense = sum(layer_params(config, layer).tp_sharded / tp
                        + layer_params(config, layer).replicated for layer in layers)
            expert = sum(layer_params(config, layer).experts for layer in layers) / (ep * tp)
            if stage == 0:
                dense += embedding_params(config) / tp + position_params(config)
            if stage == pp - 1:
                head = head_params(config) or (embedding_params(config) if pp > 1 else 0)
                dense += norm_params(config) + head / tp
            assert stage_params(config, pp, stage, tp, ep) == pytest.approx((dense, expert))
        assert stage_params(config, pp, 0, tp, ep, 1)[1] == pytest.approx(
            sum(layer_params(config, layer).experts for layer in range(counts[0])) / ep)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_expert_states_shard_over_the_ranks_holding_the_same_experts(zero, offload):
    if offload and zero == 0:
        return  # offload needs a ZeRO stage
    layout = TrainLayout(dp=4, ep=2, zero=zero, offload=offload)
    dense, expert = stage_params(MOE, 1, 0, 1, 2)
    # Dense parameters are shared by all 4 data-parallel ranks, each expert by 4 / ep = 2; ZeRO
    # stage 1 shards the optimizer state, 2 the gradients too, 3 the parameters too.
    expected = []
    for per_element, from_stage in ((2, 3), (2, 2), (12, 1)):
        sharded = zero >= from_stage
        expected.append(per_element * (dense / (4 if sharded else 1)
                                       + expert / (2 if sharded else 1)))
    if offload:
        expected[2] = 0
    if zero == 3:  # two whole blocks gathered at the peak
        expected[0] += 2 * 2 * max(layer_params(MOE, layer).total
                                   for layer in range(MOE.num_layers))
    assert model_state_bytes(MOE, layout, BF16, 0) == pytest.approx(tuple(expected))


def test_zero3_gathers_two_of_the_biggest_blocks_or_the_live_budget():
    for config in (MOE, GPT, MOE.replace(num_experts=2, num_experts_per_token=1,
                                         num_shared_experts=0, moe_ffn_hidden_size=8)):
        biggest = max(layer_params(config, layer).total for layer in range(config.num_layers))
        for tp in (1, 2):
            layout = TrainLayout(dp=4, tp=tp, zero=3)
            assert gathered_params_bytes(config, layout, BF16) == pytest.approx(
                2 * biggest / tp * 2)
            assert gathered_params_bytes(config, layout, BF16, 1000) == pytest.approx(1000 * 2)
            assert gathered_params_bytes(config, layout, BF16, 1e12) == pytest.approx(
                2 * biggest / tp * 2)
            assert gathered_params_bytes(config, dataclasses.replace(layout, zero=2), BF16) == 0


@pytest.mark.parametrize("config", [MOE, GPT, preset("small").replace(num_layers=7)])
@pytest.mark.parametrize("pp,schedule", [(1, "1f1b"), (2, "1f1b"), (3, "gpipe"), (4, "1f1b")])
def test_the_fullest_gpu_is_the_fullest_of_every_stage(config, pp, schedule):
    if pp > config.num_layers:
        return
    layout = TrainLayout(pp=pp, dp=2, zero=1, schedule=schedule, microbatches=pp if pp > 1 else 1,
                         micro_batch=2)
    totals = [sum(model_state_bytes(config, layout, BF16, stage))
              + stage_activation_bytes(config, layout, 64, FLASH, 2.0, stage)
              for stage in range(pp)]
    breakdown, stage = training_memory(config, layout, BF16, 64, FLASH)
    assert breakdown.total == pytest.approx(max(totals))
    assert totals[stage] == pytest.approx(max(totals))
    assert breakdown.total == pytest.approx(breakdown.params + breakdown.grads
                                            + breakdown.optimizer + breakdown.activations)


@pytest.mark.parametrize("config", [preset("llama3-70b"), GPT, MLA])
def test_kv_bytes_per_token_are_layers_tensors_heads_and_width(config):
    for tp in (1, 2, 16):
        if config.attention == "mla":
            per_layer = config.kv_lora_rank + config.qk_rope_head_dim
        else:
            per_layer = 2 * max(1, config.num_kv_heads // tp) * config.head_dim
        assert kv_bytes_per_token(config, 2.0, tp) == config.num_layers * per_layer * 2
        assert kv_bytes_per_token(config, 1.0, tp, 3) == 3 * per_layer
