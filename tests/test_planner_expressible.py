"""What users need to say to the planner (issue 32, item 2): multi-query attention under tensor
parallelism (each KV head replicated, counted), one sequence-length rule with or without context
parallelism, parallel blocks, partial rotary and QK-norm (each changing the numbers by its
mechanism, and refused by tetrad's runtime, which does not build them)."""

from __future__ import annotations

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.profile import cluster
from tetrad.planner import TrainSpace, TrainWorkload, plan_training, predict_training
from tetrad.planner.compute import _elementwise_bytes
from tetrad.planner.flops import layer_gemms, training_flops_per_sequence
from tetrad.planner.layout import TrainLayout, check_training_layout
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.rules import check_layout, valid_tp_degrees
from tetrad.planner.training import evaluate_training
from tetrad.spec.hf import model_config_from_hf
from tetrad.planner.model_stats import count_parameters, kv_replica_params
from tetrad.spec.model import ModelConfig, ParallelConfig

# StarCoder-like multi-query attention: 16 query heads, one KV head.
MQA = ModelConfig(name="mqa", vocab_size=512, hidden_size=256, num_layers=4, num_heads=16,
                  num_kv_heads=1, ffn_hidden_size=1024, max_seq_len=128)
# EleutherAI/gpt-neox-20b's config.json (20.55B parameters) and Qwen/Qwen3-8B's (8.2B).
GPT_NEOX_20B = dict(model_type="gpt_neox", vocab_size=50432, hidden_size=6144,
                    num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
                    max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
                    layer_norm_eps=1e-5, tie_word_embeddings=False)
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, max_position_embeddings=40960, rope_theta=1000000,
                tie_word_embeddings=False, attention_bias=False)


