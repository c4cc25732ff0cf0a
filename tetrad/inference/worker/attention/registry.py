"""The attention backends by name. `--attention auto` asks the backends that may be picked
(`automatic`), in the order listed here, whether they run on the device with this block size and
cache, and takes the first that does; where none does it gathers (`auto`: SDPA, or the tiled
kernel when the copy would be large), with a warning that says why.

On a GPU Triton comes first: it reads the pool in place with any block size, on any torch that
brings triton, and keeps the MLA latent cache in place; torch's paged flash-attention (`varlen`)
wants blocks of 256 and a torch from 2.12 on, so it is asked second. On a CPU the C++ kernel comes
first (Triton runs there only under its interpreter, for tests).

FlexAttention is never picked: its GPU kernels refused the engine's pages and prefill chunks on an
H100 with torch 2.11 (16-token pages: no kernel config for decode; Q blocks of a chunk's length,
such as 300, not a multiple of its tiles); `--attention flex` stays for those who try it.
"""

from __future__ import annotations

import warnings

import torch

from tetrad.errors import ConfigError
from tetrad.inference.worker.attention.base import AttentionBackend
from tetrad.inference.worker.attention.cpu import CpuKernelBackend
from tetrad.inference.worker.attention.flex import FlexBackend
from tetrad.inference.worker.attention.sdpa import SdpaBackend
from tetrad.inference.worker.attention.tiled import SizedGatheringBackend, TiledBackend
from tetrad.inference.worker.attention.triton import TritonBackend
from tetrad.inference.worker.attention.varlen import VarlenBackend

FALLBACK = SizedGatheringBackend  # named "auto": what auto gathers with
# Name -> backend, in auto's order of preference (in place and fastest first).
BACKENDS: dict[str, type[AttentionBackend]] = {backend.name: backend for backend in (
    FALLBACK,
    CpuKernelBackend,
    TritonBackend,
    VarlenBackend,
    FlexBackend,
    SdpaBackend,
    TiledBackend,
)}


def register(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """Lists a backend under its name, after those listed above (usable as a decorator)."""
    BACKENDS[backend.name] = backend
    return backend


def _refusal(backend: type[AttentionBackend], device: torch.device, block_size: int,
             latent: bool, dtype: torch.dtype | None) -> str | None:
    if dtype == torch.float8_e4m3fn and not backend.reads_fp8:
        return (f"--attention {backend.name} reads no fp8 KV cache (--kv-cache-dtype fp8): use "
                f"--attention sdpa, tiled or auto")
    return backend.refusal(device, block_size, latent, dtype)


def resolve_backend(attention: str, device: torch.device, block_size: int, latent: bool = False,
                    dtype: torch.dtype | None = None) -> str:
    """The name of the backend that runs: `attention` itself when it can run here (else one
    ConfigError saying why), or for "auto" the first automatic backend that can. `latent`: MLA's
    cache, whose values are narrower than its keys; dtype None: not known yet."""
    if attention not in BACKENDS:
        raise ConfigError(f"attention must be one of {', '.join(BACKENDS)}, got {attention!r}")
    if attention != FALLBACK.name:
        reason = _refusal(BACKENDS[attention], device, block_size, latent, dtype)
        if reason:
            raise ConfigError(reason)
        return attention
    candidates = [backend for backend in BACKENDS.values()
                  if backend.automatic and device.type in backend.devices]
    reasons = [_refusal(backend, device, block_size, latent, dtype) for backend in candidates]
    for backend, reason in zip(candidates, reasons):
        if reason is None:
            return backend.name
    where = "CPU" if device.type == "cpu" else "GPU"
    warnings.warn(f"gathering attention on the {where}: {'; '.join(filter(None, reasons))}",
                  stacklevel=2)
    return FALLBACK.name
