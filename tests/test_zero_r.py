"""ZeRO-R's partitioned and offloaded activation checkpoints (--partition-activations,
--offload-activations; tetrad/parallel/kept_inputs.py).

Through the trainer: one process with its checkpoints in host memory, then tp2 x dp2 (full,
partitioned) and tp2 x dp2 ZeRO-3 (full, partitioned and offloaded) in one spawned job, pp2 x tp2
1F1B (sqrt, partitioned and offloaded) in another, against one process without recomputation
(losses to 1e-5, final parameters); every rank's bytes (activations on the device, the kept
inputs in host memory), collective bytes and calls equal the planner's. A three-rank check of
the kept share itself: an input whose elements do not divide by the group is padded, each rank
keeps its chunk, and the gathered input gives the gradients of a checkpoint that keeps it
whole."""

import gc
import json

import pytest
import torch
from dist import run_ranks
from test_report_layouts import cpu_token_ids

from tetrad.cli.main import main
from tetrad.cli.plan import _page_parser, _resolve, _train_plan
from tetrad.errors import ConfigError
from tetrad.memory import ActivationMeter
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.kept_inputs import TAG, KeptInputs
from tetrad.parallel.mesh import build_mesh
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import (ActivationOptions, activation_bytes_per_layer,
                                   stage_activation_bytes)
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import resolve_model
from tetrad.train import checkpoint as ckpt
from tetrad.train.launch import train_worker
from tetrad.train.trainer import train

RUN_LR = 3e-3
RUN = dict(model="tiny", model_overrides={"num_layers": 5}, lr=RUN_LR, steps=2, batch_size=4,
           seq_len=32, warmup_steps=1, sample_tokens=0)
# One spawned job each (4 ranks): tensor and data parallelism, then a pipeline under sqrt.
DATA_LAYOUTS = [dict(tp=2, dp=2, zero=1, recompute="full", partition_activations=True),
                dict(tp=2, dp=2, zero=3, recompute="full", partition_activations=True,
                     offload_activations=True)]
PIPELINE_LAYOUTS = [dict(pp=2, tp=2, schedule="1f1b", microbatches=2, stage_layers=(3, 2),
                         recompute="sqrt", partition_activations=True, offload_activations=True)]


def run_config(corpus_file: str, parallel: ParallelConfig, folder) -> TrainConfig:
    return TrainConfig(**{**RUN, "data": corpus_file, "nproc": parallel.world_size,
                          "parallel": parallel, "checkpoint_dir": str(folder)})


def assert_report_is_the_planners(report) -> None:
    """Every rank's bytes, collective bytes and calls equal the planner's; the activations
    exceed it by exactly the CPU's whole-batch token ids (tests/test_report_layouts.py)."""
    predicted = report["predicted"]
    ids_slack = cpu_token_ids(report)
    offloaded = report["config"]["parallel"]["offload_activations"]
    for entry in report["ranks"]:
        expected = predicted["stages"][entry["coords"]["pp"]] if "stages" in predicted \
            else predicted
        assert set(entry["bytes"]) == set(expected["bytes"])
        assert ("host_activations_peak" in entry["bytes"]) == offloaded
        for field, value in entry["bytes"].items():
            slack = ids_slack if field == "activations_peak" else 0
            assert value == round(expected["bytes"][field]) + slack, (field, value, expected)
        if offloaded:
            assert entry["bytes"]["host_activations_peak"] > 0
        assert {kind: round(v) for kind, v in expected["comm_bytes"].items()} == \
            entry["comm_bytes"]
        assert {kind: round(v) for kind, v in expected["comm_calls"].items()} == \
            {kind: round(v) for kind, v in entry["comm_calls"].items()}


def plan_train_argv(report) -> list[str]:
    """`tetrad plan train`'s flags for the layout and batch `report`'s run trained."""
    parallel = report["config"]["parallel"]
    micro_batch = RUN["batch_size"] // (parallel["dp"] * parallel["microbatches"])
    argv = ["plan", "train", "--model", "tiny", "--gpu", "h100-sxm", "--stack", "tetrad",
            "--num-gpus", str(report["config"]["nproc"]), "--dtype", "fp32",
            "--seq-len", str(RUN["seq_len"]), "--global-batch", str(RUN["batch_size"]),
            "--micro-batch", str(micro_batch), "--recompute", parallel["recompute"]]
    argv += [arg for name in ("tp", "pp", "dp", "zero") for arg in (f"--{name}",
                                                                   str(parallel[name]))]
    if parallel["pp"] > 1:
        argv += ["--schedule", parallel["schedule"]]
    return argv + [f"--{name.replace('_', '-')}" for name in ("partition_activations",
                                                              "offload_activations",
                                                              "contiguous_buffers")
                   if parallel[name]]


