"""Memory per GPU against published figures and independent formulas."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.spec.model import ModelConfig
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import (ActivationOptions, activation_bytes_per_layer,
                                   in_flight_microbatches, kv_bytes_per_token, kv_token_layout,
                                   model_state_bytes, peak_bytes_by_zero_stage,
                                   representative_stages, stage_activation_bytes,
                                   stage_layer_counts, stage_params, training_memory,
                                   zero_state_bytes)
from tetrad.planner.model_stats import count_parameters
from tetrad.planner.precision import training_precision, weight_bytes
from tetrad.planner.serving import model_weight_bytes
from tetrad.spec.presets import preset

BF16 = training_precision("bf16")


def test_zero_paper_example():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64-way data parallel, mixed-precision
    # Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB per GPU for ZeRO stages 0 / 1 / 2 / 3.
    for stage, published in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.9)):
        total = sum(zero_state_bytes(7.5e9, 64, stage, False, BF16)) / 1e9
        assert total == pytest.approx(published, abs=0.05)


def test_sixteen_bytes_per_parameter():
    assert BF16.bytes_per_parameter == 16  # 2 param + 2 grad + 4 master + 4 + 4 Adam moments
    assert BF16.optimizer_state_bytes == 12  # the ZeRO paper's K
    assert training_precision("fp32").bytes_per_parameter == 16  # 4 + 4 + 8, no master copy
    assert training_precision("bf16", fp32_grads=True).bytes_per_parameter == 18


def test_model_states_follow_zero_sharding():
    config = preset("llama2-7b")
    n = count_parameters(config)
    for zero in range(4):
        layout = TrainLayout(dp=8, zero=zero)
        params, grads, optimizer = model_state_bytes(config, layout, BF16, 0)
        assert optimizer == pytest.approx(12 * n / (8 if zero >= 1 else 1))
        assert grads == pytest.approx(2 * n / (8 if zero >= 2 else 1))
        if zero < 3:
            assert params == pytest.approx(2 * n)
        else:  # the shard plus two gathered blocks (FSDP prefetches the next one)
            block = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
            assert params == pytest.approx(2 * n / 8 + 2 * 2 * block)
    offloaded = model_state_bytes(config, TrainLayout(dp=8, zero=1, offload=True), BF16, 0)
    assert offloaded[2] == 0


def _gpt(h=1024, heads=16, layers=4, seq=2048):
    return ModelConfig(vocab_size=1000, hidden_size=h, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * h, max_seq_len=seq, norm="layernorm",
                       position="learned", mlp="gelu", bias=True, tie_embeddings=True)


def test_korthikanti_activation_formulas():
    """Korthikanti et al. 2022, table 2: bytes per layer for s, b, h, a, t."""
    s, b, h, a = 2048, 2, 1024, 16
    config = _gpt(h, a, seq=s)
    megatron = ActivationOptions(flash_attention=False, dropout=True)

    def per_layer(tp, sp, recompute):
        return activation_bytes_per_layer(config, 0, b, s, tp, 1, sp, recompute, megatron, 2.0)

    sbh = s * b * h
    assert per_layer(1, False, "none") == pytest.approx(34 * sbh + 5 * a * s * s * b)
    t = 8
    assert per_layer(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert per_layer(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert per_layer(t, True, "selective") == pytest.approx(34 * sbh / t)
    assert per_layer(t, False, "full") == pytest.approx(2 * sbh)
    assert per_layer(t, True, "full") == pytest.approx(2 * sbh / t)


def test_flash_attention_stores_no_score_matrix():
    s, b = 4096, 1
    config = preset("llama3-8b")
    stored = activation_bytes_per_layer(config, 0, b, s, 1, 1, False, "none",
                                        ActivationOptions(), 2.0)
    h, f, q, kv = 4096, 14336, 4096, 1024
    # norm and matmul inputs 4h, q k v and attention output 2q + 2kv, SwiGLU's 3f, fp32 LSE
    assert stored == pytest.approx(s * b * (2 * (4 * h + 2 * q + 2 * kv + 3 * f) + 32 * 4))


def test_pipeline_in_flight_microbatches():
    p, m = 8, 32
    for stage in range(p):
        assert in_flight_microbatches(TrainLayout(pp=p, microbatches=m), stage) == p - stage
    assert in_flight_microbatches(TrainLayout(pp=p, microbatches=4), 0) == 4
    assert in_flight_microbatches(TrainLayout(pp=p, schedule="gpipe", microbatches=m), 0) == m
    # Interleaving raises the first stage's activations by 1 + (p - 1) / (p v) (Korthikanti
    # et al. 2022, section 4.2.3), relative to 1F1B's p microbatches.
    v = 4
    interleaved = TrainLayout(pp=p, vpp=v, schedule="interleaved", microbatches=m)
    assert in_flight_microbatches(interleaved, 0) / p == pytest.approx(1 + (p - 1) / (p * v))


def test_uneven_stages_trim_first_and_last():
    assert stage_layer_counts(126, 16) == (7,) + (8,) * 14 + (7,)
    assert stage_layer_counts(32, 4) == (8, 8, 8, 8)
    assert sum(stage_layer_counts(61, 16)) == 61


def test_first_stage_is_fullest_with_1f1b():
    config = preset("llama2-13b")
    layout = TrainLayout(tp=2, pp=4, dp=1, sequence_parallel=True, microbatches=16)
    _, stage = training_memory(config, layout, BF16, 4096, ActivationOptions())
    assert stage == 0


def test_opt13b_kv_cache():
    # Kwon et al. 2023 (vLLM), section 3: OPT-13B's KV cache is 2 x 5120 x 40 x 2 bytes = 800 KB
    # per token, up to 1.6 GB for a 2048-token request.
    per_token = kv_bytes_per_token(preset("opt-13b"), 2.0)
    assert per_token == 2 * 5120 * 40 * 2 == 800 * 1024
    assert per_token * 2048 / 1e9 == pytest.approx(1.6, abs=0.08)


def test_kv_cache_gqa_and_mla():
    llama = preset("llama3-70b")
    assert kv_bytes_per_token(llama, 2.0) == 80 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(llama, 2.0, tp=8) == 80 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token(llama, 2.0, tp=16) == 80 * 2 * 1 * 128 * 2  # replicated heads
    # DeepSeek-V3's MLA caches the 512-dim latent and the 64-dim rope key per layer.
    assert kv_bytes_per_token(preset("deepseek-v3"), 2.0, tp=8) == 61 * (512 + 64) * 2


def test_served_weights():
    # vLLM paper, figure 1: a 13B model's parameters take 26 GB of an A100-40GB.
    assert model_weight_bytes(preset("opt-13b"), "bf16") / 1e9 == pytest.approx(25.7, abs=0.1)
    # FP8 with 128x128 fp32 block scales: a byte per linear weight plus 4/16384; the
    # embeddings, norms and routers stay bf16.
    r1 = preset("deepseek-r1")
    fp8 = model_weight_bytes(r1, "fp8")
    assert weight_bytes("fp8") == 1 + 4 / 16384
    assert count_parameters(r1) < fp8 < count_parameters(r1) * 1.01
    assert model_weight_bytes(r1, "bf16") == pytest.approx(2 * count_parameters(r1))


@pytest.mark.parametrize("name", ["small", "llama2-7b", "deepseek-v3"])
def test_stages_hold_every_parameter_once(name):
    """Over the stages of any cut, a rank's dense and expert elements add up to the model's count
    (a tied head on its own stage keeps one more copy of the embedding, as Megatron does)."""
    config = preset(name)
    n = count_parameters(config)
    for pp in (1, 2, 4):
        held = sum(sum(stage_params(config, pp, stage, 1, 1)) for stage in range(pp))
        assert held == n
    tied = _gpt(layers=4)
    embedding = tied.vocab_size * tied.hidden_size
    assert sum(stage_params(tied, 1, 0, 1, 1)) == count_parameters(tied)
    assert sum(sum(stage_params(tied, 2, s, 1, 1)) for s in range(2)) == \
        count_parameters(tied) + embedding


def test_the_fullest_stage_candidates():
    assert representative_stages(126, 16) == (0, 1, 15)  # 7 + 14 x 8 + 7 layers
    assert representative_stages(32, 4) == (0, 3)
    assert representative_stages(30, 1) == (0,)


@pytest.mark.parametrize("runtime", ["megatron", "tetrad"])
def test_peak_by_zero_stage_is_the_full_count_and_follows_the_zero_paper(runtime):
    config = preset("small")
    layout = TrainLayout(dp=8, pp=2, microbatches=4, micro_batch=2)
    options = ActivationOptions(runtime=runtime)
    peaks = peak_bytes_by_zero_stage(config, layout, BF16, 256, options, (0, 1, 2, 3))
    for zero, peak in enumerate(peaks):
        slow = training_memory(config, dataclasses.replace(layout, zero=zero), BF16, 256, options)
        assert peak == pytest.approx(slow[0].total)
    flat = peak_bytes_by_zero_stage(config, TrainLayout(dp=8, micro_batch=2), BF16, 256,
                                    ActivationOptions(), (0, 1, 2))
    n = count_parameters(config)
    assert flat[0] - flat[1] == pytest.approx(12 * n * 7 / 8)  # Adam's K = 12 bytes sharded
    assert flat[1] - flat[2] == pytest.approx(2 * n * 7 / 8)  # then the bf16 gradients


def test_last_stage_keeps_the_head_input_and_its_logits_in_two_precisions():
    config, s, b = _gpt(layers=4, seq=512), 512, 2
    layout = TrainLayout(pp=2, microbatches=1, micro_batch=b)
    options = ActivationOptions()
    first = stage_activation_bytes(config, layout, s, options, 2.0, 0)
    last = stage_activation_bytes(config, layout, s, options, 2.0, 1)
    # Both stages hold two blocks' activations for their one microbatch.
    assert last - first == pytest.approx(b * s * (1024 * 2 + 1000 * (2 + 4)))


def test_kv_token_layout_of_one_gpu():
    assert kv_token_layout(preset("llama3-70b")) == (2, 8, 128)
    assert kv_token_layout(preset("llama3-70b"), 16) == (2, 1, 128)
    assert kv_token_layout(preset("deepseek-v3")) == (1, 1, 512 + 64)
