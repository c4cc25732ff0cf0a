"""The planner's rules, bounds and byte tables against their definitions: each refusal raised for
exactly the inputs that break its rule (and its message naming that rule), the bounds the README
states, number formats' bytes from their bit widths and scale layouts, the training recipes'
bytes per state, and a layout's derived counts."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tetrad.errors import ConfigError
from tetrad.planner import limits
from tetrad.planner.layout import TrainLayout, check_training_layout, microbatches_for
from tetrad.planner.precision import (ELEMENT_BYTES, element_bytes, training_precision,
                                      unquantized_bytes, weight_bytes)
from tetrad.planner.rules import (check_context_parallel, check_deepseek_features,
                                  check_expert_parallel, check_layout, check_tensor_parallel,
                                  resolve_layout, shared_expert_size)
from tetrad.planner.partition import partition
from tetrad.spec.model import ParallelConfig
from tetrad.spec.presets import preset

README = Path(__file__).resolve().parent.parent / "README.md"
MOE = preset("tiny-moe")  # 4 heads, 2 kv heads, vocabulary 256, 4 experts
MLA = MOE.replace(attention="mla", num_kv_heads=4, q_lora_rank=20, kv_lora_rank=12,
                  qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10)


def test_bounds_are_the_ones_the_readme_states():
    text = " ".join(README.read_text().split())
    found = re.search(r"a global batch of 2\^(\d+) sequences, 2\^(\d+) tokens per sequence, "
                      r"(\S+) training tokens, ([\d,]+) to ([\d,]+) Gb/s per NIC", text)
    assert found, "README's list of planner bounds moved: update this test with it"
    batch, seq, tokens, nic_low, nic_high = found.groups()
    assert limits.MAX_GLOBAL_BATCH == 2 ** int(batch)
    assert limits.MAX_SEQ_LEN == 2 ** int(seq)
    assert limits.MAX_TOKENS == float(tokens)
    assert (limits.MIN_NIC_GBPS, limits.MAX_NIC_GBPS) == (
        float(nic_low.replace(",", "")), float(nic_high.replace(",", "")))


def test_a_count_is_a_whole_number_within_its_bounds():
    for value in (None, 1, 7, 100):
        limits.check_count("--n", value, 100, "why")
    for value, words in ((0, "at least 1"), (101, "more than 100, why"), (True, "whole number"),
                         (2.0, "whole number"), (-1, "at least 1")):
        with pytest.raises(ConfigError, match=words):
            limits.check_count("--n", value, 100, "why")
    limits.check_count("--n", 0, 100, "why", at_least=0)
    limits.check_count("--n", -5, 100, "why", at_least=None)
    with pytest.raises(ConfigError, match="at least 3"):
        limits.check_count("--n", 2, 100, "why", at_least=3)


def test_a_number_is_finite_and_within_its_bounds():
    for value in (None, 0.0, 1.5, 10.0):
        limits.check_number("--x", value, 0.0, 10.0, "why")
    for value, words in ((math.nan, "finite"), (math.inf, "finite"), (-math.inf, "finite"),
                         (-0.1, "at least 0"), (10.5, "more than 10, why")):
        with pytest.raises(ConfigError, match=words):
            limits.check_number("--x", value, 0.0, 10.0, "why")
    with pytest.raises(ConfigError, match="more than 0"):
        limits.check_number("--x", 0.0, 0.0, 10.0, "why", low_allowed=False)
    limits.check_number("--x", 1e-9, 0.0, 10.0, "why", low_allowed=False)


def test_element_bytes_are_the_formats_bit_width_over_eight():
    for name in ELEMENT_BYTES:
        bits = int(re.search(r"\d+", name).group())
        assert element_bytes(name) == bits / 8
    with pytest.raises(ConfigError, match="unknown dtype"):
        element_bytes("fp12")


def test_quantized_weights_carry_their_scales():
    """A 256 x 384 weight: fp8 keeps one fp32 scale per 128 x 128 block (6 blocks); int4 one fp16
    scale and one fp16 zero point per group of 128 (768 groups); 16-bit and int8 formats none
    worth counting; and what quantized checkpoints keep unquantized is 16-bit at least."""
    n = 256 * 384
    for name in ("fp8", "fp8-e4m3", "fp8-e5m2"):
        assert weight_bytes(name) * n == pytest.approx(n * 1 + 6 * 4)
    assert weight_bytes("int4") * n == pytest.approx(n / 2 + (n // 128) * (2 + 2))
    for name in ("bf16", "fp16", "fp32", "int8"):
        assert weight_bytes(name) == element_bytes(name)
    for name in ELEMENT_BYTES:
        assert unquantized_bytes(name) == max(2.0, element_bytes(name))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8", "fp8-e4m3", "fp8-e5m2"])
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_training_recipes_bytes_per_state(dtype, fp32_grads):
    """fp32: 4-byte parameters and gradients, two 4-byte Adam moments, no master copy, fp32
    activations. Mixed precision (bf16, fp16, and fp8, whose model state is bf16's): 2-byte
    parameters and gradients (4 accumulated in fp32), a 4-byte master copy and two 4-byte moments,
    16-bit activations."""
    recipe = training_precision(dtype, fp32_grads)
    if dtype == "fp32":
        expected = ("fp32", 4, 4, 0, 8, 4)
    else:
        expected = ("fp8" if dtype.startswith("fp8") else dtype, 2, 4 if fp32_grads else 2,
                    4, 8, 2)
    assert (recipe.compute_dtype, recipe.param_bytes, recipe.grad_bytes, recipe.master_bytes,
            recipe.optimizer_bytes, recipe.activation_bytes) == expected
    assert recipe.optimizer_state_bytes == recipe.master_bytes + recipe.optimizer_bytes
    assert recipe.bytes_per_parameter == sum(expected[1:5])
    if dtype.startswith("fp8"):
        assert training_precision(dtype, fp8_recipe="tensor").fp8_recipe == "tensor"
    with pytest.raises(ConfigError, match="training dtype"):
        training_precision("int4")


def test_each_tensor_parallel_refusal_names_its_rule():
    cases = [
        (MOE, 3, {}, "does not divide num_heads 4"),
        (MOE.replace(num_heads=8, num_kv_heads=4), 8, {"kv_replicas": False},
         "does not divide num_kv_heads 4"),
        (MOE.replace(num_heads=12, num_kv_heads=4, head_dim=16), 6, {},
         "be a multiple of them"),
        (MOE.replace(vocab_size=255), 2, {}, "pad the vocabulary to 256"),
        (MOE.replace(num_shared_experts=1, moe_ffn_hidden_size=63), 2, {},
         "shared experts' 63 hidden units"),
        (MOE.replace(num_dense_layers=1, ffn_hidden_size=129), 2, {},
         "ffn_hidden_size 129"),
        (MOE, 2, {"sequence_parallel": True, "seq_len": 33}, "seq_len 33 is not a multiple of 2"),
    ]
    for config, tp, extra, words in cases:
        with pytest.raises(ConfigError, match=words):
            check_tensor_parallel(config, tp, **extra)
    # Each rule alone: one step inside it passes.
    check_tensor_parallel(MOE, 2)
    check_tensor_parallel(MOE, 4)  # 2 kv heads, each on two ranks
    check_tensor_parallel(MOE.replace(vocab_size=255), 2, runtime=False)
    check_tensor_parallel(MOE.replace(ffn_hidden_size=129), 2)  # no dense layer uses it
    check_tensor_parallel(MOE, 2, sequence_parallel=True, seq_len=34)
    check_tensor_parallel(MOE, 2, sequence_parallel=False, seq_len=33)
    check_tensor_parallel(MOE, 3 - 2, sequence_parallel=True, seq_len=33)
    assert shared_expert_size(MOE.replace(num_shared_experts=3)) == 3 * MOE.moe_ffn_hidden_size
    assert shared_expert_size(preset("small").replace(num_shared_experts=2)) == 0


def test_serving_mha_needs_whole_kv_heads_per_rank_only_when_training():
    gqa = preset("small")  # 8 heads, 4 kv heads
    check_tensor_parallel(gqa, 8, training=False, kv_replicas=False, runtime=False)
    for training, runtime in ((True, False), (True, True)):
        with pytest.raises(ConfigError, match="num_kv_heads"):
            check_tensor_parallel(gqa, 8, training=training, kv_replicas=False, runtime=runtime)
    with pytest.raises(ConfigError):  # the runtime's TP layers need whole kv heads too
        check_tensor_parallel(gqa, 8, training=False, kv_replicas=False, runtime=True)


def test_context_parallel_rules():
    check_context_parallel(MOE, 2, 64)
    check_context_parallel(MOE, 1, MOE.max_seq_len)
    for cp, seq, words in ((0, 64, "positive integer"), (2, 66, "2\\*cp = 4"),
                           (1, MOE.max_seq_len + 2, "longer than the model")):
        with pytest.raises(ConfigError, match=words):
            check_context_parallel(MOE, cp, seq)


def test_expert_parallel_rules():
    check_expert_parallel(MOE, 4)
    check_expert_parallel(MOE, 2, capacity_factor=1.25)
    check_expert_parallel(preset("small"), 1)
    for config, ep, factor, words in ((preset("small"), 2, None, "needs a mixture-of-experts"),
                                      (MOE, 3, None, "does not divide num_experts 4"),
                                      (MOE, 2, 0.0, "capacity factor"),
                                      (MOE, 2, -1.0, "capacity factor")):
        with pytest.raises(ConfigError, match=words):
            check_expert_parallel(config, ep, factor)


def test_deepseek_features_each_refused_only_where_they_break():
    for config, parallel, words in (
            (MLA, ParallelConfig(cp=2), "ring attention"),
            (MOE.replace(router_bias_update_rate=0.001), ParallelConfig(strategy="ps", servers=1),
             "routing bias"),
            (MLA, ParallelConfig(strategy="ps", servers=1), "multi-head latent")):
        with pytest.raises(ConfigError, match=words):
            check_deepseek_features(config, parallel)
    check_deepseek_features(MOE, ParallelConfig(cp=2))
    check_deepseek_features(MOE, ParallelConfig(strategy="ps", servers=1))
    check_deepseek_features(MOE.replace(router_bias_update_rate=0.001), ParallelConfig(dp=2))
    check_deepseek_features(MLA, ParallelConfig(dp=2, tp=2))


def test_check_layout_checks_cp_tp_stages_and_experts_of_the_layout():
    check_layout(MOE, ParallelConfig(tp=2, cp=2, ep=2, pp=2, microbatches=2), 64)
    for parallel, seq, words in ((ParallelConfig(cp=2), 66, "2\\*cp"),
                                 (ParallelConfig(tp=3), 64, "num_heads"),
                                 (ParallelConfig(pp=2, vpp=2, microbatches=2,
                                                 schedule="interleaved"), 64,
                                  "pipeline stages need"),
                                 (ParallelConfig(dp=3, ep=3), 64, "num_experts"),
                                 (ParallelConfig(cp=2, tp=4, sequence_parallel=True), 12,
                                  "not a multiple of 4")):
        with pytest.raises(ConfigError, match=words):
            check_layout(MOE.replace(num_layers=3) if "pipeline" in words else MOE, parallel,
                         seq)
    # Sequence parallelism splits each cp rank's chunk: 16 / cp 2 = 8 splits over tp 4.
    check_layout(MOE, ParallelConfig(cp=2, tp=4, sequence_parallel=True), 16)
    with pytest.raises(ConfigError, match="ring attention"):
        check_layout(MLA, ParallelConfig(cp=2), 64)
    check_layout(MLA, ParallelConfig(cp=2), 64, runtime=False)


def test_a_resolved_pipeline_carries_the_planners_cut():
    config = preset("small")
    resolved = resolve_layout(config, ParallelConfig(pp=2, vpp=1, microbatches=2), 128)
    assert resolved.parallel.stage_layers == partition(config, 2, 128).stage_layers
    assert resolved.seq_len == 128 and resolved.model == config
    given = resolve_layout(config, ParallelConfig(pp=2, microbatches=2, stage_layers=(4, 2)), 128)
    assert given.parallel.stage_layers == (4, 2)
    flat = resolve_layout(config, ParallelConfig(dp=2), 128)
    assert flat.parallel == ParallelConfig(dp=2)


def test_a_layouts_derived_counts():
    layout = TrainLayout(dp=4, cp=2, tp=2, ep=4, pp=2, microbatches=3, grad_accum=2,
                         micro_batch=5)
    assert layout.num_microbatches == 6 and layout.schedule_microbatches == 3
    assert layout.global_batch == 4 * 5 * 6
    assert layout.zero_group == 8
    assert layout.expert_tp == 2  # ep 4 folds over dp*cp = 8: experts split over tp as Megatron
    assert layout.expert_zero_group == 4 * 2 * 2 // (4 * 2)
    over_tp = TrainLayout(dp=2, tp=4, ep=8)  # ep spans tensor ranks: experts whole
    assert over_tp.expert_tp == 1 and over_tp.expert_zero_group == 1
    assert layout.to_dict() == {"tp": 2, "pp": 2, "dp": 4, "cp": 2, "ep": 4, "vpp": 1,
                                "zero": 0, "offload": False, "offload_mode": "none",
                                "recompute": "none", "partition_activations": False,
                                "offload_activations": False,
                                "sequence_parallel": False, "schedule": "1f1b",
                                "micro_batch": 5, "num_microbatches": 6}
    # Microbatches beyond one pipeline pass are repeated passes; without a pipeline, one pass.
    piped = TrainLayout.of(ParallelConfig(pp=2, microbatches=4), 3, 12)
    assert (piped.microbatches, piped.grad_accum, piped.micro_batch) == (4, 3, 3)
    uneven = TrainLayout.of(ParallelConfig(pp=2, microbatches=4), 3, 6)
    assert (uneven.microbatches, uneven.grad_accum) == (6, 1)
    flat = TrainLayout.of(ParallelConfig(dp=2), 2, 8)
    assert (flat.microbatches, flat.grad_accum) == (8, 1)
    assert TrainLayout.of(ParallelConfig(pp=2, microbatches=4), 1).num_microbatches == 4


def test_training_layout_refusals():
    config = MOE
    check_training_layout(config, 8, TrainLayout(dp=4, tp=2, ep=4), 64)
    with pytest.raises(ConfigError, match="multiply to the GPU count"):
        check_training_layout(config, 16, TrainLayout(dp=4, tp=2), 64)
    with pytest.raises(ConfigError, match="spreads experts over the data-parallel ranks"):
        check_training_layout(config, 8, TrainLayout(dp=2, tp=4, ep=4), 64, kv_replicas=True)
    check_training_layout(config, 8, TrainLayout(dp=2, tp=4, ep=4), 64, kv_replicas=True,
                          experts_over_tp=True)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        check_training_layout(config, 8, TrainLayout(dp=2, tp=4), 64, kv_replicas=False)
    with pytest.raises(ConfigError, match="micro batch"):
        check_training_layout(config, 2, TrainLayout(dp=2, micro_batch=0), 64)
    assert microbatches_for(64, 4, 2) == 8
    with pytest.raises(ConfigError, match="not divisible by dp\\*micro_batch = 4\\*3 = 12"):
        microbatches_for(64, 4, 3)
