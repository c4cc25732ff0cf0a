"""Loading weights without leaving their transient copies resident (glibc's malloc, Linux).

Loading a checkpoint in another dtype reads each tensor as stored and converts it, and quantizing
at load replaces every 16-bit projection by its int8/int4 values: each step frees a large block
that was in use a moment before. glibc serves a block from its own mapping (returned to the system
when freed) only above a threshold that it raises to the size of every such block freed, up to
32 MiB; after the first free, a model's tensors come from the heap instead, and the freed ones
stay there as holes that the process keeps resident. Serving a 300M-parameter Llama in bf16 from
an fp32 folder, the heap held 823 MB of which 598 MB were weights (benchmarks/cpu_vs_llamacpp.py's
process, /proc/self/smaps).

`large_blocks_mapped()` fixes the threshold at 1 MiB while loading, so every tensor larger than
that has a mapping of its own and a freed one leaves nothing behind; on leaving it sets glibc's
own ceilings (32 MiB, trimming the heap's top past 64 MiB), the state glibc's adjustment reaches
once large blocks have been freed, so that later steps reuse heap memory as before rather than
mapping fresh pages per tensor. Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager
from functools import cache
from typing import Iterator

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LOADING_THRESHOLD = 1 << 20
GLIBC_MMAP_CEILING = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
GLIBC_TRIM_CEILING = 2 * GLIBC_MMAP_CEILING  # what glibc's adjustment sets beside it


@cache
def _mallopt():
    """glibc's mallopt, or None where the C library is another."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc's own symbol: musl and macOS lack it
    except (OSError, AttributeError):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Host blocks over 1 MiB allocated inside get mappings of their own (see the module)."""
    mallopt = _mallopt()
    if mallopt is None:
        yield
        return
    mallopt(M_MMAP_THRESHOLD, LOADING_THRESHOLD)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_CEILING)
        mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_CEILING)
