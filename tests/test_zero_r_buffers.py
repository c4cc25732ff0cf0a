"""ZeRO-R's constant-size buffers (--zero-bucket-size: ZeRO-3's gathers and reduce-scatters
through two reused buffers; tetrad/parallel/zero_buckets.py) and memory defragmentation
(--contiguous-buffers: checkpoints' kept inputs in slots of one buffer, ZeRO's gradient buffers
in one block).

Through the trainer: one process with its checkpoints in slots, then four layouts on 4 ranks in
one spawned job (pp2 x dp2 1F1B ZeRO-3 with buckets, tp2 x dp2 ZeRO-3 with buckets and
partitioned checkpoints in slots, tp2 x dp2 ZeRO-2 under sqrt with its checkpoints in slots and
one gradient block, dp4 ZeRO-3 under sqrt with buckets and slots, one sequence a rank), against
one process without
recomputation (losses to 1e-5, final parameters); every rank's bytes (the buffers, the slots'
peak), collective bytes and calls equal the planner's. Pipelines with their checkpoints in slots
(a slot per checkpoint of each microbatch in flight: 1F1B full and sqrt, interleaved) in a
second job, the same checks and 1F1B's slots counted by hand. In one process: the rule that
cuts a unit into calls, and the gradient buffers of ZeRO-1/2/3 sharing one storage."""

import pytest
from test_runtime_rules import built_strategy
from test_zero_r import (RUN, assert_layouts_equal_one_process, assert_report_is_the_planners,
                         plain, run_config)

from tetrad.cli.main import main
from tetrad.cli.plan import _page_parser, _resolve, _train_plan
from tetrad.errors import ConfigError
from tetrad.memory import storage_id
from tetrad.spec.model import ParallelConfig
from tetrad.spec.runtime_rules import bucket_buffer_elements, bucket_chunks
from tetrad.train.trainer import train

__all__ = ["plain"]  # the module fixture: one process without recomputation

# Units of the 5-layer tiny model hold 46-66K elements: these buckets cut each into calls of
# unequal size (the last one shorter).
BUFFER_LAYOUTS = [
    dict(pp=2, dp=2, zero=3, zero_bucket_size=40_000, schedule="1f1b", microbatches=2,
         stage_layers=(3, 2), contiguous_buffers=True),
    dict(tp=2, dp=2, zero=3, zero_bucket_size=24_000, recompute="full",
         partition_activations=True, contiguous_buffers=True),
    dict(tp=2, dp=2, zero=2, recompute="sqrt", contiguous_buffers=True),
    # One sequence per rank: the loss's targets are a view of the ids the embedding keeps.
    dict(dp=4, zero=3, zero_bucket_size=24_000, recompute="sqrt", contiguous_buffers=True)]


def test_checkpoint_slots_in_one_process_equal_it_and_the_planner(plain, corpus_file, tmp_path):
    for recompute in ("full", "sqrt"):
        parallel = ParallelConfig(recompute=recompute, contiguous_buffers=True)
        report = train(run_config(corpus_file, parallel, tmp_path / recompute),
                       show_progress=False).report
        assert [s["loss"] for s in report["steps"]] == [s["loss"] for s in plain[0]["steps"]]
        assert report["ranks"][0]["bytes"]["activation_buffer"] > 0
        assert_report_is_the_planners(report)


@pytest.mark.timeout(1200)
def test_bucketed_and_contiguous_layouts_equal_one_process(plain, corpus_file, tmp_path):
    reports = assert_layouts_equal_one_process(plain, corpus_file, tmp_path, BUFFER_LAYOUTS)
    # AdamW hides a constant factor on the gradients (averaged or summed over the group); the
    # norm of the reduced gradients does not.
    expected = [s["grad_norm"] for s in plain[0]["steps"]]
    for report in reports:
        assert [s["grad_norm"] for s in report["steps"]] == pytest.approx(expected, rel=1e-5)
    assert_plan_train_holds_what_train_counted(reports[-1])


def assert_plan_train_holds_what_train_counted(report) -> None:
    """`tetrad plan train` given the dp4 layout and the two flags predicts the buffers every
    rank of `report` counted."""
    args = _page_parser().parse_args([
        "plan", "train", "--model", "tiny", "--gpu", "h100-sxm", "--num-gpus", "4", "--dp", "4",
        "--stack", "tetrad", "--dtype", "fp32", "--seq-len", str(RUN["seq_len"]),
        "--global-batch", str(RUN["batch_size"]), "--micro-batch", "1", "--zero", "3",
        "--zero-bucket-size", "24000", "--recompute", "sqrt", "--contiguous-buffers"])
    config, world = _resolve(args)
    planned = _train_plan(args, config.replace(**RUN["model_overrides"]), world)[2].ranked[0]
    assert (planned.layout.zero_bucket_size, planned.layout.contiguous_buffers) == (24_000, True)
    for entry in report["ranks"]:
        held = entry["bytes"]
        assert held["zero_buffers"] > 0 and held["activation_buffer"] > 0
        assert (planned.memory.zero_buffers, planned.memory.activation_buffer) == (
            held["zero_buffers"], held["activation_buffer"])


