"""Where a ZeRO engine keeps its shards (docs/distributed.md, "Offload"), and the files of
`--offload nvme` (ZeRO-Infinity's NVMe offload, Rajbhandari et al. 2021).

- "optimizer": fp32 master, moments and an fp32 gradient copy in host memory (ZeRO-Offload);
- "params": ZeRO-3's parameter and gradient shards in host memory as well: a unit's shard is
  copied into a staging buffer on the device just before its all-gather (which the engine already
  starts one unit ahead of use), and the reduce-scattered gradient into a staging buffer in host
  memory, then added into the host shard (ShardStaging). With fp32 parameters the host parameter
  shard is its own master copy;
- "nvme": the parameter shards, master weights and moments in files (numpy memmaps) under
  --offload-dir, gradients in host memory. The next unit's shard file is read ahead (madvise
  WILLNEED) when a gather starts, the optimizer reads the next shard's state ahead while it
  steps one and writes each stepped shard back behind (msync on a thread).

Host buffers are pinned when a GPU copies to and from them; on a CPU-only machine they are still
buffers of their own, never aliases of the device's, so what crosses the host link is a real
copy there too.
"""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tetrad.spec.layout import ParallelConfig, check_offload_dir

# numpy has no bfloat16: its files hold the raw 16 bits, viewed as bfloat16 by torch.
_FILE_DTYPES = {torch.float32: (np.float32, None), torch.float16: (np.float16, None),
                torch.bfloat16: (np.int16, torch.int16)}


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer, pinned when a GPU will copy to and from it."""
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A separate copy in host memory (pinned when a GPU will copy to and from it). On a CPU-only
    machine this is still a distinct buffer: offload is a real second copy, never an alias."""
    return host_zeros(tensor.numel(), tensor.dtype).view(tensor.shape).copy_(tensor)


class ShardStaging:
    """--offload params' two staging buffers, each the size of the largest unit shard: one on the
    device that a unit's host shard is copied into before its all-gather, one in host memory
    (pinned on a GPU) that a reduced gradient shard is copied into before it is added to the host
    shard. Allocated once and reused, as ZeRO-Offload's pinned buffers are: a copy into a fresh
    tensor of its own would have the allocator find (on a GPU) or the kernel fault in (on a CPU)
    its pages at every gather (on a CPU, about half of them faulted and took several times a
    warm copy's time: BENCHMARKS.md, "Offload"). The device buffer holds one shard at a time:
    `holder` is the unit whose gather still reads it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.on_device = torch.empty(numel, dtype=dtype, device=device)
        self.on_host = host_zeros(numel, dtype)
        self.holder: object | None = None

    def to_device(self, shard: torch.Tensor, holder: object) -> torch.Tensor:
        self.holder = holder
        return self.on_device[:shard.numel()].copy_(shard)

    def to_host(self, reduced: torch.Tensor) -> torch.Tensor:
        return self.on_host[:reduced.numel()].copy_(reduced)

    def device_bytes(self) -> int:
        return self.on_device.numel() * self.on_device.element_size()

    def host_bytes(self) -> int:
        return self.on_host.numel() * self.on_host.element_size()


class OffloadFiles:
    """One rank's files: a folder of its own inside --offload-dir, one file per tensor, removed
    when the process ends (unless kept)."""

    def __init__(self, parent: str, keep: bool):
        check_offload_dir(parent)
        self.folder = tempfile.mkdtemp(prefix=f"tetrad-offload-{os.getpid()}-", dir=parent)
        self.keep = keep
        self._maps: dict[int, np.memmap] = {}  # id(tensor) -> the memmap behind it
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-writer")
        self._written: list[Future] = []
        # multiprocessing's finalizers run when a spawned rank exits (atexit does not there).
        self._finalizer = multiprocessing.util.Finalize(
            self, _close, args=(self._writer, self.folder, keep), exitpriority=10)

    def tensor(self, name: str, initial: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor whose storage is the file `name`, holding `initial`."""
        file_dtype, view = _FILE_DTYPES[initial.dtype]
        array = np.memmap(os.path.join(self.folder, name), dtype=file_dtype, mode="w+",
                          shape=(initial.numel(),))
        tensor = torch.from_numpy(array)
        tensor = tensor.view(initial.dtype) if view is not None else tensor
        tensor.copy_(initial.reshape(-1))
        self._maps[id(tensor)] = array
        return tensor

    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Ask the kernel to start reading these tensors' files now, before they are used."""
        for tensor in tensors:
            array = self._maps.get(id(tensor))
            if array is not None and array.size:
                array._mmap.madvise(mmap.MADV_WILLNEED)

    def write_behind(self, tensors: list[torch.Tensor]) -> None:
        """Write these tensors' pages back to their files on the writer thread."""
        self._written = [f for f in self._written if not f.done()]
        for tensor in tensors:
            array = self._maps.get(id(tensor))
            if array is not None:
                self._written.append(self._writer.submit(array.flush))

    def wait_written(self) -> None:
        for future in self._written:
            future.result()
        self._written = []

    def disk_bytes(self) -> int:
        return sum(array.nbytes for array in self._maps.values())

    def close(self) -> None:
        self.wait_written()
        self._finalizer()


def _close(writer: ThreadPoolExecutor, folder: str, keep: bool) -> None:
    writer.shutdown(wait=True)
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Offload:
    """The engine's side of ParallelConfig.offload_mode, with the files of "nvme"."""

    mode: str = "none"
    files: OffloadFiles | None = None

    @classmethod
    def of(cls, parallel: ParallelConfig) -> "Offload":
        files = (OffloadFiles(parallel.offload_dir, parallel.offload_keep)
                 if parallel.offload_files else None)
        return cls(parallel.offload_mode, files)

    @classmethod
    def coerce(cls, value: "Offload | bool") -> "Offload":
        """Engines built directly take True for today's optimizer offload."""
        if isinstance(value, Offload):
            return value
        return cls("optimizer" if value else "none")

    @property
    def optimizer(self) -> bool:
        return self.mode != "none"

    @property
    def params(self) -> bool:
        return self.mode in ("params", "nvme")

    def keep(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Where a shard of the parameters or optimizer state lives: a file ("nvme") or a host
        buffer ("params", "optimizer")."""
        if self.files is not None:
            return self.files.tensor(name, tensor)
        return host_copy(tensor)

    def place(self, held: dict[str, int], optimizer: int, fp32_grads: int, host_grads: int
              ) -> dict[str, int]:
        """A ZeRO engine's bytes by kind and place: on the device (params, grads, optimizer), in
        host memory (host_*) or in files (disk_*). `held`: its shards' (the engine puts them);
        the optimizer state's, the fp32 gradient copies made for the step, optimizer offload's
        host gradient copies."""
        held = dict(held)
        held["host_grads" if self.params else "grads"] += fp32_grads
        held["optimizer"] = 0 if self.optimizer else optimizer
        if self.files is not None:
            held["disk_optimizer"] = optimizer
        elif self.optimizer:
            held["host_optimizer"] = optimizer
        if self.mode == "optimizer":
            held["host_grads"] = host_grads
        return held
