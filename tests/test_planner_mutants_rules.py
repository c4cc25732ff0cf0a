"""Layout rules against brute force and against what each side needs: the planner (any
sequence length a rotary model can extrapolate to, kv heads as the published stacks split them)
and tetrad's runtime (whole kv heads per rank, even vocabulary and MLP splits)."""

from __future__ import annotations

import pytest

from tetrad.spec.model import ParallelConfig
from tetrad.errors import ConfigError
from tetrad.planner.rules import (check_degrees, check_layout, check_tensor_parallel, divisors,
                                  tp_fits, valid_tp_degrees)
from tetrad.spec.presets import preset


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 360, 1024, 1001])
def test_divisors_are_every_divisor_in_order(n):
    every = [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(n) == every
    for limit in (1, 5, 6, 19, 31, 32, n - 1, n, 2 * n):
        if limit >= 1:
            assert divisors(n, limit) == [d for d in every if d <= limit]


def test_kv_heads_split_or_replicate():
    llama = preset("llama3-8b")  # 32 query heads, 8 kv heads
    assert tp_fits(llama, 8) and tp_fits(llama, 4)
    assert tp_fits(llama, 16)  # each kv head on two ranks (tetrad's runtime)
    assert not tp_fits(llama, 16, kv_replicas=False)
    assert not tp_fits(llama, 3)  # 32 heads do not split three ways
    # Serving replicates kv heads (vLLM) and the planner leaves the vocabulary alone.
    assert tp_fits(llama, 16, training=False, kv_replicas=False, runtime=False)
    assert valid_tp_degrees(llama, training=False) == [1, 2, 4, 8, 16, 32]
    assert valid_tp_degrees(llama, kv_replicas=False, runtime=False) == [1, 2, 4, 8]
    assert valid_tp_degrees(llama, kv_replicas=True, runtime=False) == [1, 2, 4, 8, 16, 32]


def test_the_runtime_needs_even_vocabulary_and_mlp_splits():
    gpt = preset("gpt3-175b")  # vocabulary 50257 = 29 x 1733: odd
    assert tp_fits(gpt, 8, runtime=False)
    assert not tp_fits(gpt, 8)
    with pytest.raises(ConfigError, match="vocab_size 50257"):
        check_tensor_parallel(gpt, 8)
    check_tensor_parallel(gpt, 8, runtime=False)
    small = preset("small").replace(vocab_size=512, ffn_hidden_size=684)  # 4 x 171 units
    with pytest.raises(ConfigError, match="ffn_hidden_size 684"):
        check_tensor_parallel(small, 8)
    assert tp_fits(small, 4) and tp_fits(small, 8, runtime=False)
    with pytest.raises(ConfigError, match="not a multiple of 4"):
        check_tensor_parallel(small, 4, sequence_parallel=True, seq_len=66)
    check_tensor_parallel(small, 4, sequence_parallel=True, seq_len=64)
    check_tensor_parallel(small, 1, sequence_parallel=True, seq_len=63)


def test_sequence_longer_than_the_model_refused_where_positions_run_out():
    rope, learned = preset("small"), preset("gpt3-175b")
    check_layout(rope, ParallelConfig(), 2 * rope.max_seq_len, runtime=False)
    with pytest.raises(ConfigError, match="longer than the model's max_seq_len"):
        check_layout(rope, ParallelConfig(), 2 * rope.max_seq_len)
    with pytest.raises(ConfigError, match="longer than the model's max_seq_len"):
        check_layout(learned, ParallelConfig(), 4096, runtime=False)
    check_layout(learned, ParallelConfig(), 2048, runtime=False)
    check_layout(rope, ParallelConfig(), rope.max_seq_len)


def test_pipeline_only_flags_without_a_pipeline():
    small = preset("small")
    with pytest.raises(ConfigError, match="--pp is 1"):
        check_layout(small, ParallelConfig(microbatches=4), 128)
    check_layout(small, ParallelConfig(microbatches=4), 128, runtime=False)
    check_layout(small, ParallelConfig(pp=2, microbatches=4), 128)
    with pytest.raises(ConfigError, match="--tp is 1"):
        check_layout(small, ParallelConfig(sequence_parallel=True), 128)
    check_layout(small, ParallelConfig(sequence_parallel=True), 128, runtime=False)
    check_layout(small, ParallelConfig(tp=2, sequence_parallel=True), 128)


def test_degrees_bounded_by_layers_and_experts():
    small = preset("small")  # 6 layers
    check_degrees(small, 1, 6, 1)
    with pytest.raises(ConfigError, match="more than the model's 6 layers"):
        check_degrees(small, 1, 7, 1)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_degrees(small, 1, 1, 2)
    moe = preset("tiny-moe")
    check_degrees(moe, 1, 1, moe.num_experts)
    with pytest.raises(ConfigError, match="does not divide num_experts"):
        check_degrees(moe, 1, 1, moe.num_experts + 1)
