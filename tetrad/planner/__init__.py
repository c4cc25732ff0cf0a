"""The planner: memory, compute and communication of training and serving a transformer, and the
search for the best parallel layout. Pure Python, no torch: it runs anywhere in milliseconds.

The small API the trainer and the CLI use:
  predict_training   one layout, given as tetrad's own ParallelConfig: per-rank bytes, per-step
                     communication bytes and (with a GPU) step time
  predict_run        the same for a layout a run resolved (tetrad.planner.rules), for its report
  plan_training      search (or evaluate) training layouts on a cluster
  plan_serving       search (or evaluate) serving layouts on a cluster
"""

from __future__ import annotations

from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.hardware.catalog import GPU, Cluster
from tetrad.hardware.profile import cluster as make_cluster
from tetrad.planner import eager
from tetrad.planner.eager_activations import activations_peak, recompute_bytes
from tetrad.planner.eager_params import rank_stages
from tetrad.planner.eager_time import rank_time
from tetrad.planner.comm import CommLedger
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import MemoryBreakdown, eager_breakdown
from tetrad.planner.model_stats import count_parameters
from tetrad.planner.precision import TrainingPrecision
from tetrad.planner.rules import ResolvedLayout, check_layout, resolve_layout
from tetrad.planner.search import (SearchResult, ServeSpace, TrainSpace, search_serving,
                                   search_training)
from tetrad.planner.serving import ServeWorkload
from tetrad.planner.training import TrainWorkload, evaluate_training

__all__ = ["predict_training", "predict_run", "plan_training", "plan_serving", "TrainSpace", "ServeSpace",
           "TrainWorkload", "ServeWorkload", "SearchResult"]

# Timing needs a GPU; bytes do not. Without one, a nominal GPU runs the model and the times
# are dropped.
_NOMINAL_GPU = "h100-sxm"


def predict_training(model_config: ModelConfig, parallel_config: ParallelConfig,
                     micro_batch: int, seq_len: int, num_microbatches: int | None = None,
                     dtype: str = "fp32", gpu: str | GPU | None = None, gpus_per_node: int = 8,
                     precision: TrainingPrecision | None = None,
                     flash_attention: bool = True, runtime: str = "tetrad") -> dict:
    """What one training step of `parallel_config` should cost, per rank.

    Returns {"bytes": {"params", "grads", "optimizer", "activations_peak"} of the fullest rank
    (with ZeRO-3 also "params_gathered_peak", the whole units gathered at once, which "params"
    leaves out; with offload its host_* and disk_* bytes: MemoryBreakdown.offloaded), "runtime"
    (whose tensors were counted), "idle_fraction" (the pipeline bubble's share of the step),
    "fullest_stage", "comm_bytes" and "comm_payload_bytes" (per step, per collective kind, of a
    rank of the slowest stage; with the tetrad runtime, of the fullest), "step_time_s"
    ({"total", "compute", "communication_exposed", "bubble"}; None without `gpu`: a catalog name,
    a profile file or a GPU, e.g. one `tetrad calibrate` measured), "hardware" (its name),
    "model_flops_per_step",
    "hardware_flops_per_step", "num_parameters"}, with the tetrad runtime and `gpu`
    "comm_exposed_s" (seconds per step the fullest rank waits on communication:
    tetrad.planner.eager_overlap), and with the tetrad runtime and a pipeline "stages": each
    pipeline rank's {"bytes", "comm_bytes", "comm_payload_bytes"} (and "comm_exposed_s"). `precision`
    overrides the recipe `dtype` implies (e.g. fp32 master params under autocast). `runtime`
    "tetrad" (the default: the trainer reports against it) counts tetrad's own eager runtime on
    every rank (tetrad.planner.eager); "megatron" Megatron's fused kernels, the published runs'
    calibration. `parallel_config.stage_layers` cuts the pipeline, else (tetrad) the balanced
    partition `tetrad train` runs without --stage-layers (tetrad.planner.rules.resolve_layout)
    or (megatron) the even split;
    microbatches beyond `parallel_config.microbatches` repeat whole pipeline steps
    (--grad-accum)."""
    if runtime == "tetrad":
        resolved = resolve_layout(model_config, parallel_config, seq_len, runtime=False)
    else:  # Megatron splits the layers evenly
        check_layout(model_config, parallel_config, seq_len, runtime=False)
        resolved = ResolvedLayout(model_config, parallel_config, seq_len)
    return predict_run(resolved, micro_batch, num_microbatches, dtype, gpu, gpus_per_node,
                       precision, flash_attention, runtime)


