"""What a training process holds on its GPU beyond its tensors, line by line: the CUDA context
and the cuBLAS workspace, NCCL's buffers for each communicator the layout opens, and the
caching allocator's reserve. A layout fits when its tensors plus these lines fit the GPU's
memory; `usable_tensor_memory` is what that leaves for the tensors.

Sources:
  CUDA context  ~400 MB once a PyTorch process touches the GPU, with lazy module loading (CUDA
                11.7 and later, PyTorch's default): NVIDIA's ptrblck, pytorch/pytorch#109888
                (pytorch/pytorch#86509 measured 287 MB with lazy loading, 667 MB without).
  cuBLAS        32 MiB cuBLASLt workspace, PyTorch's size on Hopper and later, as the cuBLAS
                reference recommends (pytorch/pytorch#120925; 4 MiB before Hopper, a difference
                below the other lines' precision).
  NCCL          per communicator, measured on 4 NVLink A100s with one 4 MB all-reduce each
                (NVIDIA/nccl#964): 544 MiB for a two-rank group, 688 MiB for a larger one (ring
                and tree connections). NCCL's maintainer: memory grows with the number of
                communicators and linearly with channels, and stops growing beyond two nodes
                (NVIDIA/nccl#864, #986); an H100 opens more channels than an A100, so these are
                floors there.
  allocator     reserved over allocated at the peak of tetrad's own H100 training runs
                (BENCHMARKS.md, "Training on one GPU": eager, compiled, FP8 and HF rows): the
                caching allocator rounds blocks and strands freed ones between sizes; the median
                of the six readings is taken.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tetrad.planner.layout import TrainLayout

MiB = 2**20
CUDA_CONTEXT_BYTES = 400e6
CUBLAS_WORKSPACE_BYTES = 32 * MiB
NCCL_PAIR_COMMUNICATOR_BYTES = 544 * MiB
NCCL_GROUP_COMMUNICATOR_BYTES = 688 * MiB
# (allocated, reserved) peak GiB, BENCHMARKS.md "Training on one GPU", both H100 calls.
MEASURED_ALLOCATOR_PEAKS = ((49.49, 54.58), (34.14, 35.09), (26.87, 27.25), (57.57, 65.66),
                            (34.14, 35.09), (26.87, 28.30))
ALLOCATOR_RESERVE_SHARE = statistics.median(
    reserved / allocated for allocated, reserved in MEASURED_ALLOCATOR_PEAKS) - 1


@dataclass(frozen=True, slots=True)
class RuntimeReserve:
    """Bytes one GPU holds outside the tensors the memory breakdown counts."""

    cuda_context: float  # context and cuBLAS workspace
    nccl_buffers: float  # every communicator the layout opens
    allocator_share: float  # caching allocator's reserve, per byte of tensors

    @property
    def fixed(self) -> float:
        return self.cuda_context + self.nccl_buffers

    def allocator_reserve(self, tensor_bytes: float) -> float:
        return self.allocator_share * tensor_bytes

    def lines(self, tensor_bytes: float) -> dict[str, float]:
        """The report's lines, by name."""
        return {"cuda_context": self.cuda_context, "nccl_buffers": self.nccl_buffers,
                "allocator_reserve": self.allocator_reserve(tensor_bytes)}


def communicator_sizes(layout: TrainLayout) -> tuple[int, ...]:
    """Sizes of the NCCL communicators one rank of `layout` opens and uses: tensor, context,
    pipeline (send/receive between neighbouring stages), the data-parallel group of the dense
    gradients (dp x cp), and with experts the expert-parallel group and the group sharing each
    expert's gradients."""
    groups = [layout.tp, layout.cp, layout.pp, layout.zero_group]
    if layout.ep > 1:
        groups += [layout.ep, layout.expert_zero_group]
    return tuple(size for size in groups if size > 1)


def nccl_buffer_bytes(layout: TrainLayout) -> float:
    return sum(NCCL_PAIR_COMMUNICATOR_BYTES if size == 2 else NCCL_GROUP_COMMUNICATOR_BYTES
               for size in communicator_sizes(layout))


def runtime_reserve(layout: TrainLayout) -> RuntimeReserve:
    return RuntimeReserve(CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES, nccl_buffer_bytes(layout),
                          ALLOCATOR_RESERVE_SHARE)


def usable_tensor_memory(gpu_memory: float, layout: TrainLayout) -> float:
    """Bytes of tensors that fit a GPU of `gpu_memory` bytes once `layout`'s runtime reserve is
    held: tensors t fit when t (1 + allocator share) + context + NCCL <= the GPU's memory."""
    reserve = runtime_reserve(layout)
    return (gpu_memory - reserve.fixed) / (1 + reserve.allocator_share)
