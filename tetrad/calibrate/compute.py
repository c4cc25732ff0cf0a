"""Microbenchmarks of one rank's compute, as tetrad's trainer runs it (one thread per rank on CPU):
matmul throughput across shapes, attention, streaming element-wise work, the optimizer step, and
what eager PyTorch pays per operator in forward and in backward.

Each measurement is the median of repeated timings after a warm-up. Every function returns plain
numbers; tetrad.calibrate.profile turns them into a hardware profile.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.memory import ActivationMeter

# GEMM shapes (m, n, k) from tiny to the largest that stays well under a second on one core:
# the efficiency curve's points. Square-ish, as a transformer's projections are.
CPU_MATMUL_SHAPES = ((1, 1, 1), (8, 16, 16), (16, 32, 32), (32, 64, 64), (64, 128, 64),
                     (128, 128, 128), (128, 256, 256), (256, 512, 256), (512, 512, 512),
                     (1024, 1024, 512))
# A GPU runs the CPU's largest product in a few microseconds, about its launch cost: its curve
# goes on to the sizes a model's layers have (an H100 calibrated with the CPU's shapes alone
# reported 0.995 of peak, from a 1 GFLOP product whose time was mostly the launch it subtracts).
MATMUL_SHAPES = {"cpu": CPU_MATMUL_SHAPES,
                 "cuda": CPU_MATMUL_SHAPES + ((2048, 2048, 2048), (4096, 4096, 4096),
                                              (16384, 2048, 5632), (8192, 8192, 8192))}
# Per fp32 operand: beyond a CPU's caches (16 MiB) and a GPU's L2 (256 MiB).
ELEMENTWISE_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}
OPTIMIZER_SMALL_TENSORS = 64  # tiny tensors: the per-tensor cost
OPTIMIZER_LARGE_ELEMENTS = 2**21  # one large tensor: the per-element cost
# fp32 elements of the offload copies timed: 1 to 16 MiB, a ZeRO-3 unit's shard.
HOST_COPY_ELEMENTS = (2**18, 2**20, 2**22)


class Timer:
    """Times a callable on `device`, synchronizing CUDA around it."""

    def __init__(self, device: torch.device, budget_s: float):
        self.device = device
        self.budget_s = budget_s  # spent on the repetitions of one measurement

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], object], min_reps: int = 5) -> float:
        fn()
        self.sync()
        times: list[float] = []
        spent = 0.0
        while len(times) < min_reps or (spent < self.budget_s and len(times) < 2000):
            started = time.perf_counter()
            fn()
            self.sync()
            elapsed = time.perf_counter() - started
            times.append(elapsed)
            spent += elapsed
        return statistics.median(times)


class OperatorCount(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (the planner counts the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def matmul_points(timer: Timer, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of one torch.mm per shape of MATMUL_SHAPES for the timer's device."""
    points = []
    for m, n, k in MATMUL_SHAPES[timer.device.type]:
        a = torch.randn(m, k, device=timer.device, dtype=dtype)
        b = torch.randn(k, n, device=timer.device, dtype=dtype)
        points.append((2.0 * m * n * k, timer.median(lambda: torch.mm(a, b))))
    return points