def predict_run(resolved: ResolvedLayout, micro_batch: int, num_microbatches: int | None = None,
                dtype: str = "fp32", gpu: str | GPU | None = None, gpus_per_node: int = 8,
                precision: TrainingPrecision | None = None, flash_attention: bool = True,
                runtime: str = "tetrad") -> dict:
    """predict_training's answer for a layout already checked against its model (a run's, made
    once by tetrad.planner.rules.resolve_layout)."""
    model_config, seq_len = resolved.model, resolved.seq_len
    layout = TrainLayout.of(resolved.parallel, micro_batch, num_microbatches)
    workload = TrainWorkload(seq_len=seq_len, dtype=dtype, flash_attention=flash_attention,
                             recipe=precision, runtime=runtime)
    # Bytes do not depend on the topology, so without a GPU all ranks share one nominal node.
    per_node = min(gpus_per_node, layout.world_size) if gpu else layout.world_size
    if isinstance(gpu, GPU):
        world = Cluster(gpu, layout.world_size, per_node)
    else:
        world = make_cluster(gpu or _NOMINAL_GPU, layout.world_size, per_node)
    estimate = evaluate_training(model_config, world, layout, workload)
    step = estimate.step
    predicted = {
        **_rank_bytes(estimate.memory, layout, estimate.comm),
        "runtime": runtime,
        "fullest_stage": estimate.fullest_stage,
        # The pipeline bubble's share of the step; the schedule decides it, so a nominal GPU's
        # kernel times serve when there is no GPU (without a pipeline it is 0).
        "idle_fraction": step.bubble / step.total,
        "step_time_s": step.as_dict() if gpu else None,
        "hardware": world.gpu.name if gpu else None,
        "model_flops_per_step": estimate.model_flops_per_step,
        "hardware_flops_per_step": estimate.hardware_flops_per_step,
        "num_parameters": count_parameters(model_config),
    }
    # Seconds per step a rank of each pipeline rank waits on communication (tetrad's runtime,
    # timed: with a GPU or profile), against the run report's measured comm_exposed_s.
    exposed = ([rank_time(model_config, world, layout, seq_len, workload.precision,
                          flash_attention, r).communication for r in range(layout.pp)]
               if gpu and runtime == "tetrad" else None)
    if exposed:
        predicted["comm_exposed_s"] = exposed[estimate.fullest_stage]
    if runtime == "tetrad" and layout.pp > 1:
        predicted["stages"] = [
            _rank_bytes(eager_breakdown(rank), layout, rank.comm)
            for rank in eager.pipeline_ranks(model_config, layout, seq_len, workload.precision)]
        for stage, seconds in zip(predicted["stages"], exposed or ()):
            stage["comm_exposed_s"] = seconds
    if runtime == "tetrad" and layout.recompute == "sqrt":
        for pp_rank, entry in ([(estimate.fullest_stage, predicted)]
                               + list(enumerate(predicted.get("stages", ())))):
            entry["bytes"]["recompute_peak"] = max(
                recompute_bytes(model_config, layout, stage, seq_len, workload.precision)
                for stage in rank_stages(layout, pp_rank))
    if runtime == "tetrad" and layout.offload_activations:
        for pp_rank, entry in ([(estimate.fullest_stage, predicted)]
                               + list(enumerate(predicted.get("stages", ())))):
            entry["bytes"]["host_activations_peak"] = activations_peak(
                model_config, layout, seq_len, workload.precision, pp_rank, host=True)
    return predicted


def _rank_bytes(memory: MemoryBreakdown, layout: TrainLayout, ledger: CommLedger) -> dict:
    """The bytes a rank holds, by the run report's names, and what it sends per step."""
    held = {"params": memory.params - memory.params_gathered, "grads": memory.grads,
            "optimizer": memory.optimizer}
    if layout.zero == 3:
        held["params_gathered_peak"] = memory.params_gathered
    held.update(memory.offloaded(layout.offload_mode))
    if layout.zero == 3 and (layout.zero_bucket_size or layout.offload_params):
        held["zero_buffers"] = memory.zero_buffers
    if layout.contiguous_buffers and layout.recompute in FORWARD_AGAIN:
        held["activation_buffer"] = memory.activation_buffer
    return {"bytes": {**held, "activations_peak": memory.activations},
            "comm_bytes": dict(ledger.sent), "comm_payload_bytes": dict(ledger.payload),
            "comm_calls": ledger.calls_by_kind()}


def plan_training(model_config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                  global_batch: int, space: TrainSpace = TrainSpace(),
                  top: int = 5, rank_by: str = "time") -> SearchResult:
    return search_training(model_config, cluster, workload, global_batch, space, top, rank_by)


def plan_serving(model_config: ModelConfig, cluster: Cluster, workload: ServeWorkload,
                 space: ServeSpace = ServeSpace(), top: int = 5,
                 rank_by: str = "cost") -> SearchResult:
    return search_serving(model_config, cluster, workload, space, top, rank_by)
