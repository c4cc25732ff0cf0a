"""How close real kernels and collectives get to a device's datasheet peaks (EfficiencyProfile):
the fractions the catalog calibrates per architecture (tetrad.hardware.catalog) and everything `tetrad
calibrate` measures on the machine at hand, which the shared time model reads. No torch here: the
planner runs on a laptop.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EfficiencyProfile:
    """Achievable fractions of the datasheet peaks, and the fixed costs that hurt small work.

    matmul: fraction of dense peak a large GEMM reaches (cuBLAS / CUTLASS).
    attention: fraction of dense peak the vendor's fused attention kernel reaches (cuDNN /
        Transformer Engine, FlashAttention-3 on Hopper).
    portable_attention: the same for FlashAttention-2 / Triton kernels (PyTorch SDPA's flash
        backend, eager stacks), which are not tuned for every architecture.
    memory: fraction of HBM bandwidth a streaming kernel reaches.
    kernel_overhead_s: launch and tail cost paid by every kernel, so small matmuls are slow.
    intra_link / inter_link: fraction of NVLink-or-PCIe / NIC bandwidth a collective reaches.
    intra_latency_s / inter_latency_s: per-hop latency of a collective inside / across nodes.
    comm_interference: compute slowed per second of collective overlapped with it (NCCL's SMs).

    A profile measured by `tetrad calibrate` (tetrad/calibrate) also carries what a datasheet
    cannot say, each left empty (zero) in the catalog, where the formulas above stand alone:
    matmul_curve: (FLOPs of one GEMM, fraction of peak it reaches) points, ascending: the
        efficiency curve across shapes, interpolated in log FLOPs (the plateau beyond the ends).
    op_forward_s / op_backward_s: what eager PyTorch pays per dispatched operator in the forward
        pass and per operator autograd runs in the backward pass (Python, dispatch, autograd).
    optimizer_tensor_s: the optimizer step's fixed cost per parameter tensor (torch's AdamW
        runs a handful of operators per tensor); optimizer_memory the fraction of the memory
        bandwidth its streaming reaches (0: `memory`, a fused kernel's).
    collectives: (kind, group size, alpha s, beta s/byte) fits of each collective by group size,
        time = alpha + beta * the bytes the call is handed (the full tensor; p2p the message).
    concurrent_ranks: ranks that compute at full speed at once on the machine (its cores, one
        thread each); 0 means every rank has a device of its own.
    step_scale: a whole eager training step of a calibration model measured against the sum of
        the parts above (module calls and hooks, the autograd engine, element-wise kernels slower
        than streaming, clipping): every rank's compute is scaled by it (0: 1).
    concurrent_slowdown: (ranks, factor) points: how much longer that step takes when that many
        ranks run it at once on the machine (shared cores, caches and memory), ascending.
    sync_wait: (ranks, seconds) points: what one small collective between pairs of ranks costs
        beyond their compute when that many ranks alternate compute and such calls (a blocked
        peer waits for a core), ascending.
    sync_wait_back_to_back: (ranks, seconds) points: the same with no compute between calls.
    call_cpu: (ranks, seconds) points: the CPU time one such call adds to its rank's process
        beyond the call's own latency (the backend's threads, sleeping and waking), when that
        many ranks alternate compute and calls: what a call costs where the ranks outnumber the
        cores and the step is their total work over the cores (tetrad.planner.eager_time).
    call_compute_s: a rank's time outside the wait that one collective call between
        computations costs (the call layer's host work, the compute after it slower), measured
        on 2 ranks within the cores.
    host_copy_s / host_copy_bandwidth: one copy of a shard into a tensor of its own across the
        host link, as parameter offload makes it, = host_copy_s + bytes / host_copy_bandwidth
        (0: the link's bandwidth alone; tetrad.planner.offload_time).
    """

    matmul: float
    attention: float
    memory: float
    kernel_overhead_s: float
    intra_link: float
    inter_link: float
    intra_latency_s: float
    inter_latency_s: float
    portable_attention: float = 0.0  # 0: as fast as `attention`
    fp8_matmul: float = 0.0  # fraction of the fp8 peak an fp8 GEMM reaches; 0: `matmul`
    comm_interference: float = 0.0
    matmul_curve: tuple[tuple[float, float], ...] = ()
    op_forward_s: float = 0.0
    op_backward_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    optimizer_memory: float = 0.0
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    concurrent_ranks: int = 0
    step_scale: float = 0.0
    concurrent_slowdown: tuple[tuple[int, float], ...] = ()
    sync_wait: tuple[tuple[int, float], ...] = ()
    sync_wait_back_to_back: tuple[tuple[int, float], ...] = ()
    call_cpu: tuple[tuple[int, float], ...] = ()
    call_compute_s: float = 0.0
    host_copy_s: float = 0.0
    host_copy_bandwidth: float = 0.0

    def slowdown(self, ranks: int) -> float:
        """Factor on a rank's compute when `ranks` compute at once: the measured points,
        interpolated; beyond the last, its factor grows with the ranks (they queue for cores)."""
        return max(1.0, by_ranks(self.concurrent_slowdown, ranks, 1.0))

    def sync_wait_s(self, ranks: int) -> float:
        """Seconds a collective call waits for its peers to get a core when `ranks` ranks
        compute between their calls (0: none measured)."""
        return max(0.0, by_ranks(self.sync_wait, ranks, 0.0))

    def sync_wait_back_to_back_s(self, ranks: int) -> float:
        """sync_wait_back_to_back at `ranks` (0: none measured)."""
        return max(0.0, by_ranks(self.sync_wait_back_to_back, ranks, 0.0))

    def call_cpu_s(self, ranks: int) -> float:
        """call_cpu at `ranks` (0: none measured)."""
        return max(0.0, by_ranks(self.call_cpu, ranks, 0.0))

    def matmul_efficiency(self, flops: float) -> float:
        """Fraction of peak a GEMM of `flops` reaches: the measured curve, else `matmul`."""
        curve = self.matmul_curve
        if not curve:
            return self.matmul
        sizes = [size for size, _ in curve]
        index = bisect.bisect_left(sizes, flops)
        if index == 0:
            return curve[0][1]
        if index == len(curve):
            return curve[-1][1]
        (low, low_eff), (high, high_eff) = curve[index - 1], curve[index]
        weight = math.log(flops / low) / math.log(high / low)
        return low_eff + weight * (high_eff - low_eff)

    def attention_efficiency(self, portable: bool) -> float:
        return self.portable_attention if portable and self.portable_attention else self.attention

    def matmul_time(self, flops: float, bytes_moved: float, peak_flops: float,
                    memory_bandwidth: float, fp8: bool = False) -> float:
        """Roofline of one GEMM plus its fixed overhead: the efficiency falls with the size."""
        efficiency = (self.fp8_matmul if fp8 and self.fp8_matmul
                      else self.matmul_efficiency(flops))
        return (max(flops / (peak_flops * efficiency),
                    bytes_moved / (memory_bandwidth * self.memory))
                + self.kernel_overhead_s)

    def collective_fit(self, kind: str, group_size: int) -> tuple[float, float] | None:
        """(alpha, beta) of `kind` over `group_size` ranks: the measured fit of that size, else
        of the nearest measured size with alpha and beta scaled as a ring's steps and volume
        scale; None when the profile measured no such collective."""
        fits = {size: (alpha, beta) for name, size, alpha, beta in self.collectives
                if name == kind}
        if not fits:
            return None
        if group_size in fits:
            return fits[group_size]
        nearest = min(fits, key=lambda size: (abs(math.log(size / group_size)), size))
        alpha, beta = fits[nearest]
        if kind == "p2p":
            return alpha, beta
        steps = (group_size - 1) / max(1, nearest - 1)
        volume = ((group_size - 1) / group_size) / ((nearest - 1) / nearest)
        return alpha * steps, beta * volume


def by_ranks(points: tuple[tuple[int, float], ...], ranks: int, alone: float) -> float:
    """A measured (ranks, value) curve at `ranks`: interpolated between points, `alone` at one
    rank or none measured, and beyond the last point growing with the ranks (they queue)."""
    if not points or ranks <= 1:
        return alone
    sizes = [size for size, _ in points]
    index = bisect.bisect_left(sizes, ranks)
    if index == len(points):
        size, value = points[-1]
        return value * ranks / size
    if sizes[index] == ranks or index == 0:
        return points[index][1]
    (low, low_value), (high, high_value) = points[index - 1], points[index]
    return low_value + (ranks - low) / (high - low) * (high_value - low_value)
