"""What users need to say to the planner (issue 32, item 2): multi-query attention under tensor
parallelism (each KV head replicated, counted), and one sequence-length rule with or without
context parallelism."""

from __future__ import annotations

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.profile import cluster
from tetrad.planner import TrainSpace, TrainWorkload, plan_training, predict_training
from tetrad.planner.flops import layer_gemms
from tetrad.planner.layout import TrainLayout, check_training_layout
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.rules import valid_tp_degrees
from tetrad.planner.model_stats import count_parameters, kv_replica_params
from tetrad.spec.model import ModelConfig, ParallelConfig

# StarCoder-like multi-query attention: 16 query heads, one KV head.
MQA = ModelConfig(name="mqa", vocab_size=512, hidden_size=256, num_layers=4, num_heads=16,
                  num_kv_heads=1, ffn_hidden_size=1024, max_seq_len=128)


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
