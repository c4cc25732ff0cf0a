"""ZeRO-R's constant-size and contiguous buffers in tetrad's runtime (the `tetrad` runtime
profile: tetrad.planner.eager), as one rank holds them; each is a line of its own in the memory
breakdown and a byte name of its own in the run report.

- zero_buffers (--zero-bucket-size N, ZeRO-3; tetrad.parallel.zero_buckets): a gather buffer and
  a reduce-scatter buffer, each the largest call the rank makes: group x min(N // group, the
  largest unit shard) elements of the compute dtype (runtime_rules.bucket_buffer_elements),
  however many units or layers the model has. (Without a bucket a unit's gradient is flattened
  into a buffer of the whole unit instead, short-lived and not counted.) Without a bucket size,
  --offload params / nvme's device staging buffer (tetrad.parallel.offload.ShardStaging): the
  largest unit shard in the compute dtype, that each shard is copied into before its gather (its
  host twin, for the reduced gradient shards, is counted with the host gradients).
- activation_buffer (--contiguous-buffers with full or sqrt recomputation; kept_inputs): a slot
  per checkpoint (a block, or a sqrt segment) of every microbatch the rank's pipeline schedule
  keeps in flight at its peak (in_flight_peak; one microbatch without a pipeline), each what the
  checkpoint keeps of its input (kept_input_bytes); those kept inputs then leave the
  activations' count.

--contiguous-buffers' gradient buffers change no byte count (ZeRO's gradient shards, one block).
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.planner.eager_activations import checkpoints, in_flight_peak, kept_input_bytes
from tetrad.planner.eager_params import data_parallel_parameters
from tetrad.planner.eager_state import zero3_units
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig
from tetrad.spec.runtime_rules import bucket_buffer_elements


def zero3_unit_shards(config: ModelConfig, layout: TrainLayout, pp_rank: int) -> list[int]:
    """Elements of each ZeRO-3 unit shard a rank of pipeline rank `pp_rank` holds."""
    return [unit // layout.zero_group
            for units in zero3_units(data_parallel_parameters(config, layout, pp_rank),
                                     layout.zero_group).values()
            for unit in units.all]


@lru_cache(maxsize=1024)
def zero_buffer_bytes(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                      pp_rank: int) -> float:
    """--zero-bucket-size's two buffers, or parameter offload's device staging buffer, on one
    rank of pipeline rank `pp_rank` (0 without either)."""
    if layout.zero != 3:
        return 0.0
    if not layout.zero_bucket_size:
        return (max(zero3_unit_shards(config, layout, pp_rank)) * precision.param_bytes
                if layout.offload_params else 0.0)
    elements = bucket_buffer_elements(zero3_unit_shards(config, layout, pp_rank),
                                      layout.zero_group, layout.zero_bucket_size)
    return 2 * elements * precision.param_bytes


def activation_buffer_bytes(config: ModelConfig, layout: TrainLayout, seq_len: int,
                            precision: TrainingPrecision, pp_rank: int) -> float:
    """--contiguous-buffers' checkpoint slots on one rank of pipeline rank `pp_rank` (0 without,
    or without full/sqrt recomputation)."""
    if not (layout.contiguous_buffers and layout.recompute in FORWARD_AGAIN):
        return 0.0
    slots = in_flight_peak(layout.schedule, layout.pp, layout.schedule_microbatches, layout.vpp,
                           pp_rank, lambda stage: checkpoints(config, layout, stage))
    return slots * kept_input_bytes(config, layout, seq_len, precision)