def peak_matmul(timer: Timer, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of a large square GEMM."""
    a = torch.randn(size, size, device=timer.device, dtype=dtype)
    b = torch.randn(size, size, device=timer.device, dtype=dtype)
    return 2.0 * size**3 / timer.median(lambda: torch.mm(a, b), min_reps=3)


def attention_points(timer: Timer, shapes: tuple[tuple[int, int, int, int], ...],
                     dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of causal SDPA forward + backward: [batch, heads, seq, head_dim]; the
    planner's count (flops.attention_core_flops): 4 s(s+1)/2 d per head forward, 2.5x that
    backward."""
    points = []
    for batch, heads, seq, dim in shapes:
        q, k, v = (torch.randn(batch, heads, seq, dim, device=timer.device, dtype=dtype,
                               requires_grad=True) for _ in range(3))

        def run() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        forward_flops = 4.0 * seq * (seq + 1) / 2 * dim * heads * batch
        points.append((3.5 * forward_flops, timer.median(run)))
    return points


def stream_bandwidth(timer: Timer) -> float:
    """Bytes per second of out = a + b over operands larger than the caches."""
    elements = ELEMENTWISE_ELEMENTS[timer.device.type]
    a = torch.randn(elements, device=timer.device)
    b = torch.randn(elements, device=timer.device)
    out = torch.empty_like(a)
    seconds = timer.median(lambda: torch.add(a, b, out=out))
    return 3 * a.numel() * a.element_size() / seconds


def _tiny_block(x: torch.Tensor, weight: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """The operator mix of a transformer block at a size where no operator has work to do:
    a norm, a projection, views, a gated activation and a residual add."""
    normed = gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    h = F.linear(normed, weight)
    gate, up = h.chunk(2, dim=-1)
    y = (F.silu(gate) * up).view(x.shape[0], -1, 2).transpose(1, 2).reshape(x.shape)
    return x + y


def operator_costs(timer: Timer) -> tuple[float, float]:
    """Seconds per ATen operator of eager forward (autograd recording, under the activation
    meter every tetrad strategy runs its forward in) and of backward."""
    x = torch.randn(2, 8, device=timer.device, requires_grad=True)
    weights = nn.ParameterDict({"weight": torch.randn(16, 8, device=timer.device),
                                "gain": torch.ones(8, device=timer.device)})
    meter = ActivationMeter(weights)

    def chain() -> torch.Tensor:
        y = x
        with meter.measure():
            for _ in range(8):
                y = _tiny_block(y, weights["weight"], weights["gain"])
        meter.finish_microbatch()
        return y.sum()

    with OperatorCount() as forward_ops:
        loss = chain()
    with OperatorCount() as backward_ops:
        loss.backward()
    forward_s = timer.median(chain)

    def both() -> None:
        chain().backward()

    backward_s = max(timer.median(both) - forward_s, 0.0)
    return forward_s / forward_ops.count, backward_s / backward_ops.count


def optimizer_costs(timer: Timer, bandwidth: float) -> tuple[float, float]:
    """(seconds per parameter tensor, bytes-per-second it streams at) of torch's AdamW step."""

    def adamw(params: list[torch.Tensor]) -> Callable[[], None]:
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        return optimizer.step

    small = [torch.zeros(4, device=timer.device, requires_grad=True)
             for _ in range(OPTIMIZER_SMALL_TENSORS)]
    per_tensor = timer.median(adamw(small)) / OPTIMIZER_SMALL_TENSORS
    large = [torch.zeros(OPTIMIZER_LARGE_ELEMENTS, device=timer.device, requires_grad=True)]
    seconds = max(timer.median(adamw(large)) - per_tensor, 1e-9)
    # The planner's count of what the step moves per element (compute.optimizer_time): read the
    # gradient, read and write the weight and both moments.
    streamed = OPTIMIZER_LARGE_ELEMENTS * 4 * (1 + 2 * 2 + 1)
    return per_tensor, min(bandwidth, streamed / seconds)


def host_copy_costs(timer: Timer) -> tuple[float, float]:
    """(seconds per copy, bytes per second) of the copies `--offload params` makes of a shard
    (tetrad/parallel/fsdp.py): each into its staging buffer on the other side, allocated once
    (offload.ShardStaging), host -> device before a gather and device -> host after a reduction.
    A least-squares line through the medians of both directions at HOST_COPY_ELEMENTS, a ZeRO-3
    unit's shard sizes."""
    pinned = torch.cuda.is_available()
    points = []
    for elements in HOST_COPY_ELEMENTS:
        on_host, host_staging = (torch.randn(elements).pin_memory() if pinned
                                 else torch.randn(elements) for _ in range(2))
        on_device, device_staging = (torch.randn(elements, device=timer.device)
                                     for _ in range(2))
        inward = timer.median(lambda: device_staging.copy_(on_host))
        outward = timer.median(lambda: host_staging.copy_(on_device))
        points.append((elements * on_host.element_size(), (inward + outward) / 2))
    mean_bytes = statistics.fmean(nbytes for nbytes, _ in points)
    mean_s = statistics.fmean(seconds for _, seconds in points)
    slope = (sum((nbytes - mean_bytes) * (seconds - mean_s) for nbytes, seconds in points)
             / sum((nbytes - mean_bytes) ** 2 for nbytes, _ in points))
    slope = max(slope, 1e-15)
    return max(0.0, mean_s - slope * mean_bytes), 1.0 / slope
