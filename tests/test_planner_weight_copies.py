"""FSDP2 under pipeline parallelism (planner.weight_copies): each stage's parameters stay
gathered all step and its gradients accumulate unsharded in fp32, with one gather and one
reduce-scatter a step; counted element by element against the stage's parameters."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.hardware.catalog import Cluster
from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import stage_memory, stage_params
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.spec.presets import preset

CONFIG = preset("llama3-8b")
CLUSTER = Cluster(catalog_gpu("h100-sxm"), 16)
LAYOUT = TrainLayout(tp=2, pp=2, dp=4, zero=3, micro_batch=1, microbatches=8, recompute="full",
                     sequence_parallel=False)  # TP all-reduces: no all-gather but ZeRO's
SEQ = 2048


def _estimate(layout: TrainLayout, whole: bool, dtype: str = "bf16"):
    workload = TrainWorkload(SEQ, dtype=dtype, zero3_whole_stage_under_pp=whole)
    return evaluate_training(CONFIG, CLUSTER, layout, workload), workload


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_stage_kept_whole_holds_its_parameters_and_fp32_gradients(dtype):
    _, base = _estimate(LAYOUT, False, dtype)
    whole, work = _estimate(LAYOUT, True, dtype)
    stage = whole.fullest_stage
    elements = sum(stage_params(CONFIG, 2, stage, 2, 1))
    before = stage_memory(CONFIG, LAYOUT, base.precision, SEQ, base.activation_options, stage)
    after = stage_memory(CONFIG, LAYOUT, work.precision, SEQ, work.activation_options, stage)
    two_blocks = before.params_gathered
    assert after.params_gathered == pytest.approx(elements * 2)
    assert after.grads == pytest.approx(elements * 4)
    fp8_copies = 0.0
    if dtype == "fp8":  # the block linears' copies, all of the stage's now, two blocks' before
        fp8_copies = (after.params - after.params_gathered) - (before.params - two_blocks)
        assert fp8_copies > 0
    assert after.params - fp8_copies == pytest.approx(before.params - two_blocks
                                                      + elements * 2)
    assert after.optimizer == before.optimizer and after.activations == before.activations


def test_stage_kept_whole_gathers_and_reduces_once_a_step():
    sharded, _ = _estimate(LAYOUT, False)
    whole, _ = _estimate(LAYOUT, True)
    calls, calls_sharded = whole.comm.calls_by_kind(), sharded.comm.calls_by_kind()
    m = LAYOUT.num_microbatches
    assert calls["all_gather"] == 1 and calls["reduce_scatter"] == 1
    assert calls_sharded["all_gather"] == 2 * m and calls_sharded["reduce_scatter"] == m


def test_without_a_pipeline_fsdp_reshards_as_before():
    flat = dataclasses.replace(LAYOUT, pp=1, dp=8)
    assert _estimate(flat, True)[0].memory == _estimate(flat, False)[0].memory
