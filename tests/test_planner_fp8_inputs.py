"""Transformer Engine's FP8 linears save their inputs in FP8 (planner.fp8_inputs): the block's
kept bytes change by exactly those tensors, and the published Megatron FP8 runs fit again."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.published_runs import _megatron_bridge, workload
from tetrad.hardware.profile import cluster
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import ActivationOptions, activation_bytes_per_layer
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.spec.presets import preset

TOKENS, TP = 4096, 4


def _kept(config, layer, options, recompute="none"):
    return activation_bytes_per_layer(config, layer, 1, TOKENS, TP, 1, True, recompute,
                                      options, 2.0)


def test_dense_block_keeps_fp8_copies_of_its_linear_inputs():
    config = preset("llama3-70b")
    bf16, fp8 = ActivationOptions(), ActivationOptions(fp8_saved_inputs=True)
    h, ffn = config.hidden_size, config.ffn_hidden_size
    # QKV and up-projection inputs (sequence-parallel, so split over tp) drop a byte each, the
    # down projection's input drops one, the output projection's gains an FP8 copy.
    change = -2 * h / TP - ffn / TP + config.num_heads // TP * config.head_dim
    assert _kept(config, 0, fp8) - _kept(config, 0, bf16) == pytest.approx(TOKENS * change)
    both = ("norm", "activation")  # recomputed: nothing of theirs is kept to cast
    recomputed = ActivationOptions(recompute_ops=both)
    cast = ActivationOptions(recompute_ops=both, fp8_saved_inputs=True)
    assert _kept(config, 0, cast) - _kept(config, 0, recomputed) == pytest.approx(
        TOKENS * config.num_heads // TP * config.head_dim)
    full = _kept(config, 0, fp8, "full")
    assert full == _kept(config, 0, bf16, "full")  # only the block input: a 16-bit residual


def test_moe_block_casts_each_routed_copy():
    config = preset("deepseek-v3")
    layer = config.num_dense_layers
    bf16, fp8 = ActivationOptions(), ActivationOptions(fp8_saved_inputs=True)
    ffn = config.moe_ffn_hidden_size // TP
    routed = config.num_experts_per_token * (config.hidden_size / TP + ffn)
    change = (-2 * config.hidden_size / TP + config.num_heads // TP * config.v_head_dim
              - routed - ffn * config.num_shared_experts)
    assert _kept(config, layer, fp8) - _kept(config, layer, bf16) == pytest.approx(
        TOKENS * change)


def test_only_fp8_training_casts():
    work = TrainWorkload(TOKENS, dtype="bf16", fp8_saved_inputs=True)
    assert not work.activation_options.fp8_saved_inputs
    assert dataclasses.replace(work, dtype="fp8").activation_options.fp8_saved_inputs


@pytest.mark.parametrize("run", _megatron_bridge(), ids=lambda run: run.name)
def test_published_megatron_fp8_runs_fit(run):
    given = dict(run.layout, dp=run.num_gpus // (run.layout["tp"] * run.layout["pp"]
                                                 * run.layout["cp"]))
    layout = TrainLayout(**given, microbatches=run.global_batch // given["dp"])
    world = cluster(run.gpu, run.num_gpus)
    assert evaluate_training(run.config, world, layout, workload(run)).fits
