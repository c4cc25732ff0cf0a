"""What `tetrad plan` prints and what the trainer is told, against their definitions: the JSON's
numbers from the estimate they report (GiB, days, GPU-hours, FLOPs), the advice's fixes each
re-evaluated, the default batch's 4M tokens, the stacks as docs/planner.md's table states them,
and the prediction API's keys and defaults."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GiB
from tetrad.hardware.profile import cluster
from tetrad.planner import (TrainSpace, TrainWorkload, plan_serving, plan_training,
                            predict_training)
from tetrad.planner.layout import TrainLayout
from tetrad.planner.model_stats import count_parameters
from tetrad.planner.report import (default_global_batch, serving_fit_advice, serving_json,
                                   training_config_json, training_fit_advice, training_json,
                                   training_text)
from tetrad.planner.search import ServeSpace, search_serving, search_training
from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
from tetrad.planner.stacks import DEFAULT_STACK, STACKS, stack_fields
from tetrad.planner.training import evaluate_training
from tetrad.spec.model import ParallelConfig
from tetrad.spec.presets import preset

DOCS = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
WORKLOAD = TrainWorkload(seq_len=4096)


def _four_digits(value: float) -> float:
    return float(f"{value:.4g}")


def test_json_memory_is_the_estimate_in_gib_and_the_zero_paper_states_leave_out_gathers():
    world = cluster("h100-sxm", 8)
    layout = TrainLayout(tp=2, dp=4, zero=3, micro_batch=1, microbatches=4)
    estimate = evaluate_training(preset("llama3-8b"), world, layout, WORKLOAD)
    memory = estimate.memory
    out = training_config_json(estimate)
    assert out["memory_gib"]["total"] == round(memory.total / GiB, 3)
    assert out["memory_gib"]["usable"] == round(estimate.usable_memory / GiB, 3)
    assert out["memory_gib"]["params_gathered"] == round(memory.params_gathered / GiB, 3) > 0
    assert out["memory_gib"]["model_states_formula"] == round(
        (memory.params + memory.grads + memory.optimizer - memory.params_gathered) / GiB, 3)
    assert out["tokens_per_s"] == _four_digits(estimate.tokens_per_s)
    assert out["mfu"] == float(f"{estimate.mfu:.3g}")
    assert "days" not in out and "gpu_hours" not in out


def test_a_token_budget_gives_days_and_gpu_hours_at_the_best_speed():
    """A budget of 2.00051 days at the best layout's speed: 2.001 days to 4 digits, and 24 GPU
    hours a day on each GPU."""
    config, world = preset("llama3-8b"), cluster("h100-sxm", 8)
    result = search_training(config, world, WORKLOAD, 64, TrainSpace(tp=2, pp=1), top=2)
    best = result.ranked[0]
    tokens = best.tokens_per_s * 2.00051 * 86400
    out = training_json(config, world, WORKLOAD, 64, result, tokens=tokens)
    first = out["configs"][0]
    assert first["days"] == 2.001
    assert first["gpu_hours"] == _four_digits(2.00051 * 24 * 8)
    per_token = best.model_flops_per_step / best.tokens_per_step
    assert out["total_flops"] == _four_digits(per_token * tokens)
    assert out["total_flops_6nd"] == _four_digits(6 * count_parameters(config) * tokens)
    plain = training_json(config, world, WORKLOAD, 64, result)
    assert not {"tokens", "total_flops", "total_flops_6nd"} & set(plain)
    alone = search_training(config, world, WORKLOAD, 64, TrainSpace(tp=2, pp=1), top=1)
    assert training_json(config, world, WORKLOAD, 64, alone, tokens)["total_flops"] == \
        out["total_flops"]


def test_text_summary_describes_the_first_layout():
    config, world = preset("llama3-8b"), cluster("h100-sxm", 8)
    result = search_training(config, world, WORKLOAD, 64, top=3)
    data = training_json(config, world, WORKLOAD, 64, result)
    assert len({c["memory_gib"]["total"] for c in data["configs"]}) > 1
    text = training_text(config, world, WORKLOAD, 64, result).splitlines()
    best = data["configs"][0]["memory_gib"]
    summary = next(line for line in text if line.startswith("best layout"))
    assert f"total {best['total']:.1f} of {best['usable']:.1f} usable" in summary
    rows = text[5:5 + len(result.ranked)]
    assert [row.split()[:3] for row in rows] == [
        [str(c["parallel"][k]) for k in ("tp", "pp", "dp")] for c in data["configs"]]
    # under each column a rule as wide as it, every line right-aligned to the same width
    assert len(text[4].split()) == len(rows[0].split())
    assert {len(line) for line in [text[3], *rows]} == {len(text[4])}


def _fixes(advice: str) -> dict[str, float]:
    line = next((line for line in advice.splitlines() if line.startswith("it would fit")), "")
    fixes = [re.fullmatch(r"(.+) \(([0-9.]+) GiB\)", fix).groups()
             for fix in line.removeprefix("it would fit with ").split(", or ") if fix]
    return {flag: float(gib) for flag, gib in fixes}


def _changes(layout: TrainLayout) -> dict[str, dict]:
    """Every single change the advice may suggest (the most memory-saving setting of each knob
    it names), each applied to `layout`, and all of them together."""
    order = ("none", "selective", "full", "sqrt")
    single = {f"--zero {z}": dict(zero=z) for z in range(layout.zero + 1, 4)}
    single.update({f"--recompute {r}": dict(recompute=r) for r in order
                   if order.index(r) > order.index(layout.recompute)})
    if layout.tp > 1 and not layout.sequence_parallel:
        single["--sequence-parallel"] = dict(sequence_parallel=True)
    if layout.micro_batch > 1:
        single["--micro-batch 1"] = dict(micro_batch=1,
                                         microbatches=layout.microbatches * layout.micro_batch)
    if layout.zero >= 1 and not layout.offload:
        single["--offload optimizer"] = dict(offload_mode="optimizer")
    if layout.zero == 3 and layout.offload_mode not in ("params", "nvme"):
        single["--offload params"] = dict(offload_mode="params")
    together: dict = {}
    knobs: dict[str, str] = {}  # each knob once, at its last (most saving) setting
    for flag, change in single.items():
        together.update(change)
        knobs[next(iter(change))] = flag
    return {**single, **({" ".join(knobs.values()): together} if len(knobs) > 1 else {})}


@pytest.mark.parametrize("name,n,layout", [
    ("llama3-70b", 16, TrainLayout(tp=8, dp=2, zero=0, micro_batch=4, microbatches=8)),
    ("llama3-70b", 8, TrainLayout(tp=4, dp=2, zero=1, micro_batch=2, microbatches=4,
                                  sequence_parallel=False)),
    ("llama3-8b", 2, TrainLayout(tp=2, micro_batch=8, microbatches=2, sequence_parallel=True,
                                 recompute="selective")),
    ("llama3-70b", 8, TrainLayout(tp=8, zero=3, micro_batch=4, microbatches=2,
                                  recompute="sqrt")),
])
def test_fit_advice_lists_exactly_the_changes_that_fit(name, n, layout):
    config, world = preset(name), cluster("h100-sxm", n)
    estimate = evaluate_training(config, world, layout, WORKLOAD)
    assert not estimate.fits
    advice = training_fit_advice(config, world, WORKLOAD, estimate)
    over = (estimate.memory.total - estimate.usable_memory) / GiB
    assert f"{over:.1f} GiB more than the {estimate.usable_memory / GiB:.1f} GiB usable" in advice
    expected = {}
    for flag, change in _changes(layout).items():
        try:
            total = evaluate_training(config, world, dataclasses.replace(layout, **change),
                                      WORKLOAD).memory.total
        except ConfigError:
            continue
        if total <= estimate.usable_memory:
            expected[flag] = round(total / GiB, 1)
    assert _fixes(advice) == expected
    assert ("no change of ZeRO stage" in advice) == (not expected)
    states = count_parameters(config) * WORKLOAD.precision.bytes_per_parameter
    assert f"need at least {math.ceil(states / estimate.usable_memory)} GPUs" in advice


def test_serving_advice_says_how_many_sequences_fit_or_what_to_shrink():
    config, world = preset("llama3-70b"), cluster("h100-sxm", 8)
    workload = ServeWorkload(context_len=8192, prompt_len=4096, output_len=4096, batch=512)
    estimate = evaluate_serving(config, world, ServeLayout(tp=4, dp=2), workload)
    assert not estimate.fits and estimate.max_concurrent_sequences >= 2
    advice = serving_fit_advice(config, world, estimate, workload)
    assert f"at most {estimate.max_concurrent_sequences // 2} sequences of 8192" in advice
    small = cluster("rtx-4090", 2)
    for dtype, others in (("bf16", "fp8 or int4"), ("fp8", "int4")):
        tight = ServeWorkload(context_len=8192, prompt_len=4096, output_len=4096,
                              weight_dtype=dtype)
        estimate = evaluate_serving(config, small, ServeLayout(tp=2), tight)
        assert estimate.max_concurrent_sequences == 0
        advice = serving_fit_advice(config, small, estimate, tight)
        need = (estimate.weights + estimate.activations) / GiB
        assert f"weights and scratch need {need:.1f} GiB" in advice
        assert f"(--dtype {others})" in advice


def test_serving_json_reports_the_estimate_in_gib():
    config, world = preset("llama3-8b"), cluster("h100-sxm", 2)
    workload = ServeWorkload(context_len=2048, prompt_len=1024, output_len=1024)
    result = search_serving(config, world, workload)
    out = serving_json(config, world, workload, result)
    first, estimate = out["configs"][0], result.ranked[0]
    assert first["memory_gib"]["total"] == round(estimate.total_memory / GiB, 3)
    assert first["memory_gib"]["kv_cache"] == round(estimate.kv_cache / GiB, 3)
    assert out["weights_gib_total"] == round(2 * count_parameters(config) / GiB, 3)


@pytest.mark.parametrize("seq_len", [1, 100, 1000, 2048, 2702, 3000, 4096, 6000, 8192, 32768,
                                     100_000, 2**22, 2**23, 10**7])
def test_default_batch_is_the_power_of_two_nearest_4m_tokens(seq_len):
    batch = default_global_batch(seq_len)
    assert batch >= 1 and batch & (batch - 1) == 0
    target = 4 * 2**20
    if seq_len * math.sqrt(2) >= target:
        assert batch == 1
    else:  # nearest in log scale: within a factor sqrt(2) of the target
        assert target / math.sqrt(2) <= batch * seq_len <= target * math.sqrt(2)


def _stack_table() -> dict[str, dict]:
    """docs/planner.md's table of stacks: the choices each states, as TrainWorkload fields."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        name = re.fullmatch(r"`([a-z0-9-]+)` \(.*\)", cells[0]) if len(cells) == 5 else None
        if not name:
            continue
        name, (flash, dropout, overlaps, other) = name.group(1), cells[1:]
        flags = [part.strip() == "yes" for part in overlaps.split("/")]
        live = re.search(r"at most ([0-9.e]+) parameters", other)
        rows[name] = dict(
            flash_attention=not flash.startswith("no"), dropout=dropout == "yes",
            overlap_grad_reduce=flags[0], overlap_param_gather=flags[1],
            overlap_tp_comm=flags[2], overlap_p2p=flags[3],
            portable_attention="FlashAttention-2" in flash,
            zero3_per_parameter="parameter by parameter" in other,
            zero3_live_params=float(live.group(1)) if live else 0.0,
            runtime="tetrad" if "tetrad's own tensors" in other else "megatron")
    return rows