def assert_plan_train_predicts(report):
    """`tetrad plan train`, given the run's layout through its flags (the two ZeRO-R options
    among them), plans that layout and predicts what the run's fullest ranks counted: the
    activations on the device, the kept inputs in host memory, every collective's bytes.
    Returns the plan."""
    args = _page_parser().parse_args(plan_train_argv(report))
    config, world = _resolve(args)
    planned = _train_plan(args, config.replace(**RUN["model_overrides"]), world)[2].ranked[0]
    parallel = report["config"]["parallel"]
    assert {key: getattr(planned.layout, key) for key in (
        "tp", "pp", "dp", "zero", "recompute", "partition_activations", "offload_activations",
        "sequence_parallel", "num_microbatches")} == {
        key: parallel[key] for key in ("tp", "pp", "dp", "zero", "recompute",
                                       "partition_activations", "offload_activations",
                                       "sequence_parallel")} | {
        "num_microbatches": parallel["microbatches"]}
    fullest = [entry for entry in report["ranks"]
               if entry["coords"]["pp"] == planned.fullest_stage]
    assert fullest
    for entry in fullest:
        held = entry["bytes"]
        assert round(planned.memory.activations) + cpu_token_ids(report) == \
            held["activations_peak"]
        assert round(planned.memory.host_activations) == held.get("host_activations_peak", 0)
        assert {kind: round(v) for kind, v in planned.comm.sent.items()} == entry["comm_bytes"]
    return planned


def layouts_job(rank: int, world_size: int, configs: list[TrainConfig]):
    """Every rank trains each layout in turn; rank 0 returns the run reports (the others'
    train_worker returns None)."""
    results = [train_worker(rank, world_size, config) for config in configs]
    return [result.report for result in results] if rank == 0 else None


def final_parameters(folder) -> dict[str, torch.Tensor]:
    config = resolve_model("tiny").replace(num_layers=5)
    _, state = ckpt.load_checkpoint(folder / ckpt.step_folder_name(RUN["steps"]), config)
    return state["model"]


@pytest.fixture(scope="module")
def plain(corpus_file, tmp_path_factory):
    """One process without recomputation: (its report, its final parameters)."""
    folder = tmp_path_factory.mktemp("plain")
    report = train(run_config(corpus_file, ParallelConfig(), folder), show_progress=False).report
    return report, final_parameters(folder)


def test_host_checkpoints_in_one_process_equal_it_and_the_planner(plain, corpus_file,
                                                                   tmp_path):
    host = train(run_config(corpus_file, ParallelConfig(recompute="full",
                                                        offload_activations=True), tmp_path),
                 show_progress=False).report
    assert [s["loss"] for s in host["steps"]] == [s["loss"] for s in plain[0]["steps"]]
    assert_report_is_the_planners(host)
    assert_plan_train_predicts(host)


def layout_configs(corpus_file: str, folder, layouts) -> list[TrainConfig]:
    """A run of each of `layouts`, checkpointed under folder / layout<index>."""
    return [run_config(corpus_file, ParallelConfig(**layout), folder / f"layout{index}")
            for index, layout in enumerate(layouts)]


