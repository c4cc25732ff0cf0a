"""The layout search's parameter offload and √N checkpointing: a model whose states do not fit its
GPUs gets a plan with ZeRO-3's parameter shard on the host, a model too deep for full
recomputation gets one with --recompute sqrt; each fits by the planner's own count, and the same
layout without the option does not. Offload is tried only where it spares recomputation."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.hardware.profile import cluster
from tetrad.planner.memory import training_memory
from tetrad.planner.offload_time import offload_time
from tetrad.planner.search import TrainSpace, search_training
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

ONE_4090 = cluster("rtx-4090", 1)
SHORT = TrainWorkload(seq_len=2048)
# Deep and thin: 900 blocks keep 900 hidden states under full recomputation, 30 under sqrt.
DEEP = ModelConfig(name="deep", vocab_size=32000, hidden_size=256, num_layers=900, num_heads=8,
                   num_kv_heads=8, ffn_hidden_size=1024, max_seq_len=32768)


def device_bytes(config, layout, workload) -> float:
    memory, _ = training_memory(config, layout, workload.precision, workload.seq_len,
                                workload.activation_options)
    return memory.total


def test_a_model_over_one_gpu_gets_a_plan_with_its_parameters_on_the_host():
    config = preset("llama3-8b")
    without = search_training(config, ONE_4090, SHORT, 8, TrainSpace(offload_mode="none"))
    optimizer_only = search_training(config, ONE_4090, SHORT, 8,
                                     TrainSpace(offload_mode="optimizer"))
    assert without.num_fitting == optimizer_only.num_fitting == 0
    result = search_training(config, ONE_4090, SHORT, 8)
    assert result.num_fitting > 0
    for estimate in result.ranked:
        layout = estimate.layout
        assert layout.offload_mode == "params" and layout.zero == 3
        assert estimate.fits and estimate.memory.total <= ONE_4090.gpu.memory_bytes
        assert estimate.memory.total == device_bytes(config, layout, SHORT)
        # The parameter shard, its gradients and optimizer state left the device.
        assert estimate.memory.grads == estimate.memory.optimizer == 0
        assert estimate.memory.params == estimate.memory.params_gathered > 0
        on_device = dataclasses.replace(layout, offload=False, offload_mode="none")
        assert device_bytes(config, on_device, SHORT) > estimate.usable_memory
    tokens_per_s = [estimate.tokens_per_s for estimate in result.ranked]
    assert tokens_per_s == sorted(tokens_per_s, reverse=True)


def test_parameter_offload_costs_its_host_transfers_in_the_step():
    config = preset("llama3-8b")
    best = search_training(config, ONE_4090, SHORT, 8).ranked[0]
    optimizer = dataclasses.replace(best.layout, offload_mode="optimizer")
    kept = evaluate_training(config, ONE_4090, optimizer, SHORT)
    # The shards' copies to and from the host, exposed, on top of what the layout sends.
    copies = offload_time(config, best.layout, SHORT.precision, ONE_4090.gpu,
                          best.fullest_stage)
    assert copies > 0
    assert best.step.communication_exposed == pytest.approx(
        kept.step.communication_exposed + copies, rel=1e-12)
    assert best.step.bubble == kept.step.bubble


def test_offload_only_where_it_spares_recomputation():
    """8B on 16 H100s fits without recomputation: nothing is offloaded."""
    result = search_training(preset("llama3-8b"), cluster("h100-sxm", 16),
                             TrainWorkload(seq_len=4096), 256)
    assert result.num_fitting > 0
    assert {e.layout.offload_mode for e in result.ranked} == {"none"}
    assert {e.layout.recompute for e in result.ranked} == {"none"}


def test_a_model_too_deep_for_full_recomputation_gets_sqrt():
    world, workload = cluster("h100-sxm", 8), TrainWorkload(seq_len=32768)
    space = TrainSpace(dp=8, micro_batch=4, offload_mode="none")
    result = search_training(DEEP, world, workload, 32, space)
    assert result.num_fitting > 0
    best = result.ranked[0]
    assert best.layout.recompute == "sqrt" and best.fits
    assert best.memory.total == device_bytes(DEEP, best.layout, workload)
    full = dataclasses.replace(best.layout, recompute="full")
    assert device_bytes(DEEP, full, workload) > best.usable_memory
    # sqrt reruns what full reruns: the same step.
    assert evaluate_training(DEEP, world, full, workload).step == best.step


def test_the_text_plan_names_the_offload(capsys):
    code = main(["plan", "train", "--model", "llama3-8b", "--gpu", "rtx-4090", "--num-gpus", "1",
                 "--global-batch", "8", "--seq-len", "2048", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0
    header, _, first = out.splitlines()[3:6]
    assert first.split()[header.split().index("offload")] == "params"
    assert main(["plan", "train", "--model", "llama3-8b", "--gpu", "rtx-4090", "--num-gpus", "1",
                 "--global-batch", "8", "--seq-len", "2048", "--offload", "none"]) == 1


@pytest.mark.parametrize("space,message", [
    (TrainSpace(zero=1, offload_mode="params"), "--offload params moves ZeRO-3's parameter"),
    (TrainSpace(zero=0, offload_mode="optimizer"), "--offload needs a ZeRO stage"),
    (TrainSpace(offload_mode="disk"), "offload"),
])
def test_offload_given_against_the_zero_stage_is_refused(space, message):
    with pytest.raises(ConfigError, match=message):
        search_training(preset("llama3-8b"), cluster("h100-sxm", 8), SHORT, 8, space)
