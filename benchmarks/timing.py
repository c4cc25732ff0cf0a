"""What the multi-rank benchmarks share: a step timed between barriers, so every rank's clock
covers the slowest rank's work."""

from __future__ import annotations

import time

import torch.distributed as dist


def timed(fn) -> tuple[float, object]:
    """(seconds, fn's value): the time from a barrier before fn to a barrier after it."""
    dist.barrier()
    started = time.perf_counter()
    value = fn()
    dist.barrier()
    return time.perf_counter() - started, value
