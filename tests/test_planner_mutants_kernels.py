"""The planner's kernel times read back as bytes and launches: on a GPU whose kernels cost nothing
to launch, a bandwidth-bound time times the bandwidth is the bytes the kernel moves, counted here
tensor by tensor; on one with unlimited bandwidth, it is the launches. Tensor and sequence
parallelism must then divide those bytes by the ranks exactly."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner.compute import (attention_times, fp8_cast_time, gemm_time, layer_times,
                                    stage_times)
from tetrad.planner.flops import Gemm, layer_gemms
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

H100 = catalog_gpu("h100-sxm")


def _gpu(overhead_s=0.0, memory=None):
    profile = dataclasses.replace(H100.efficiency, kernel_overhead_s=overhead_s,
                                  memory=memory or H100.efficiency.memory)
    return dataclasses.replace(H100, efficiency=profile)


FREE_LAUNCH = _gpu()
BYTES_PER_S = FREE_LAUNCH.memory_bandwidth * FREE_LAUNCH.efficiency.memory
ONLY_LAUNCH = _gpu(1.0, memory=1e30)  # bytes cost nothing; each launch one second

GPT = ModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8,
                  ffn_hidden_size=1024, max_seq_len=512, norm="layernorm", position="learned",
                  mlp="gelu", bias=True, tie_embeddings=True)
LLAMA = preset("small")
MOE = preset("tiny-moe").replace(num_dense_layers=1, num_shared_experts=2, num_experts=8,
                                 num_experts_per_token=3)
MLA = MOE.replace(attention="mla", num_kv_heads=4, q_lora_rank=20, kv_lora_rank=12,
                  qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10, num_shared_experts=1)


def _elementwise(gpu, config, layer, b, s, tp, sp, dropout, act=2.0):
    times = layer_times(config, gpu, layer, b, s, tp, 1, 1, sp, "none", True, dropout, "bf16",
                        act, act)
    return times.forward - times.matmul_forward - times.attention_forward


def _hand_bytes_per_token(config, layer, dropout, act):
    """One block's bandwidth-bound forward at tp 1: two norms read and write the hidden state,
    two residual adds read two and write one, dropout writes a 1-byte mask and a copy; rotary
    reads and writes the rotated query and key columns; the MLP's activation reads its input(s)
    (gate and up for SwiGLU) and writes one; an MoE block permutes its k copies of each token
    before the experts and back after (read and write each time)."""
    h = config.hidden_size
    total = (4 + 6) * h * act + (2 * h * (1 + act) if dropout else 0)
    if config.position == "rope":
        if config.attention == "mla":
            rotated = config.num_heads * config.qk_rope_head_dim + config.qk_rope_head_dim
        else:
            rotated = (config.num_heads + config.num_kv_heads) * config.head_dim
        total += 2 * rotated * act
    reads = 2 if config.mlp == "swiglu" else 1
    if config.is_moe_layer(layer):
        k = config.num_experts_per_token
        width = (k + config.num_shared_experts) * config.moe_ffn_hidden_size
        total += 4 * k * h * act
    else:
        width = config.ffn_hidden_size
    return total + (reads + 1) * width * act


def _hand_launches(config, layer, dropout):
    """Norms 2, residual adds 2, dropouts 2, rotary 1, activation 1, permute/un-permute 4."""
    return (4 + (2 if dropout else 0) + (1 if config.position == "rope" else 0) + 1
            + (4 if config.is_moe_layer(layer) else 0))


CASES = [(GPT, 0), (LLAMA, 0), (MOE, 0), (MOE, 1), (MLA, 1)]


@pytest.mark.parametrize("config,layer", CASES)
@pytest.mark.parametrize("dropout", [False, True])
def test_block_element_wise_bytes_and_launches_counted_by_hand(config, layer, dropout):
    b, s = 2, 64
    moved = _elementwise(FREE_LAUNCH, config, layer, b, s, 1, False, dropout) * BYTES_PER_S
    assert moved == pytest.approx(b * s * _hand_bytes_per_token(config, layer, dropout, 2.0))
    launches = _elementwise(ONLY_LAUNCH, config, layer, b, s, 1, False, dropout)
    assert launches == pytest.approx(_hand_launches(config, layer, dropout))


@pytest.mark.parametrize("config,layer", CASES)
def test_sequence_parallel_divides_every_element_wise_byte_by_the_ranks(config, layer):
    whole = _elementwise(FREE_LAUNCH, config, layer, 2, 64, 1, False, True)
    split = _elementwise(FREE_LAUNCH, config, layer, 2, 64, 2, True, True)
    # MLA's rope key is shared by the heads: every rank rotates all of it.
    shared_key = 2 * config.qk_rope_head_dim * 2.0 if config.attention == "mla" else 0
    assert split == pytest.approx(whole / 2 + 2 * 64 * shared_key / 2 / BYTES_PER_S)
    # Without sequence parallelism the norms, residuals and dropouts stay whole on every rank.
    h = config.hidden_size
    replicated = 2 * 64 * ((4 + 6) * h * 2 + 2 * h * 3) / BYTES_PER_S
    tp_only = _elementwise(FREE_LAUNCH, config, layer, 2, 64, 2, False, True)
    assert tp_only == pytest.approx(split + replicated / 2)


@pytest.mark.parametrize("config,layer", CASES)
def test_the_backward_repeats_twice_the_forwards_matmuls_and_element_wise_bytes(config, layer):
    for tp, sp in ((1, False), (2, True)):
        times = layer_times(config, H100, layer, 2, 64, tp, 1, 1, sp, "none", True, False,
                            "bf16", 2.0, 2.0)
        attention_forward, attention_backward = attention_times(config, H100, 2, 64, tp, 1,
                                                                True, False, 2.0)
        assert times.attention_forward == attention_forward
        matmuls = sum(gemm_time(H100, g, "bf16", 2.0, 2.0)
                      for g in layer_gemms(config, layer, 2 * 64, tp, 1))
        assert times.matmul_forward == pytest.approx(matmuls)
        elementwise = times.forward - matmuls - attention_forward
        assert times.backward == pytest.approx(2 * matmuls + attention_backward
                                               + 2 * elementwise)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_unfused_attention_under_context_parallelism_scores_its_query_chunk(cp):
    """Each cp rank scores its s/cp queries against all s keys: the score and softmax bytes and
    the matmul FLOPs fall by cp, not the launches."""
    b, s = 2, 256
    forward, backward = attention_times(GPT, FREE_LAUNCH, b, s, 1, cp, False, False, 2.0)
    heads, d = GPT.num_heads, GPT.head_dim
    scores = Gemm(s // cp, s, d, b * heads)
    values = Gemm(s // cp, d, s, b * heads)
    matmuls = sum(gemm_time(FREE_LAUNCH, g, "bf16", 2.0, 2.0) for g in (scores, values))
    softmax = b * heads * (s // cp) * s * 2 * 2 / BYTES_PER_S
    assert forward == pytest.approx(matmuls + softmax)
    assert backward == pytest.approx(2 * matmuls + 2 * softmax)


def test_a_gemm_moves_its_input_output_and_weight_once():
    gemm = Gemm(3000, 512, 1024, 2)
    for act, weight in ((2.0, 2.0), (2.0, 1.0), (4.0, 4.0)):
        moved = 2 * (3000 * 1024 * act + 3000 * 512 * act + 1024 * 512 * weight)
        assert gemm_time(H100, gemm, "bf16", act, weight) == pytest.approx(
            H100.efficiency.matmul_time(gemm.flops, moved, H100.peak("bf16"),
                                        H100.memory_bandwidth))


def test_fp8_casts_read_twice_and_write_twice_each_cast_element():
    """Transformer Engine's cast-transpose: an amax pass and the cast read each 16-bit element,
    which is written twice in fp8 (as is and transposed); two launches."""
    gemm = Gemm(300, 512, 1024, 3)
    inputs = 3 * 300 * 1024
    weights = 3 * 1024 * 512
    for casts, elements in (("inputs", inputs), ("inputs+weights", inputs + weights)):
        assert fp8_cast_time(FREE_LAUNCH, gemm, 2.0, casts) * BYTES_PER_S == pytest.approx(
            elements * (2 + 2 + 2))
        assert fp8_cast_time(ONLY_LAUNCH, gemm, 2.0, casts) == pytest.approx(2)
        assert gemm_time(H100, gemm, "fp8", 2.0, 1.0, casts) == pytest.approx(
            gemm_time(H100, gemm, "fp8", 2.0, 1.0) + fp8_cast_time(H100, gemm, 2.0, casts))


@pytest.mark.parametrize("zero3", [False, True])
def test_fp8_stages_cast_every_block_gemm_and_zero3_recasts_weights(zero3):
    config, b, s = LLAMA, 2, 128
    casts = "inputs+weights" if zero3 else "inputs"
    fp8 = stage_times(config, H100, 2, 0, b, s, 1, 1, 1, False, "none", True, False, "fp8",
                      2.0, 1.0, None, False, casts)
    plain = stage_times(config, H100, 2, 0, b, s, 1, 1, 1, False, "none", True, False, "fp8",
                        2.0, 1.0, None, False, "")
    per_block = sum(fp8_cast_time(H100, g, 2.0, casts) for g in layer_gemms(config, 0, b * s))
    layers = config.num_layers // 2
    assert fp8.matmul_forward - plain.matmul_forward == pytest.approx(layers * per_block)
    bf16 = stage_times(config, H100, 2, 0, b, s, 1, 1, 1, False, "none", True, False, "bf16",
                       2.0, 2.0, None, False, casts)
    no_casts = stage_times(config, H100, 2, 0, b, s, 1, 1, 1, False, "none", True, False,
                           "bf16", 2.0, 2.0, None, False, "")
    assert bf16 == no_casts  # only fp8 training quantizes operands


def test_experts_whole_over_tensor_ranks_see_every_rank_of_the_group():
    """expert_tp below tp: each tensor rank routes its 1/tp of the tokens and the expert group of
    ep ranks brings tokens/tp * ep of them to whole experts (layer_gemms' group_tokens)."""
    config, b, s, tp, ep = MOE, 2, 64, 2, 4
    args = (b, s, tp, 1, ep, True, "none", True, False, "bf16", 2.0, 2.0)
    whole = stage_times(config, H100, 1, 0, *args, 1)
    default = stage_times(config, H100, 1, 0, *args)
    moe_layers = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
    dense_layers = [layer for layer in range(config.num_layers) if not config.is_moe_layer(layer)]
    expected = sum(layer_times(config, H100, layer, *args, b * s // tp * ep, 1).forward
                   for layer in moe_layers) + sum(
        layer_times(config, H100, layer, *args).forward for layer in dense_layers)
    lm_head = default.forward - sum(layer_times(config, H100, layer, *args).forward
                                    for layer in range(config.num_layers))
    assert whole.forward == pytest.approx(expected + lm_head)
    assert whole.forward != pytest.approx(default.forward)
