"""The pipeline cut the planner assumes for tetrad's runtime is the one `tetrad train` runs.

Without --stage-layers the trainer cuts the blocks with partition's cost balance (parallelize,
the executor), not the even split Megatron-style stacks run. Where the two differ (5 blocks over a
V of 4 stages; 7 blocks over 3 stages with a head heavier than a block), predict_training and
`tetrad plan train` with the tetrad stack predict the stages partition gives, and the even cut
would predict other bytes. Through the trainer: a spawned pp2 ZB-V run with --contiguous-buffers
has on each rank the stages plan train planned and the checkpoint buffer plan train predicts for
that rank."""

import dataclasses

import pytest
from dist import run_ranks
from test_zero_r import RUN, assert_plan_train_predicts, layout_configs, plan_train_argv

from tetrad.cli.plan import _page_parser, _resolve, _train_plan
from tetrad.parallel.pipeline.executor import PipelineExecutor
from tetrad.planner import eager, predict_training
from tetrad.planner.layout import stage_layer_counts
from tetrad.planner.partition import partition
from tetrad.spec.model import ParallelConfig
from tetrad.spec.presets import resolve_model
from tetrad.train.launch import train_worker

SEQ = RUN["seq_len"]
# (model overrides, layout) whose runtime cut is not the even one.
UNEVEN = [({"num_layers": 5}, dict(pp=2, vpp=2, schedule="zbv", microbatches=4,
                                   recompute="full", contiguous_buffers=True)),
          ({"num_layers": 7, "vocab_size": 1024}, dict(pp=3, schedule="1f1b", microbatches=3))]


def runtime_cut(config, layout: dict) -> tuple[int, ...]:
    """The cut parallelize makes for `layout` without --stage-layers."""
    return partition(config, layout["pp"] * layout.get("vpp", 1), SEQ).stage_layers


def planned(config, layout: dict, argv: list[str]):
    """`tetrad plan train --stack tetrad` for `layout`'s flags: (its best layout, workload)."""
    args = _page_parser().parse_args(argv)
    _, world = _resolve(args)
    workload, _, result = _train_plan(args, config, world)
    return result.ranked[0], workload


def uneven_argv(layout: dict) -> list[str]:
    argv = ["plan", "train", "--model", "tiny", "--gpu", "h100-sxm", "--stack", "tetrad",
            "--num-gpus", str(layout["pp"]), "--dtype", "fp32", "--seq-len", str(SEQ),
            "--global-batch", str(layout["microbatches"]), "--micro-batch", "1",
            "--pp", str(layout["pp"]), "--schedule", layout["schedule"],
            "--recompute", layout.get("recompute", "none")]
    return argv + (["--vpp", str(layout["vpp"])] if "vpp" in layout else []) + (
        ["--contiguous-buffers"] if layout.get("contiguous_buffers") else [])


@pytest.mark.parametrize("overrides, layout", UNEVEN)
def test_the_planner_cuts_the_stages_the_runtime_runs(overrides, layout):
    config = resolve_model("tiny", overrides)
    cut = runtime_cut(config, layout)
    even = stage_layer_counts(config.num_layers, len(cut))
    assert cut != even
    estimate, _ = planned(config, layout, uneven_argv(layout))
    assert (estimate.layout.pp, estimate.layout.vpp) == (layout["pp"], layout.get("vpp", 1))
    assert estimate.layout.stage_layers == cut
    predicted = predict_training(config, ParallelConfig(**layout), 1, SEQ)
    assert predicted == predict_training(config, ParallelConfig(**layout, stage_layers=cut), 1,
                                         SEQ)
    assert predicted["stages"] != predict_training(
        config, ParallelConfig(**layout, stage_layers=even), 1, SEQ)["stages"]


def recorded_cut_job(rank: int, world_size: int, config):
    """Trains `config`; returns this rank's blocks per stage as its executor built them, and
    rank 0 the run report."""
    blocks = {}
    build = PipelineExecutor.from_model.__func__

    def recorded(cls, *args, **kwargs):
        executor = build(cls, *args, **kwargs)
        blocks.update({index: len(stage.layers) for index, stage in executor.stages.items()})
        return executor

    PipelineExecutor.from_model = classmethod(recorded)  # this spawned process's class only
    result = train_worker(rank, world_size, config)
    return blocks, result.report if result else None


@pytest.mark.timeout(600)
def test_plan_train_predicts_each_ranks_buffer_of_the_zbv_run(corpus_file, tmp_path):
    overrides, layout = UNEVEN[0]
    assert overrides == RUN["model_overrides"]
    [config] = layout_configs(corpus_file, tmp_path, [layout])
    ranks = run_ranks(recorded_cut_job, 2, config, timeout_s=550)
    report = ranks[0][1]
    plan = assert_plan_train_predicts(report)
    model = resolve_model("tiny", overrides)
    _, workload = planned(model, layout, plan_train_argv(report))
    per_rank = eager.pipeline_ranks(model, plan.layout, SEQ, workload.precision)
    even = eager.pipeline_ranks(model, dataclasses.replace(
        plan.layout, stage_layers=stage_layer_counts(model.num_layers, 4)), SEQ,
        workload.precision)
    for pp_rank, (blocks, _) in enumerate(ranks):
        assert blocks == {stage: plan.layout.stage_layers[stage] for stage in blocks}
        [entry] = [e for e in report["ranks"] if e["coords"]["pp"] == pp_rank]
        assert entry["bytes"]["activation_buffer"] == round(per_rank[pp_rank].activation_buffer)
    assert [rank.activation_buffer for rank in even] != [rank.activation_buffer
                                                         for rank in per_rank]
