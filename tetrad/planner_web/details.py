"""What the page draws beside the plan JSON for one training layout: every pipeline stage's
memory (the JSON has the fullest stage's) and the pipeline schedule's simulated timeline, timed
with the slowest stage's microbatch as the planner's bubble takes it."""

from __future__ import annotations

from tetrad.hardware.catalog import GiB, Cluster
from tetrad.planner import eager
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import eager_breakdown, stage_memory
from tetrad.planner.training import TrainWorkload, microbatch_durations
from tetrad.schedules import Durations, build_schedule, simulate
from tetrad.schedules.generate import SPLIT_BACKWARD, V_SHAPED
from tetrad.spec.model import ModelConfig

# Stage-microbatches (pp x vpp x microbatches) a drawn timeline holds: 2,048 computes, some 6
# pixels each on the page's widest timeline. A longer pass is drawn with fewer microbatches (the
# same steady state; its bubble is a larger share of the shorter pass, which the page says).
MAX_DRAWN = 1024


def stage_memories_gib(config: ModelConfig, layout: TrainLayout,
                       workload: TrainWorkload) -> list[dict[str, float]]:
    """Each pipeline stage's GPU, by the plan JSON's memory_gib keys."""
    if workload.runtime == "tetrad":
        breakdowns = [eager_breakdown(rank) for rank in eager.pipeline_ranks(
            config, layout, workload.seq_len, workload.precision)]
    else:
        breakdowns = [stage_memory(config, layout, workload.precision, workload.seq_len,
                                   workload.activation_options, stage)
                      for stage in range(layout.pp)]
    return [{key: value / GiB for key, value in memory.as_dict().items()}
            for memory in breakdowns]


def drawn_microbatches(schedule: str, pp: int, vpp: int, microbatches: int) -> int:
    """Microbatches of the drawn pass: all of them up to MAX_DRAWN stage-microbatches, else as
    many as fit in whole multiples of pp (interleaving needs them), never under the V
    schedules' 2 pp."""
    if pp * vpp * microbatches <= MAX_DRAWN:
        return microbatches
    fitting = max(pp, MAX_DRAWN // (pp * vpp) // pp * pp)
    return min(microbatches, max(fitting, 2 * pp if schedule in V_SHAPED else 1))


def pipeline_timeline(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                      workload: TrainWorkload) -> dict:
    """One pass of the schedule, every compute's [kind, stage, microbatch, start, end] per rank
    in seconds."""
    forward, backward, weight = microbatch_durations(config, cluster, layout, workload)
    split = layout.schedule in SPLIT_BACKWARD
    durations = (Durations(forward, backward, backward - weight, weight) if split
                 else Durations(forward, backward))
    shown = drawn_microbatches(layout.schedule, layout.pp, layout.vpp,
                               layout.schedule_microbatches)
    timeline = simulate(build_schedule(layout.schedule, layout.pp, shown, layout.vpp,
                                       communication=False), durations)
    return {"schedule": layout.schedule, "pp": layout.pp, "vpp": layout.vpp,
            "microbatches": layout.schedule_microbatches, "microbatches_drawn": shown,
            "forward_s": forward, "backward_s": backward, "weight_s": weight if split else None,
            "makespan_s": float(timeline.makespan),
            "bubble_fraction": timeline.bubble_fraction,
            "ranks": [[[span.action.kind, span.action.stage, span.action.microbatch,
                        float(span.start), float(span.end)] for span in spans]
                      for spans in timeline.spans]}


def training_details(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                     workload: TrainWorkload) -> dict:
    return {"stages_gib": stage_memories_gib(config, layout, workload),
            "timeline": pipeline_timeline(config, cluster, layout, workload)}
