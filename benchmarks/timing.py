"""What the benchmarks share: a step timed between barriers, so every rank's clock covers the
slowest rank's work; and a GPU call's median time by CUDA events."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def timed(fn) -> tuple[float, object]:
    """(seconds, fn's value): the time from a barrier before fn to a barrier after it."""
    dist.barrier()
    started = time.perf_counter()
    value = fn()
    dist.barrier()
    return time.perf_counter() - started, value


def cuda_median_seconds(call, warmup: int, repeats: int) -> float:
    """The median of `repeats` timings of call() on the GPU, by CUDA events, after `warmup`
    untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