def assert_reports_equal_one_process(plain, folder, layouts, reports) -> None:
    """The runs of `layouts` (layout_configs under `folder`) lost what one process lost, ended
    on its parameters, and every rank counted what the planner predicts."""
    expected = [s["loss"] for s in plain[0]["steps"]]
    for index, report in enumerate(reports):
        assert [s["loss"] for s in report["steps"]] == pytest.approx(expected, rel=1e-5)
        finals = final_parameters(folder / f"layout{index}")
        for name, value in plain[1].items():
            torch.testing.assert_close(finals[name], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{layouts[index]} {name}: {m}")
        assert_report_is_the_planners(report)


def assert_layouts_equal_one_process(plain, corpus_file, folder, layouts) -> list[dict]:
    """Trains `layouts` on 4 ranks in one spawned job and checks them; returns their reports."""
    configs = layout_configs(corpus_file, folder, layouts)
    reports = run_ranks(layouts_job, 4, configs, timeout_s=1100)[0]
    assert_reports_equal_one_process(plain, folder, layouts, reports)
    for report in reports:
        assert report["ranks"][0]["comm_bytes"]["all_gather"] > 0
    return reports


# Four spawned ranks training two layouts take minutes on a loaded 2-core machine.
@pytest.mark.timeout(1200)
def test_partitioned_checkpoints_under_tp_dp_equal_one_process(plain, corpus_file, tmp_path):
    for report in assert_layouts_equal_one_process(plain, corpus_file, tmp_path, DATA_LAYOUTS):
        assert_plan_train_predicts(report)


@pytest.mark.timeout(1200)
def test_partitioned_host_checkpoints_under_pp_tp_equal_one_process(plain, corpus_file,
                                                                     tmp_path):
    for report in assert_layouts_equal_one_process(plain, corpus_file, tmp_path,
                                                   PIPELINE_LAYOUTS):
        assert_plan_train_predicts(report)


def kept_share_job(rank: int, world_size: int, offload: bool):
    torch.set_num_threads(1)
    mesh = build_mesh(ParallelConfig(tp=world_size), rank, world_size)
    counter = CommCounter()
    kept = KeptInputs(Comm(counter), mesh["tp"], offload)
    weight = torch.linspace(-1, 1, 7, requires_grad=True)
    x = torch.arange(35.0).view(5, 7).div(10).requires_grad_()  # 35 elements over 3 ranks

    def block(inp):
        return (inp * weight).sin().sum()

    meter = ActivationMeter(torch.nn.Module())  # no parameters to leave out
    with meter.measure(), kept.keeping(x):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    held = meter.finish_microbatch()
    out.backward()
    # A freed graph's saved inputs can wait in a reference cycle for the collector (one CI run
    # saw a rank's share still held here): collect, so only what is still referenced counts.
    gc.collect()
    grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    block(x).backward()
    return (held, kept.host_peak_bytes, kept.host_bytes, counter.totals((TAG,)),
            [torch.equal(a, b) for a, b in zip(grads, (x.grad, weight.grad))])


@pytest.mark.parametrize("offload", [False, True], ids=["device", "host"])
def test_kept_share_is_padded_chunk_and_gathers_back(offload):
    for held, host_peak, host_left, sent, equal in run_ranks(kept_share_job, 3, offload):
        share = 12 * 4  # ceil(35 / 3) fp32 elements
        assert (held, host_peak) == ((0, share) if offload else (share, 0))
        assert host_left == 0  # freed with the checkpoint once its backward ran
        assert sent["all_gather"] == 2 * share  # (N-1)/N of the padded 36 elements
        assert equal == [True, True]


@pytest.mark.parametrize("fields, words", [
    (dict(tp=2, partition_activations=True), "--recompute full or sqrt"),
    (dict(tp=2, recompute="selective", offload_activations=True), "--recompute full or sqrt"),
    (dict(recompute="full", partition_activations=True), "--tp 2 or more"),
    (dict(tp=2, recompute="full", sequence_parallel=True, partition_activations=True),
     "sequence parallelism"),
])
def test_refusals_are_one_line(fields, words):
    with pytest.raises(ConfigError, match=words) as error:
        ParallelConfig(**fields)
    assert "\n" not in str(error.value)


def test_megatron_profile_keeps_the_share_on_the_device():
    config = resolve_model("tiny").replace(num_layers=16)
    options, act = ActivationOptions(), 2

    def device(**flags) -> float:
        layout = TrainLayout(tp=2, micro_batch=4, recompute="full", **flags)
        return stage_activation_bytes(config, layout, 32, options, act, 0)

    kept = config.num_layers * activation_bytes_per_layer(config, 0, 4, 32, 2, 1, False, "full",
                                                          options, act)
    whole = device()
    assert whole - device(partition_activations=True) == kept / 2
    assert whole - device(partition_activations=True, offload_activations=True) == kept


PLAN = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8",
        "--stack", "tetrad", "--top", "20"]


@pytest.mark.parametrize("flags", [["--partition-activations"], ["--offload-activations"],
                                   ["--partition-activations", "--offload-activations"]])
def test_plan_train_searches_only_layouts_that_keep_the_checkpoints_so(flags, capsys):
    """Left open, recompute is searched over full and sqrt, and under partitioning tp over 2 and
    more without sequence parallelism; every layout printed carries the flags."""
    main([*PLAN, *flags, "--json"])
    configs = json.loads(capsys.readouterr().out)["configs"]
    assert len(configs) > 1
    for item in configs:
        parallel = item["parallel"]
        assert parallel["recompute"] in ("full", "sqrt")
        assert parallel["partition_activations"] == ("--partition-activations" in flags)
        assert parallel["offload_activations"] == ("--offload-activations" in flags)
        if "--partition-activations" in flags:
            assert parallel["tp"] > 1 and not parallel["sequence_parallel"]
        assert (item["memory_gib"]["host_activations"] > 0) == ("--offload-activations" in flags)


@pytest.mark.parametrize("flags, words", [
    (["--partition-activations", "--tp", "1"], "--tp 2 or more"),
    (["--partition-activations", "--recompute", "selective"], "--recompute full or sqrt"),
    (["--offload-activations", "--recompute", "none"], "--recompute full or sqrt"),
    (["--partition-activations", "--sequence-parallel"], "sequence parallelism"),
    (["--offload-activations", "--contiguous-buffers", "--zero", "1"], "drop one of them"),
    (["--partition-activations", "--stack", "megatron"], "--stack tetrad"),
    (["--offload-activations", "--stack", "deepspeed"], "--stack tetrad"),
])
def test_plan_train_refuses_as_train_does_in_one_line(flags, words, capsys):
    assert main([*PLAN, *flags]) == 2
    error = capsys.readouterr().err
    assert words in error and error.count("\n") == 1