# Pipelines keep several microbatches' checkpoints at once: a slot per checkpoint of each.
# 1F1B with stage_layers (3, 2): rank 0 keeps min(pp, microbatches) = 2 microbatches of 3 blocks
# until their backward, rank 1 one of 2; interleaved: two stages a rank.
PIPELINE_SLOT_LAYOUTS = [
    dict(pp=2, tp=2, schedule="1f1b", microbatches=4, stage_layers=(3, 2), recompute="full",
         partition_activations=True, contiguous_buffers=True),
    dict(pp=2, dp=2, zero=1, schedule="1f1b", microbatches=2, stage_layers=(3, 2),
         recompute="sqrt", contiguous_buffers=True),
    dict(pp=2, dp=2, zero=1, vpp=2, schedule="interleaved", microbatches=2, recompute="full",
         contiguous_buffers=True)]


@pytest.mark.timeout(1200)
def test_pipelined_checkpoint_slots_equal_one_process(plain, corpus_file, tmp_path):
    reports = assert_layouts_equal_one_process(plain, corpus_file, tmp_path,
                                               PIPELINE_SLOT_LAYOUTS)
    # Counted by hand for 1F1B under full: rank 0 two microbatches of 3 slots, rank 1 one of 2,
    # each slot a microbatch's [1, 32, hidden] fp32 block input, its half under partitioning.
    hidden = plain[0]["config"]["model_config"]["hidden_size"]
    slot = 1 * RUN["seq_len"] * hidden * 4 // 2
    for entry in reports[0]["ranks"]:
        assert entry["bytes"]["activation_buffer"] == slot * (6 if entry["coords"]["pp"] == 0
                                                              else 2)
    for report in reports:
        assert all(entry["bytes"]["activation_buffer"] > 0 for entry in report["ranks"])


@pytest.mark.parametrize("shard, group, bucket, calls", [
    (10, 4, 0, [(0, 10)]), (10, 4, 8, [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]),
    (10, 4, 13, [(0, 3), (3, 6), (6, 9), (9, 10)]), (5, 4, 3, [(s, s + 1) for s in range(5)])])
def test_a_unit_is_cut_into_calls_of_at_most_the_bucket(shard, group, bucket, calls):
    assert bucket_chunks(shard, group, bucket) == calls
    assert bucket_buffer_elements([shard, 1], group, bucket) == group * max(
        end - start for start, end in calls)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_gradient_buffers_are_one_block(zero):
    def storages(contiguous: bool) -> set[int]:
        parallel = ParallelConfig(zero=zero, contiguous_buffers=contiguous)
        engine = built_strategy("buckets", parallel, 0).engine  # several buckets and units
        return {storage_id(grads) for grads in engine._grad_shards()}

    assert len(storages(False)) > 1
    assert len(storages(True)) == 1


@pytest.mark.parametrize("fields, words", [
    (dict(dp=2, zero=2, zero_bucket_size=1000), "--zero 3"),
    (dict(dp=2, zero=3, zero_bucket_size=-1), "zero_bucket_size"),
    (dict(dp=2, contiguous_buffers=True), "--zero 1, 2 or 3, or --recompute full or sqrt"),
    (dict(recompute="full", offload_activations=True, contiguous_buffers=True), "drop one"),
])
def test_refusals_are_one_line(fields, words):
    with pytest.raises(ConfigError, match=words) as error:
        ParallelConfig(**fields)
    assert "\n" not in str(error.value)



PLAN = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8",
        "--stack", "tetrad"]


@pytest.mark.parametrize("flags, words", [
    (["--zero-bucket-size", "1000"], "--zero 3"),
    (["--zero", "3", "--zero-bucket-size", "-1"], "zero_bucket_size"),
    (["--contiguous-buffers"], "--zero 1, 2 or 3, or --recompute full or sqrt"),
    (["--contiguous-buffers", "--recompute", "selective"], "--zero 1, 2 or 3"),
    (["--contiguous-buffers", "--recompute", "full", "--stack", "megatron"], "--stack tetrad"),
])
def test_plan_train_refuses_as_train_does_in_one_line(flags, words, capsys):
    assert main([*PLAN, *flags]) == 2
    error = capsys.readouterr().err
    assert words in error and error.count("\n") == 1
