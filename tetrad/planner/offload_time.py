"""What offloading ZeRO-3's shards adds to a step (--offload params / nvme): every all-gather of
a unit starts from a copy of its shard brought from host memory, and every reduce-scattered
gradient shard goes back to host memory (tetrad.parallel.offload). Per microbatch a unit is
gathered for its forward and again for its backward (zero bubble's W, off the first stage,
once more), and reduced once.

The host link, where `tetrad calibrate` timed the offload's own copies (host_copy_s,
host_copy_bandwidth: each into a staging buffer allocated once, tetrad.parallel.offload's
ShardStaging; a fixed cost per copy and a rate): those, copy by copy, as measured (a step makes
them at that rate; the profile's step_scale, fitted on a step without them, leaves them alone).
Otherwise a GPU's PCIe per direction, or on a CPU (concurrent_ranks set) a copy within memory
reading and writing every byte at the streaming bandwidth. NVMe offload's shard files are read
through the page cache like host memory; the writes back to the device under it are not priced
(no profile measures a disk)."""

from __future__ import annotations

from tetrad.hardware.catalog import GPU
from tetrad.planner.eager_params import data_parallel_parameters
from tetrad.planner.eager_state import zero3_units
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.schedules.generate import SPLIT_BACKWARD
from tetrad.spec.model import ModelConfig


def offload_copies(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                   pp_rank: int) -> list[tuple[int, float]]:
    """(number of copies, bytes each) per step of a rank of pipeline rank `pp_rank`: every unit's
    shard to the device at each gather, its gradient shard to the host at each reduction."""
    if not layout.offload_params:
        return []
    copies = []
    for stage, units in zero3_units(data_parallel_parameters(config, layout, pp_rank),
                                    layout.zero_group).items():
        gathers = 3 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 2
        for elements in units.all:
            shard = elements // layout.zero_group
            copies.append((gathers * layout.num_microbatches, shard * precision.param_bytes))
            copies.append((layout.num_microbatches, shard * precision.grad_bytes))
    return copies


def host_link_time(gpu: GPU, nbytes: float) -> float:
    """Seconds of one copy of `nbytes` between host and device memory (module doc)."""
    efficiency = gpu.efficiency
    if efficiency.host_copy_bandwidth:
        return efficiency.host_copy_s + nbytes / efficiency.host_copy_bandwidth
    if efficiency.concurrent_ranks:  # a CPU: a copy reads and writes each byte
        return 2 * nbytes / gpu.host_memory_bandwidth
    return nbytes / gpu.pcie_bandwidth


def offload_time(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                 gpu: GPU, pp_rank: int) -> float:
    """Seconds per step the shards' copies across the host link take (not overlapped: tetrad
    makes each copy when its gather or reduction needs it)."""
    return sum(count * host_link_time(gpu, nbytes)
               for count, nbytes in offload_copies(config, layout, precision, pp_rank))
