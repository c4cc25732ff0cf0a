"""The engine's C++ CPU kernels (paged_decode.cpp: decode attention read in place from the paged
pool, its arithmetic in attend_rows.h; decode_step.cpp: a Llama-family model's decode step as one
op, and the matmul that streams weights for a decode batch's rows, stream_rows.h; quant_rows.cpp:
the same for int8 and int4 weights), built into one library with the machine's C++ compiler on
first use and loaded as torch.ops.tetrad.*.

No build system is needed: one g++ call against torch's own headers and libraries. The library
is cached under ~/.cache/tetrad/kernels (TETRAD_KERNEL_CACHE overrides) by a hash of the source,
the torch version, the flags and the CPU (-march=native code may not run on another), so a
process after the first only loads it; a file lock keeps processes that start together
(tensor-parallel ranks) from building it twice at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode.cpp", "decode_step.cpp", "quant_rows.cpp"))
HEADERS = tuple(Path(__file__).with_name(name)  # in the cache key, not on the command
                for name in ("stream_rows.h", "attend_rows.h"))
# -march=native: the library is built on the machine that runs it (the cache is per machine);
# -ffast-math lets the compiler vectorize exp and the dot products (the kernel keeps no inf);
# -fopenmp: at::parallel_for is a header template that splits work over torch's threads only in
# code built with OpenMP (without it every kernel ran on one thread); the library then uses the
# libgomp torch has already loaded (same soname), not a second thread pool.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-shared",
         "-fPIC", "-w"]


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here (no C++ compiler, or the build failed)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("TETRAD_KERNEL_CACHE")
                or Path.home() / ".cache" / "tetrad" / "kernels")


def _cpu_identity() -> str:
    """The CPU's model name and instruction-set flags (Linux), else the architecture's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return "".join(next((line for line in lines if line.startswith(key)), "")
                   for key in ("model name", "flags")) or platform.machine()


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler (g++) on this machine")
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{sysconfig.get_paths()['include']}",
               *(f"-I{path}" for path in include_paths()), *map(str, SOURCES),
               *(f"-L{path}" for path in library_paths()),
               *(f"-Wl,-rpath,{path}" for path in library_paths()),
               "-lc10", "-ltorch_cpu", "-ltorch"]
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True)
        except OSError as error:
            raise KernelUnavailable(f"cannot run the C++ compiler {compiler}: {error}") from None
        if result.returncode:
            raise KernelUnavailable(f"building {' and '.join(s.name for s in SOURCES)} failed: "
                                    f"{result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # whole or absent, for a process that loads it meanwhile


@cache
def load_cpu_kernels() -> None:
    """Build (once per machine) and load the kernels; KernelUnavailable says why not."""
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS)
                         + torch.__version__.encode()
                         + " ".join(FLAGS).encode() + _cpu_identity().encode()).hexdigest()[:16]
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"paged_decode-{key}.so"
    with open(folder / f"paged_decode-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build(target)
    torch.ops.load_library(str(target))


def cpu_kernels_available() -> bool:
    try:
        load_cpu_kernels()
    except KernelUnavailable:
        return False
    return True
