"""--contiguous-buffers' checkpoint slots under the split-backward schedules (zb, zbv, dualpipe).

A checkpoint's slot is taken at the microbatch's F and returned when the last backward walk that
needs the kept input ends: W on a stage that recomputes (B keeps the graph, W walks down from the
outputs and reruns the block), or B where the executor runs the whole backward at once (its W is
the next compute on the rank: whole_backwards). The slots a rank allocates are the most its
action list holds at once (in_flight_peak, which releases at W: nothing runs between a whole B
and its W).

Through the trainer: pp2 zb, zbv and dualpipe under full and sqrt recomputation in one spawned
job of two ranks, against one process without recomputation (losses to 1e-5, final parameters);
every rank's bytes and collectives equal the planner's, its buffer is the planner's
activation_buffer, and the bytes in use after every F, B and W are the slots of the
microbatches that rule keeps. In the planner: that rule's peak is in_flight_peak for pipelines
of 2 to 4 ranks, and plan train predicts each layout's buffer."""

import pytest
from dist import run_ranks
from test_zero_r import (RUN, assert_plan_train_predicts, assert_reports_equal_one_process,
                         layout_configs, plain)

from tetrad.parallel.pipeline.executor import PipelineExecutor
from tetrad.parallel.recompute import _kept_inputs
from tetrad.planner.eager_activations import in_flight_peak
from tetrad.schedules import build_schedule
from tetrad.schedules.simulate import whole_backwards
from tetrad.spec.layout import sqrt_segments
from tetrad.train.ranks import train_worker

__all__ = ["plain"]  # the module fixture: one process without recomputation

# zb's last stage runs F0 B0 F1 B1 W0 ...: released at B it would hold one microbatch, at W two.
# The runtime's own cut, which plan train plans too: 5 blocks as (1, 1, 2, 1) over the V, whose
# two stages on rank 1 keep 1 and 2 checkpoints under full.
SPLIT_SLOT_LAYOUTS = [dict(pp=2, vpp=vpp, schedule=schedule, microbatches=4,
                           recompute=recompute, contiguous_buffers=True)
                      for schedule, vpp in (("zb", 1), ("zbv", 2), ("dualpipe", 2))
                      for recompute in ("full", "sqrt")]


def slots_held(schedule, rank: int, per_microbatch) -> list[int]:
    """Slots rank `rank` holds after each of its F, B and W when a microbatch of stage s takes
    per_microbatch(s) at F and returns them at W, or at a B that runs the whole backward."""
    whole = {(action.stage, action.microbatch) for action in whole_backwards(schedule)}
    live, held = set(), []
    for action in schedule.actions[rank]:
        key = (action.stage, action.microbatch)
        if action.kind not in ("F", "B", "W"):
            continue
        if action.kind == "F":
            live.add(key)
        elif action.kind == "W" or key in whole:
            live.discard(key)
        held.append(sum(per_microbatch(stage) for stage, _ in live))
    return held


@pytest.mark.parametrize("name", ["zb", "zbv", "dualpipe"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_in_flight_peak_is_the_split_backward_slots_peak(name, pp):
    """Stages holding unequal checkpoints, so which stage's microbatch is live matters."""
    vpp = 1 if name == "zb" else 2
    for microbatches in (2 * pp, 2 * pp + 1, 3 * pp):
        schedule = build_schedule(name, pp, microbatches, vpp)
        for rank in range(pp):
            assert max(slots_held(schedule, rank, lambda s: s + 1)) == in_flight_peak(
                name, pp, microbatches, vpp, rank, lambda s: s + 1)


def traced_layouts_job(rank: int, world_size: int, configs):
    """Each layout in turn; every rank returns, per layout, its executor's compute actions with
    the checkpoint buffer's bytes in use after each, its stages' block counts and the buffer's
    bytes; rank 0 also the run reports."""
    traces = []

    def traced(method):
        def run(executor, action, state):
            method(executor, action, state)
            kept = _kept_inputs(executor.module)
            trace = traces[-1]
            trace["actions"].append((action.kind, action.stage, action.microbatch,
                                     sum(k.buffer_bytes for k in kept)))
            trace["blocks"] = {index: len(stage.layers)
                               for index, stage in executor.stages.items()}
            trace["buffer"] = sum(k.buffer.untyped_storage().nbytes() for k in kept
                                  if k.buffer is not None)
        return run

    for name in ("_forward", "_backward", "_weight"):  # this spawned process's class only
        setattr(PipelineExecutor, name, traced(getattr(PipelineExecutor, name)))
    reports = []
    for config in configs:
        traces.append({"actions": []})
        result = train_worker(rank, world_size, config)
        reports.append(result.report if result else None)
    return reports, traces


@pytest.mark.timeout(1200)
def test_split_backward_checkpoint_slots_equal_one_process(plain, corpus_file, tmp_path):
    configs = layout_configs(corpus_file, tmp_path, SPLIT_SLOT_LAYOUTS)
    ranks = run_ranks(traced_layouts_job, 2, configs, timeout_s=1100)
    reports = ranks[0][0]
    assert_reports_equal_one_process(plain, tmp_path, SPLIT_SLOT_LAYOUTS, reports)
    hidden = plain[0]["config"]["model_config"]["hidden_size"]
    slot = RUN["seq_len"] * hidden * 4  # one sequence's fp32 block input
    for index, (layout, report) in enumerate(zip(SPLIT_SLOT_LAYOUTS, reports)):
        schedule = build_schedule(layout["schedule"], 2, 4, layout["vpp"])
        for rank, (_, traces) in enumerate(ranks):
            trace = traces[index]
            blocks = trace["blocks"]

            def checkpoints(stage: int) -> int:
                count = blocks[stage]
                return len(sqrt_segments(count)) if layout["recompute"] == "sqrt" else count

            expected = [held * slot for held in slots_held(schedule, rank, checkpoints)]
            compute = [(a.kind, a.stage, a.microbatch) for a in schedule.actions[rank]
                       if a.kind in ("F", "B", "W")]
            assert [a[:3] for a in trace["actions"]] == compute * RUN["steps"]
            assert [a[3] for a in trace["actions"]] == expected * RUN["steps"], (layout, rank)
            entry = next(e for e in report["ranks"] if e["coords"]["pp"] == rank)
            predicted = report["predicted"]["stages"][rank]["bytes"]["activation_buffer"]
            assert trace["buffer"] == entry["bytes"]["activation_buffer"] == max(expected) \
                == round(predicted) > 0
        assert_plan_train_predicts_the_buffer(report)


def assert_plan_train_predicts_the_buffer(report) -> None:
    """`tetrad plan train` given the layout's flags plans it and predicts what the run counted on
    its fullest ranks: activations, collective bytes and the checkpoint buffer."""
    planned = assert_plan_train_predicts(report)
    assert planned.layout.schedule == report["config"]["parallel"]["schedule"]
    for entry in report["ranks"]:
        if entry["coords"]["pp"] == planned.fullest_stage:
            assert round(planned.memory.activation_buffer) == entry["bytes"]["activation_buffer"]