def test_each_stack_sets_what_the_docs_table_says():
    table = _stack_table()
    assert set(table) == set(STACKS)
    for name, expected in table.items():
        workload = TrainWorkload(seq_len=4096, **stack_fields(name))
        assert {key: getattr(workload, key) for key in expected} == expected, name
    assert "the default" in next(line for line in DOCS.read_text().splitlines()
                                 if line.startswith(f"| `{DEFAULT_STACK}`"))


def test_single_flags_override_a_stack_and_unknown_stacks_are_refused():
    fields = stack_fields("megatron", dropout=True, flash_attention=None)
    assert fields["dropout"] is True and fields["flash_attention"] is True
    with pytest.raises(ConfigError, match="unknown training stack 'megatron-lm'"):
        stack_fields("megatron-lm")


def _predict(parallel, **kwargs):
    return predict_training(preset("tiny"), parallel, micro_batch=1, seq_len=64, **kwargs)


def test_prediction_keys_follow_the_runtime_the_gpu_and_the_layout():
    one = _predict(ParallelConfig(dp=2, zero=1))
    assert "stages" not in one and "comm_exposed_s" not in one and one["step_time_s"] is None
    assert "params_gathered_peak" not in one["bytes"]
    timed = _predict(ParallelConfig(dp=2, zero=3), gpu="h100-sxm")
    assert timed["bytes"]["params_gathered_peak"] > 0 and timed["comm_exposed_s"] >= 0
    step = timed["step_time_s"]
    assert timed["idle_fraction"] == pytest.approx(step["bubble"] / step["total"])
    assert "comm_exposed_s" not in _predict(ParallelConfig(dp=2), gpu="h100-sxm",
                                            runtime="megatron")
    staged = _predict(ParallelConfig(pp=2, microbatches=2), gpu="h100-sxm")
    assert [stage["comm_exposed_s"] for stage in staged["stages"]][staged["fullest_stage"]] \
        == staged["comm_exposed_s"]
    assert len(staged["stages"]) == 2 and 0 < staged["idle_fraction"] < 1
    assert "stages" not in _predict(ParallelConfig(pp=2, microbatches=2), runtime="megatron")


