"""The serving plan's capacity is exact: re-planning at `max_concurrent_sequences` fits, one more
sequence per replica does not, on many models, GPUs, layouts, formats and lengths; and the share of
memory usable is the user's (--gpu-memory-utilization)."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.hardware.profile import cluster
from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
from tetrad.spec.presets import preset

SHAPES = [  # model, gpu, gpus, layout, weights, kv, prompt, output, utilization
    ("llama2-7b", "h100-sxm", 1, ServeLayout(), "bf16", "bf16", 1024, 256, 0.9),
    ("llama2-7b", "rtx-4090", 1, ServeLayout(), "int4", "fp8", 128, 2048, 0.95),
    ("llama2-13b", "h100-sxm", 1, ServeLayout(), "bf16", "bf16", 4096, 1024, 0.9),
    ("llama2-13b", "a100-80gb", 2, ServeLayout(dp=2), "int8", "bf16", 512, 512, 0.8),
    ("llama2-70b", "h100-sxm", 4, ServeLayout(tp=4), "fp8", "fp8", 128, 2048, 0.9),
    ("llama2-70b", "a100-80gb", 8, ServeLayout(tp=4, pp=2), "bf16", "bf16", 2048, 128, 0.92),
    ("llama3-8b", "h100-sxm", 8, ServeLayout(tp=2, dp=4), "bf16", "fp8", 8192, 8192, 0.5),
    ("llama3-8b", "rtx-4090", 2, ServeLayout(tp=2), "bf16", "bf16", 1, 1, 0.9),
    ("qwen2.5-7b", "h100-sxm", 1, ServeLayout(), "fp8", "bf16", 100, 3000, 0.99),
    ("mixtral-8x7b", "h100-sxm", 4, ServeLayout(tp=4, ep=4), "bf16", "bf16", 2000, 500, 0.9),
    ("llama3-70b", "h100-sxm", 8, ServeLayout(tp=8), "fp8", "fp8", 16384, 16384, 0.9),
    ("deepseek-v3", "h200", 16, ServeLayout(tp=8, pp=2, ep=8), "fp8", "bf16", 1024, 1024, 0.9),
]


def _workload(weights, kv, prompt, output, utilization, batch=0):
    return ServeWorkload(context_len=prompt + output, prompt_len=prompt, output_len=output,
                         weight_dtype=weights, kv_dtype=kv, batch=batch,
                         gpu_memory_utilization=utilization)


@pytest.mark.parametrize("model,gpu,gpus,layout,weights,kv,prompt,output,utilization", SHAPES)
def test_replanning_at_the_capacity_fits_and_one_more_does_not(
        model, gpu, gpus, layout, weights, kv, prompt, output, utilization):
    config, world = preset(model), cluster(gpu, gpus)
    planned = evaluate_serving(config, world, layout,
                               _workload(weights, kv, prompt, output, utilization))
    assert planned.usable_memory == pytest.approx(utilization * world.gpu.memory_bytes)
    per_replica, extra = divmod(planned.max_concurrent_sequences, layout.dp)
    assert extra == 0 and per_replica >= 1
    at = evaluate_serving(config, world, layout,
                          _workload(weights, kv, prompt, output, utilization, per_replica))
    over = evaluate_serving(config, world, layout,
                            _workload(weights, kv, prompt, output, utilization, per_replica + 1))
    assert at.fits and at.total_memory <= at.usable_memory
    assert not over.fits and over.total_memory > over.usable_memory
    for estimate in (at, over):  # the capacity does not depend on the batch asked for
        assert estimate.max_concurrent_sequences == planned.max_concurrent_sequences


def test_capacity_follows_the_memory_share():
    config, world = preset("llama2-13b"), cluster("h100-sxm", 1)
    capacities = [evaluate_serving(config, world, ServeLayout(),
                                   _workload("bf16", "bf16", 1024, 1024, share))
                  .max_concurrent_sequences for share in (0.4, 0.6, 0.9, 1.0)]
    assert capacities[0] >= 1 and capacities == sorted(set(capacities))
    assert evaluate_serving(config, world, ServeLayout(),
                            _workload("bf16", "bf16", 1024, 1024, 0.2)).max_concurrent_sequences == 0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.01, float("nan")])
def test_memory_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        _workload("bf16", "bf16", 16, 16, share)


def test_cli_memory_share(capsys):
    args = ["plan", "serve", "--model", "llama2-13b", "--gpu", "h100-sxm", "--num-gpus", "1",
            "--json"]
    outputs = []
    for share in ("0.5", "0.95"):
        assert main(args + ["--gpu-memory-utilization", share]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["configs"][0])
    usable = [o["memory_gib"]["usable"] for o in outputs]
    assert usable[0] / usable[1] == pytest.approx(0.5 / 0.95, rel=1e-3)
    assert outputs[0]["max_concurrent_sequences"] < outputs[1]["max_concurrent_sequences"]
    assert main(args + ["--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err
