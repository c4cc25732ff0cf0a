"""The planner's mechanisms for issue 32's optimism patterns, each against a case worked by hand
from its source: fused attention's measured forward and backward shares by call length
(benchmarks/gpu_attention_efficiency.py), the load-balanced ring of context parallelism and its
per-step merges (Transformer Engine's p2p context parallelism), the FP8 weight copies fp8
training keeps (Transformer Engine's docs)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner.compute import (ATTENTION_REFERENCE, attention_efficiencies,
                                    attention_times, ring_attention_calls)
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import model_state_bytes
from tetrad.planner.precision import training_precision
from tetrad.spec.presets import preset

H100 = catalog_gpu("h100-sxm")
LLAMA8B = preset("llama3-8b")  # 32 heads, 8 KV heads, head dim 128


def test_a_long_causal_call_runs_the_backward_below_the_forward():
    """At 8K tokens cuDNN measured 0.644 of peak forward and 0.494 backward; the profile's
    level stands for the 32K-64K forward, (0.614 + 0.618) / 2."""
    level = H100.efficiency.attention
    assert ATTENTION_REFERENCE["vendor"] == pytest.approx(0.616)
    forward, backward = attention_efficiencies(H100, False, True, 8192)
    assert forward == pytest.approx(level * 0.644 / 0.616)
    assert backward == pytest.approx(level * 0.494 / 0.616)
    portable = H100.efficiency.portable_attention
    forward, backward = attention_efficiencies(H100, True, True, 8192)
    assert forward == pytest.approx(portable * 0.348 / 0.343)
    assert backward == pytest.approx(portable * 0.301 / 0.343)


def test_a_call_between_measured_lengths_is_read_in_log_length():
    level = H100.efficiency.attention
    # 2048 * sqrt(2) lies halfway between 2K and 4K in log2.
    forward, backward = attention_efficiencies(H100, False, False, 2048 * math.sqrt(2))
    assert forward == pytest.approx(level * (0.662 + 0.672) / 2 / 0.616)
    assert backward == pytest.approx(level * (0.486 + 0.507) / 2 / 0.616)
    # Shorter than 1K and longer than 64K hold the ends.
    assert attention_efficiencies(H100, False, True, 256) == attention_efficiencies(
        H100, False, True, 1024)
    assert attention_efficiencies(H100, False, True, 2**20) == attention_efficiencies(
        H100, False, True, 65536)


def test_a_calibrated_profile_keeps_its_own_attention_flat():
    calibrated = dataclasses.replace(H100, efficiency=dataclasses.replace(
        H100.efficiency, matmul_curve=((1e9, 0.5), (1e12, 0.7)), attention=0.45))
    assert attention_efficiencies(calibrated, False, True, 1024) == (0.45, 0.45)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balanced_ring_steps_do_equal_work(cp):
    """Counting query-key pairs of the 2cp-chunk assignment (rank r holds chunks r and
    2cp-1-r) step by step: every rank does the same work, every step 1/cp of it, step 0 the
    causal diagonal, the others full blocks of one chunk against two or two against one."""
    c = 16  # tokens per chunk
    chunks = lambda rank: (rank, 2 * cp - 1 - rank)  # noqa: E731
    totals = set()
    for rank in range(cp):
        per_step = []
        for step in range(cp):
            source = (rank - step) % cp  # the K/V the ring brings at this step
            pairs = 0
            for q_chunk in chunks(rank):
                for k_chunk in chunks(source):
                    for q in range(q_chunk * c, q_chunk * c + c):
                        pairs += sum(1 for k in range(k_chunk * c, k_chunk * c + c) if k <= q)
            per_step.append(pairs)
        assert len(set(per_step[1:])) == 1
        assert per_step[1] == 2 * c * c  # a full block of 2c x c
        totals.add(sum(per_step))
    assert len(totals) == 1
    # ...which ring_attention_calls states: 1/cp causal over the rank's 2c tokens, the rest
    # full calls of the area 2c x c, read as a square of side c * sqrt(2).
    (share0, causal0, length0), (share, causal, length) = ring_attention_calls(2 * cp * c, cp)
    assert (share0, causal0, length0) == (pytest.approx(1 / cp), True, 2 * c)
    assert (share, causal) == (pytest.approx((cp - 1) / cp), False)
    assert length * length == pytest.approx(2 * c * c)


def test_ring_attention_time_by_hand():
    """Llama 3 8B, 32K tokens over cp 8 on an H100, tp 1, micro batch 1: 4K tokens a rank. FLOPs
    per rank: 2 x 32 heads x (128 + 128) x 32768 x 32769 / 2 / 8; 1/8 of them causal over 4096
    tokens, 7/8 full at 2048 * sqrt(2) (halfway between 2K and 4K). Seven merges: forward
    3 x 4096 x 32 x 128 x 2 bytes each, backward 3 x 4096 x (32 x 128 + 8 x 256) x 2."""
    gpu = H100
    eff = gpu.efficiency
    s, cp = 32768, 8
    flops = 2 * 32 * 256 * s * (s + 1) / 2 / cp
    peak = gpu.peak("bf16")
    scale = eff.attention / 0.616
    causal_f, causal_b = 0.617 * scale, 0.459 * scale
    full_f, full_b = (0.662 + 0.672) / 2 * scale, (0.486 + 0.507) / 2 * scale
    stream = gpu.memory_bandwidth * eff.memory
    tokens = s // cp
    forward = (flops / 8 / (peak * causal_f) + flops * 7 / 8 / (peak * full_f)
               + 7 * (3 * tokens * 32 * 128 * 2 / stream + eff.kernel_overhead_s)
               + cp * eff.kernel_overhead_s)
    backward = (2.5 * flops / 8 / (peak * causal_b) + 2.5 * flops * 7 / 8 / (peak * full_b)
                + 7 * (3 * tokens * (32 * 128 + 8 * 256) * 2 / stream
                       + 2 * eff.kernel_overhead_s)
                + 2 * cp * eff.kernel_overhead_s)
    got = attention_times(LLAMA8B, gpu, 1, s, 1, cp, True, False, 2.0)
    assert got == (pytest.approx(forward), pytest.approx(backward))
    # The same tokens without cp, one causal call at 32K per GPU-equivalent of work, run faster
    # per FLOP: the ring's short calls and merges are what cp costs beyond its traffic.
    whole = attention_times(LLAMA8B, gpu, 1, s, 1, 1, True, False, 2.0)
    assert whole[0] / cp < got[0] and whole[1] / cp < got[1]


def test_fp8_training_holds_each_block_linears_fp8_copy_and_its_transpose():
    """Llama 3 70B, tp 4, pp 8 (10 blocks a stage), ZeRO-1: a block's matmul weights are
    q and o 8192 x 8192, k and v 8192 x 1024, gate, up and down 8192 x 28672; a GPU holds a
    quarter of each, and in fp8 training one byte row-wise plus one byte transposed of every
    one of them beside what bf16 training holds."""
    config = preset("llama3-70b")
    layout = TrainLayout(tp=4, pp=8, dp=2, zero=1, sequence_parallel=True)
    per_block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    bf16, fp8 = training_precision("bf16"), training_precision("fp8")
    copies = 10 * per_block / 4 * 2
    for stage in (0, 7):
        with_copies = model_state_bytes(config, layout, fp8, stage)
        without = model_state_bytes(config, layout, bf16, stage)
        assert with_copies[0] - without[0] == pytest.approx(copies)
        assert with_copies[1:] == without[1:]
    # Under ZeRO-3 only the two gathered blocks are cast: two whole blocks over tp, 2 bytes each
    # (each block's norms are in the gathered units too, and cast with them).
    zero3 = TrainLayout(tp=4, pp=8, dp=2, zero=3, sequence_parallel=True)
    block = per_block + 2 * 8192  # and its two RMSNorm weights
    gathered = model_state_bytes(config, zero3, fp8, 0)[0] - model_state_bytes(
        config, zero3, bf16, 0)[0]
    assert gathered == pytest.approx(2 * block / 4 * 2)