def test_zero3_holds_its_shard_and_reports_the_gathered_blocks_apart():
    whole = _predict(ParallelConfig(dp=2, zero=1))["bytes"]["params"]
    sharded = _predict(ParallelConfig(dp=2, zero=3))["bytes"]
    assert sharded["params"] == pytest.approx(whole / 2, rel=0.05)
    assert sharded["params"] + sharded["params_gathered_peak"] > whole / 2


def test_prediction_defaults_are_a_node_of_8_and_flash_attention():
    parallel = ParallelConfig(dp=16)
    assert predict_training(preset("small"), parallel, micro_batch=1, seq_len=64,
                            gpu="h100-sxm") == predict_training(
        preset("small"), parallel, micro_batch=1, seq_len=64, gpu="h100-sxm", gpus_per_node=8,
        flash_attention=True)


def test_the_planner_accepts_layouts_tetrad_cannot_run_and_kv_replicas():
    """The vocabulary need not split evenly over tp for the planner (only the runtime needs
    it); tp past the kv heads replicates them in tetrad's runtime and Megatron's alike
    (tests/test_planner_expressible.py counts the replicas)."""
    odd_vocab = preset("tiny").replace(vocab_size=255)
    assert predict_training(odd_vocab, ParallelConfig(tp=2), micro_batch=1, seq_len=64,
                            runtime="megatron")["num_parameters"] == count_parameters(odd_vocab)
    assert _predict(ParallelConfig(tp=4))["bytes"]["params"] > 0
    assert _predict(ParallelConfig(tp=4), runtime="megatron")["bytes"]["params"] > 0


def test_plan_functions_answer_as_the_search_with_its_default_top():
    config, world = preset("llama3-8b"), cluster("h100-sxm", 8)
    planned = plan_training(config, world, WORKLOAD, 64)
    assert [e.layout for e in planned.ranked] == [
        e.layout for e in search_training(config, world, WORKLOAD, 64).ranked]
    assert len(planned.ranked) == 5 == len({e.layout for e in planned.ranked})
    serve = ServeWorkload(context_len=2048, prompt_len=1024, output_len=1024)
    served = plan_serving(config, world, serve)
    assert [e.layout for e in served.ranked] == [
        e.layout for e in search_serving(config, world, serve, ServeSpace()).ranked]
    assert len(served.ranked) == 5
