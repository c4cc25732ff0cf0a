"""What `tetrad plan` lets users say beyond the layout (issue 32, item 2 and 4): the serving
software generation (--stack), the whole-request figures in the text output, the ranking by
cost, torch.compile, op-level selective recompute and a GPU's power cap."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main
from tetrad.hardware.profile import cluster
from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
from tetrad.planner.stacks import SERVING_REFERENCE, VLLM_053_HOST_SHARE, serving_host_step_s
from tetrad.spec.presets import resolve_model


def _plan(capsys, *argv) -> str:
    main(["plan", *argv])
    return capsys.readouterr().out


def _plan_json(capsys, *argv) -> dict:
    return json.loads(_plan(capsys, *argv, "--json"))


SERVE_70B = ("serve", "--model", "llama3-70b", "--gpu", "h100-sxm", "--num-gpus", "4", "--tp",
             "4", "--prompt-len", "256", "--output-len", "256", "--batch", "64")


def test_the_old_serving_stack_waits_the_blogs_host_share_per_step():
    # On the profiled configuration the host's seconds are 62/38 of the GPU's, so the GPU is
    # busy 38% of each step, as vLLM's blog measured v0.5.3.
    ref = SERVING_REFERENCE
    host = serving_host_step_s("vllm-0.5")
    workload = ServeWorkload(ref["prompt_len"] + ref["output_len"], ref["prompt_len"],
                             ref["output_len"], batch=ref["batch"], host_step_s=host)
    old = evaluate_serving(resolve_model(ref["model"]), cluster(ref["gpu"], 1), ServeLayout(),
                           workload)
    gpu_share = (old.tpot_s - host) / old.tpot_s
    assert gpu_share == pytest.approx(1 / (1 + VLLM_053_HOST_SHARE))
    assert serving_host_step_s("vllm") == 0.0


def test_plan_serve_stack_adds_the_host_step_to_every_engine_step(capsys):
    new = _plan_json(capsys, *SERVE_70B, "--stack", "vllm")["configs"][0]
    old = _plan_json(capsys, *SERVE_70B, "--stack", "vllm-0.5")["configs"][0]
    host = serving_host_step_s("vllm-0.5")
    assert old["tpot_s"] == pytest.approx(new["tpot_s"] + host, rel=1e-3)
    assert old["ttft_s"] == pytest.approx(new["ttft_s"] + host, rel=1e-3)
    # Memory is the same software's business either way.
    assert old["memory_gib"] == new["memory_gib"]
    assert old["decode_tokens_per_s"] < new["decode_tokens_per_s"]


def test_plan_serve_text_prints_the_whole_request_figures(capsys):
    data = _plan_json(capsys, *SERVE_70B)["configs"]
    text = _plan(capsys, *SERVE_70B).splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("whole requests"))
    assert text[start + 1].split()[-4:] == ["output", "tok/s", "total", "tok/s"]
    rows = [line.split() for line in text[start + 3:start + 3 + len(data)]]
    for row, item in zip(rows, data):
        assert [int(cell) for cell in row[:5]] == [item["parallel"][key] for key in (
            "tp", "pp", "dp", "ep")] + [item["batch"]]
        assert float(row[5]) == pytest.approx(item["batch_ttft_s"] * 1e3, abs=0.06)
        assert float(row[6]) == pytest.approx(item["tpot_s"] * 1e3, abs=0.006)
        assert float(row[8]) == pytest.approx(item["output_tokens_per_s"], rel=1e-3)
        assert float(row[9]) == pytest.approx(item["total_tokens_per_s"], rel=1e-3)


TRAIN_8B = ("train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "64", "--top", "4")


def test_training_ranked_by_cost_searches_fewer_gpus_for_fewer_gpu_seconds_per_token(capsys):
    by_time = _plan_json(capsys, *TRAIN_8B)["configs"]
    by_cost = _plan_json(capsys, *TRAIN_8B, "--rank-by", "cost")["configs"]

    def gpu_seconds(item):
        return item["num_gpus"] / item["tokens_per_s"]

    # Ranked on the exact times; the JSON's 4 significant digits may tie or swap neighbours.
    seconds = [gpu_seconds(item) for item in by_cost]
    assert all(first <= second * (1 + 1e-3) for first, second in zip(seconds, seconds[1:]))
    assert gpu_seconds(by_cost[0]) <= gpu_seconds(by_time[0])
    assert by_cost[0]["tokens_per_dollar"] >= by_time[0]["tokens_per_dollar"]
    assert all(item["num_gpus"] == 64 for item in by_time)
    assert {item["num_gpus"] for item in by_cost} - {64}  # some layouts leave GPUs out
    # Each is the time search's own answer on that many GPUs.
    count = by_cost[0]["num_gpus"]
    own = _plan_json(capsys, *TRAIN_8B[:6], str(count), "--top", "1")["configs"][0]
    assert own["parallel"] == by_cost[0]["parallel"]
    assert own["tokens_per_s"] == by_cost[0]["tokens_per_s"]


def test_serving_ranked_by_time_puts_the_shortest_request_first(capsys):
    argv = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "4", "--top", "6")
    by_time = _plan_json(capsys, *argv, "--rank-by", "time")["configs"]
    by_cost = _plan_json(capsys, *argv)["configs"]
    assert [item["request_s"] for item in by_time] == sorted(item["request_s"]
                                                             for item in by_time)
    rates = [item["decode_tokens_per_s"] for item in by_cost]
    assert rates == sorted(rates, reverse=True)
    # Same layouts, two orders.
    assert sorted(map(str, by_time)) == sorted(map(str, by_cost))
    assert by_time[0]["parallel"] != by_cost[0]["parallel"]


def test_a_power_cap_slows_the_tensor_cores_by_the_cube_root_and_leaves_memory_alone():
    from tetrad.hardware.catalog import gpu
    from tetrad.hardware.power import BOARD_POWER_W, power_capped

    h100 = gpu("h100-sxm")
    capped = power_capped(h100, BOARD_POWER_W["h100-sxm"] * 0.5)
    share = 0.5 ** (1 / 3)
    assert all(capped.peak_flops[dtype] == pytest.approx(h100.peak_flops[dtype] * share)
               for dtype in h100.peak_flops)
    for unchanged in ("memory_bandwidth", "memory_bytes", "nvlink_bandwidth", "pcie_bandwidth",
                      "nic_bandwidth", "efficiency", "price_per_hour"):
        assert getattr(capped, unchanged) == getattr(h100, unchanged)


def test_plan_under_a_power_cap(capsys):
    serve = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "1",
             "--batch", "1", "--prompt-len", "2048", "--output-len", "16")
    full = _plan_json(capsys, *serve)["configs"][0]
    half = _plan_json(capsys, *serve, "--gpu-power", "350")["configs"][0]
    # One sequence's decode streams the weights: bandwidth bound, unchanged by the SM clock;
    # a 2048-token prefill is compute bound and slows, by at most the clock's share.
    assert half["tpot_s"] == pytest.approx(full["tpot_s"], rel=0.01)
    assert full["ttft_s"] < half["ttft_s"] <= full["ttft_s"] / 0.5 ** (1 / 3) * 1.001
    train = ("train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8", "--tp",
             "1", "--pp", "1", "--zero", "1", "--micro-batch", "1")
    fast = _plan_json(capsys, *train)["configs"][0]["step_time_s"]["total"]
    slow = _plan_json(capsys, *train, "--gpu-power", "350")["configs"][0]["step_time_s"]["total"]
    assert fast < slow <= fast / 0.5 ** (1 / 3) * 1.001


@pytest.mark.parametrize("gpu, watts, says", [
    ("h100-sxm", "800", "at most the h100-sxm's rated 700 W"),
    ("h100-sxm", "0", "more than 0"),
    ("custom,arch=hopper,hbm=96GB,bw=4TB/s,bf16=148TF,pcie=64GB/s,host=77GB/s", "300",
     "no rated board power known for custom"),
])
def test_a_power_cap_the_gpu_cannot_take_is_refused_in_one_line(capsys, gpu, watts, says):
    assert main(["plan", "train", "--model", "llama3-8b", "--gpu", gpu, "--num-gpus", "8",
                 "--gpu-power", watts]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and says in error


def _train_estimate(workload_fields: dict, recompute: str = "none"):
    from tetrad.planner.layout import TrainLayout
    from tetrad.planner.training import TrainWorkload, evaluate_training

    config = resolve_model("llama3-8b")
    layout = TrainLayout(tp=2, dp=4, zero=1, sequence_parallel=True, recompute=recompute,
                         microbatches=4, micro_batch=1)
    workload = TrainWorkload(seq_len=4096, **workload_fields)
    return config, evaluate_training(config, cluster("h100-sxm", 8), layout, workload)


def test_op_level_recompute_frees_the_norm_and_activation_outputs_counted():
    config, plain = _train_estimate({})
    tokens, h, ffn, act = 4096, config.hidden_size, config.ffn_hidden_size // 2, 2
    layers = config.num_layers  # pp 1: the one stage holds every block
    _, norm = _train_estimate({"recompute_ops": ("norm",)})
    _, both = _train_estimate({"recompute_ops": ("norm", "activation")})
    # Two norm outputs per block, split over tp by sequence parallelism; one ffn-wide
    # activation output (SwiGLU's silu(gate) * up) per block on this rank's columns.
    freed_norm = layers * tokens * 2 * h * act / 2
    freed_activation = layers * tokens * ffn * act
    # Without a pipeline one microbatch's activations are alive at the peak.
    assert plain.memory.activations - norm.memory.activations == pytest.approx(freed_norm)
    assert norm.memory.activations - both.memory.activations == pytest.approx(freed_activation)


def test_op_level_recompute_sits_between_selective_and_full():
    from tetrad.planner.compute import bandwidth_time

    config, selective = _train_estimate({}, "selective")
    _, ops = _train_estimate({"recompute_ops": ("norm", "activation")}, "selective")
    _, full = _train_estimate({}, "full")
    assert full.memory.activations < ops.memory.activations < selective.memory.activations
    assert selective.step.total < ops.step.total < full.step.total
    # The extra time is the recomputed kernels' traffic: two norms read and write h (split
    # over tp by sequence parallelism), SwiGLU reads gate and up and writes its product.
    gpu = cluster("h100-sxm", 8).gpu
    tokens, per_token = 4096, 2 * 2 * config.hidden_size * 2 / 2 + 3 * config.ffn_hidden_size
    per_block = bandwidth_time(gpu, tokens * per_token, 3)
    microbatches = ops.layout.num_microbatches
    assert ops.step.compute - selective.step.compute == pytest.approx(
        per_block * config.num_layers * microbatches, rel=1e-6)


def test_compile_counts_fused_kernels_and_rematerialized_pointwise_outputs(capsys):
    argv = ("train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8", "--tp",
            "2", "--pp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "none",
            "--stack", "tetrad")
    eager = _plan_json(capsys, *argv)
    compiled = _plan_json(capsys, *argv, "--compile")
    assert compiled["stack"]["runtime"] == "megatron" and compiled["stack"]["compiled"]
    assert compiled["recompute_ops"] == ["activation", "norm"]
    fused = _plan_json(capsys, *argv[:-1], "megatron", "--recompute-ops", "norm,activation")
    # The same bytes as the fused stack recomputing the same ops; fewer than eager's.
    assert compiled["configs"][0]["memory_gib"] == fused["configs"][0]["memory_gib"]
    assert (compiled["configs"][0]["memory_gib"]["activations"]
            < eager["configs"][0]["memory_gib"]["activations"])
    # Inductor recomputes inside kernels the backward runs anyway: no time of their own (against
    # the eager stack of the same attention kernel and TP, recomputing them as kernels).
    titan = _plan_json(capsys, *argv[:-1], "torchtitan", "--recompute-ops", "norm,activation")
    assert (compiled["configs"][0]["step_time_s"]["total"]
            < titan["configs"][0]["step_time_s"]["total"])


def test_recompute_ops_refused_in_one_line_where_they_cannot_run(capsys):
    base = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8"]
    for extra, says in ((["--recompute-ops", "norm,softmax"], "unknown op 'softmax'"),
                        (["--recompute-ops", "norm", "--stack", "tetrad"], "add --compile")):
        assert main([*base, *extra]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and says in error


def test_plan_serve_text_when_nothing_fits_prices_nothing(capsys):
    assert main(["plan", "serve", "--model", "llama2-13b", "--gpu", "rtx-4090", "--num-gpus",
                 "1"]) == 1
    out = capsys.readouterr().out
    assert "cost: no output tokens to price: nothing fits" in out
    assert "whole requests" in out


def _served(**fields):
    workload = ServeWorkload(1024 + 256, 1024, 256, **fields)
    return evaluate_serving(resolve_model("llama3-8b"), cluster("h100-sxm", 2),
                            ServeLayout(dp=2), workload)


def test_a_request_rate_runs_the_smallest_batch_that_carries_it_by_littles_law():
    rate = 20.0  # over both replicas: 10 a second each
    steady = _served(request_rate=rate)
    assert steady.fits and steady.batch > 1
    prefill = steady.ttft_s  # one prompt on an idle replica
    busy = rate / 2 * prefill

    def step(batch):  # a static batch's decode step, stretched by the arriving prompts
        return _served(batch=batch).tpot_s / (1 - busy)

    assert steady.tpot_s == pytest.approx(step(steady.batch))
    # Little's law: the running batch holds rate x output_len x step sequences; one fewer
    # would not carry the rate.
    assert rate / 2 * 256 * step(steady.batch) <= steady.batch
    assert rate / 2 * 256 * step(steady.batch - 1) > steady.batch - 1
    # So the server delivers the offered output tokens, up to the batch's rounding.
    offered = rate * 256
    assert offered <= steady.output_tokens_per_s <= offered * steady.batch / (steady.batch - 1)
    # A request's first token: half a step's wait, then a step with its prefill.
    assert steady.batch_ttft_s == pytest.approx(0.5 * steady.tpot_s + prefill
                                                + _served(batch=steady.batch).tpot_s)


def test_a_rate_beyond_the_server_does_not_fit(capsys):
    # Prompts arriving faster than one replica can prefill them.
    assert not _served(request_rate=2.5 / _served(batch=1).ttft_s).fits
    assert main(["plan", "serve", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus",
                 "1", "--request-rate", "5", "--batch", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "replaces --batch" in error


def test_plan_serve_text_at_a_request_rate(capsys):
    argv = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "2",
            "--request-rate", "20")
    data = _plan_json(capsys, *argv)
    assert data["request_rate"] == 20
    text = _plan(capsys, *argv)
    assert "20 requests/s in continuous batching" in text
    best = data["configs"][0]
    row = next(line.split() for line in text.splitlines()[text.splitlines().index(next(
        line for line in text.splitlines() if line.startswith("whole requests"))) + 3:])
    assert int(row[4]) == best["batch"]
    assert float(row[8]) == pytest.approx(best["output_tokens_per_s"], rel=1e-3)
