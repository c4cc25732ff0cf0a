"""Weights a GPU holds beyond its own shard: ZeRO-3's parameters gathered whole, the FP8 copies
of fp8 training, and the whole pipeline stage FSDP2 keeps gathered under pipeline parallelism.

FSDP2 under pipeline parallelism (torchtitan's default `reshard_after_forward = not pp_enabled`,
torchtitan/models/llama3/infra/parallelize.py, "to avoid per-microbatch all-gathers"; and
torch.distributed.pipelining's stage, which turns gradient synchronization and resharding off
for every backward but the step's last): a stage's parameters stay gathered from the first
microbatch's forward to the last one's backward, and their gradients accumulate unsharded until
one reduce-scatter at the step's end. FSDP2 keeps that accumulation in its reduce dtype
(FSDPParam.to_accumulated_grad_if_needed), fp32 under torchtitan's default
mixed_precision_reduce.
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.spec.model import ModelConfig
from tetrad.planner.layout import TrainLayout, stage_first_layer, stage_layer_counts
from tetrad.planner.model_stats import kv_replica_params, layer_params
from tetrad.planner.precision import TrainingPrecision

# FP8 training keeps, beside each 16-bit weight of the block linears, an FP8 copy in both
# usages: row-wise for the forward GEMM and a physically transposed column-wise one for the
# backward's data gradient, since Hopper's FP8 GEMMs take only the TN layout (Transformer
# Engine's docs, "Performance considerations: handling transposes"). Megatron-Core casts them at
# a step's first microbatch and reuses them for the rest (is_first_microbatch), so they live all
# step: one byte each, two per weight.
FP8_WEIGHT_COPY_BYTES = 2.0
UNSHARDED_GRAD_BYTES = 4.0  # the fp32 reduce dtype FSDP2 accumulates unsharded gradients in


def keeps_stage_whole(layout: TrainLayout, whole_stage_under_pp: bool) -> bool:
    """Whether ZeRO-3 keeps the stage gathered all step (module doc): FSDP2 under pp > 1."""
    return whole_stage_under_pp and layout.zero >= 3 and layout.pp > 1


def fp8_weight_copy_bytes(config: ModelConfig, layout: TrainLayout,
                          precision: TrainingPrecision, stage: int,
                          live_params: float = 0.0, whole_stage: bool = False) -> float:
    """Bytes of the FP8 weight copies one GPU of `stage` holds in fp8 training: its share of
    every block linear (tensor- and expert-sharded matmul weights), or under ZeRO-3 only the
    gathered units' (cast after each gather, freed with them) unless the stage stays whole."""
    if precision.compute_dtype != "fp8":
        return 0.0
    if layout.zero >= 3 and not whole_stage:
        gathered = gathered_params_bytes(config, layout, precision, live_params)
        return gathered / precision.param_bytes * FP8_WEIGHT_COPY_BYTES
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = stage_first_layer(counts, stage)
    linear = 0.0
    for layer in range(first, first + counts[stage]):
        params = layer_params(config, layer)
        linear += (params.tp_sharded / layout.tp + kv_replica_params(config, layout.tp)
                   + params.experts / (layout.ep * layout.expert_tp))
    return linear * FP8_WEIGHT_COPY_BYTES


def gathered_params_bytes(config: ModelConfig, layout: TrainLayout,
                          precision: TrainingPrecision, live_params: float = 0.0,
                          whole_stage_elements: float = 0.0) -> float:
    """ZeRO-3's whole parameters on one GPU at the peak: FSDP gathers one block while
    prefetching the next, two full blocks in flight; DeepSpeed gathers sub-modules and keeps at
    most `live_params` elements whole (stage3_max_live_parameters), when that is fewer; FSDP2
    under pipeline parallelism the whole stage, `whole_stage_elements` (keeps_stage_whole)."""
    if layout.zero < 3:
        return 0.0
    if whole_stage_elements:
        return whole_stage_elements * precision.param_bytes
    blocks = 2 * _biggest_layer(config) / layout.tp
    return (min(blocks, live_params) if live_params else blocks) * precision.param_bytes


@lru_cache(maxsize=256)
def _biggest_layer(config: ModelConfig) -> int:
    return max(layer_params(config, layer).total for layer in range(config.num_layers))
