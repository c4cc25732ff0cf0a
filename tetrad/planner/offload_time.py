"""What offloading ZeRO-3's shards adds to a step (--offload params / nvme): every all-gather of
a unit starts from a copy of its shard brought from host memory, and every reduce-scattered
gradient shard goes back to host memory (tetrad.parallel.offload). Per microbatch a unit is
gathered for its forward and again for its backward (zero bubble's W, off the first stage,
once more), and reduced once.

The host link: a GPU's PCIe, per direction; on a CPU (a calibrated profile: concurrent_ranks
set) a copy within memory, which reads and writes every byte at the streaming bandwidth
`tetrad calibrate` measured. NVMe offload's shard files are read through the page cache like
host memory; the writes back to the device under it are not priced (no profile measures a
disk)."""

from __future__ import annotations

from tetrad.hardware.catalog import GPU
from tetrad.planner.eager_state import zero3_shards
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.schedules.generate import SPLIT_BACKWARD
from tetrad.spec.model import ModelConfig


def offload_bytes(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                  pp_rank: int) -> tuple[float, float]:
    """(to the device, to the host) bytes per step of a rank of pipeline rank `pp_rank`."""
    if not layout.offload_params:
        return 0.0, 0.0
    inward = outward = 0.0
    for stage, elements in zero3_shards(config, layout, pp_rank).items():
        gathers = 3 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 2
        inward += gathers * elements * precision.param_bytes
        outward += elements * precision.grad_bytes
    return inward * layout.num_microbatches, outward * layout.num_microbatches


def host_link_time(gpu: GPU, nbytes: float) -> float:
    """Seconds to move `nbytes` between host and device memory (module doc)."""
    if gpu.efficiency.concurrent_ranks:  # a CPU: a copy reads and writes each byte
        return 2 * nbytes / gpu.host_memory_bandwidth
    return nbytes / gpu.pcie_bandwidth


def offload_time(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                 gpu: GPU, pp_rank: int) -> float:
    """Seconds per step the shards' copies across the host link take (not overlapped: tetrad
    makes each copy when its gather or reduction needs it)."""
    return sum(host_link_time(gpu, nbytes)
               for nbytes in offload_bytes(config, layout, precision, pp_rank))