def test_mqa_under_tp_replicates_the_kv_head_in_flops_and_kv_bytes():
    check_training_layout(MQA, 8, TrainLayout(tp=8), 128)
    qkv = layer_gemms(MQA, 0, 64, tp=8)[0]
    # Each of the 8 ranks holds 16 / 8 query heads and the whole key and value head.
    assert qkv.n == (16 // 8 + 2 * 1) * MQA.head_dim
    assert kv_bytes_per_token(MQA, 2, tp=8) == MQA.num_layers * 2 * 1 * MQA.head_dim * 2
    # The replica is the same on tp 2 and tp 8: the KV bytes of a rank stop shrinking at one head.
    assert kv_bytes_per_token(MQA, 2, tp=2) == kv_bytes_per_token(MQA, 2, tp=8)


def test_mqa_under_tp_counts_replicated_kv_weights_per_rank():
    """A rank's parameters at tp 8: its share of everything split, plus the whole KV head."""
    for runtime in ("megatron", "tetrad"):
        split = predict_training(MQA, ParallelConfig(tp=8), micro_batch=1, seq_len=64,
                                 runtime=runtime, dtype="bf16")["bytes"]["params"]
        whole = predict_training(MQA, ParallelConfig(), micro_batch=1, seq_len=64,
                                 runtime=runtime, dtype="bf16")["bytes"]["params"]
        element = whole / count_parameters(MQA)  # bytes per parameter of this recipe
        kv_weights = 2 * MQA.head_dim * MQA.hidden_size * MQA.num_layers * element  # K and V
        # Split eight ways, the KV projections would be kv_weights / 8; replicated, each rank
        # holds them whole: 7/8 of kv_weights more than an even split.
        assert split >= whole / 8 + kv_weights * 7 / 8 - 1, runtime
        assert split < whole
    per_rank = kv_replica_params(MQA, 8)
    assert per_rank == 2 * MQA.head_dim * MQA.hidden_size * (1 - 1 / 8)
    assert kv_replica_params(MQA, 1) == 0 == kv_replica_params(MQA.replace(num_kv_heads=16), 8)


def test_mqa_under_tp_is_searched_and_planned():
    world = cluster("h100-sxm", 8)
    planned = plan_training(MQA, world, TrainWorkload(seq_len=128), 64, TrainSpace(tp=8), 1)
    assert planned.ranked[0].layout.tp == 8 and planned.num_fitting
    assert valid_tp_degrees(MQA) == [1, 2, 4, 8, 16]  # the search's tp choices


def test_sequence_beyond_positions_is_one_rule_with_or_without_cp():
    """A rope model is timed past its max_seq_len by the planner whatever cp is; learned
    positions and tetrad's runtime refuse it whatever cp is."""
    long = 4 * MQA.max_seq_len
    for cp in (1, 2, 4):
        check_training_layout(MQA, cp, TrainLayout(cp=cp), long)
        with pytest.raises(ConfigError, match="longer than the model's max_seq_len"):
            check_training_layout(MQA.replace(position="learned"), cp, TrainLayout(cp=cp), long)


def _tp_all_reduces(config: ModelConfig) -> float:
    layout = TrainLayout(tp=2, micro_batch=1, sequence_parallel=False)
    estimate = evaluate_training(config, cluster("h100-sxm", 2), layout,
                                 TrainWorkload(seq_len=128, runtime="megatron"))
    return estimate.comm.calls_by_kind()["all_reduce"]


def test_parallel_block_same_flops_one_tp_reduction_per_block_and_pass():
    parallel = MQA.replace(num_kv_heads=8, parallel_block=True)
    sequential = parallel.replace(parallel_block=False)
    assert training_flops_per_sequence(parallel, 128) == training_flops_per_sequence(
        sequential, 128)
    one, two = _tp_all_reduces(parallel), _tp_all_reduces(sequential)
    # Sequential: 2 per block and pass (forward, backward) + 2 around the head; parallel: 1 + 2.
    assert two - one == 2 * MQA.num_layers and 2 * one - two == 2
    # One three-way residual add for two two-way ones: 2h fewer bytes per token, one kernel less.
    (bytes_par, kernels_par), (bytes_seq, kernels_seq) = (
        _elementwise_bytes(c, 0, 1, False, False, 2) for c in (parallel, sequential))
    assert bytes_seq - bytes_par == 2 * MQA.hidden_size * 2 and kernels_seq - kernels_par == 1


def test_partial_rotary_rotates_only_its_share_of_each_head():
    full, quarter = MQA, MQA.replace(rotary_fraction=0.25)
    assert quarter.rotary_dims == MQA.head_dim // 4
    rotated_full = 2 * (16 + 1) * MQA.head_dim * 2  # read + write, q heads + kv head, bf16
    assert (_elementwise_bytes(full, 0, 1, False, False, 2)[0]
            - _elementwise_bytes(quarter, 0, 1, False, False, 2)[0]) == rotated_full * 3 / 4
    with pytest.raises(ConfigError, match="even number"):
        MQA.replace(rotary_fraction=0.2)  # int(16 * 0.2) = 3 dims: rope rotates pairs
    neox = model_config_from_hf(GPT_NEOX_20B, "neox-20b")
    assert (neox.rotary_dims, neox.parallel_block, neox.norm, neox.mlp) == (24, True,
                                                                           "layernorm", "gelu")
    assert count_parameters(neox) == pytest.approx(20.55e9, rel=0.002)


def test_qk_norm_counts_its_weights_and_its_traffic():
    normed = MQA.replace(qk_norm=True)
    assert count_parameters(normed) - count_parameters(MQA) == 2 * MQA.head_dim * MQA.num_layers
    extra = (_elementwise_bytes(normed, 0, 1, False, False, 2)[0]
             - _elementwise_bytes(MQA, 0, 1, False, False, 2)[0])
    assert extra == 2 * (16 + 1) * MQA.head_dim * 2
    qwen3 = model_config_from_hf(QWEN3_8B, "qwen3-8b")
    assert qwen3.qk_norm and count_parameters(qwen3) == pytest.approx(8.2e9, rel=0.01)


def test_tetrads_runtime_refuses_the_shapes_it_does_not_build():
    for change in ({"parallel_block": True}, {"rotary_fraction": 0.5}, {"qk_norm": True}):
        config = MQA.replace(num_kv_heads=16, **change)
        check_layout(config, ParallelConfig(), 64, runtime=False)
        with pytest.raises(ConfigError, match=f"does not build {next(iter(change))}"):
            check_layout(config, ParallelConfig(), 64, runtime=True)
