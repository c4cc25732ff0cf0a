"""ZeRO-R's partitioned and offloaded activation checkpoints (Rajbhandari et al. 2020, "Pa" and
"Pa+cpu"; DeepSpeed's partition_activations / cpu_checkpointing).

Full and sqrt recomputation keep one tensor per checkpoint until backward: the block's (or
segment's) input, [batch, seq, hidden], which every tensor-parallel rank holds whole and alike.

- `--partition-activations`: each tp rank keeps only its 1/tp share of that input (the flat
  tensor padded to a multiple of tp, chunk `tp index`), and the shares are all-gathered through
  the counted collective layer (tag "activations") right before the rerun needs the input.
- `--offload-activations`: the kept tensor (the share, or the whole input) waits in host memory
  (pinned when a GPU copies it back) and is copied to the device before the rerun.

Both act on the one place torch's non-reentrant checkpoint stores its inputs: it saves them as
saved tensors through whatever saved-tensor hooks are active when the checkpoint opens, so the
hooks here sit between the checkpoint and the hooks below them (the ActivationMeter). A device
share is passed on to those hooks, so the meter counts the share; a host copy is not (it is not
device memory), and is counted here instead: host bytes alive at once, each freed when autograd
drops the checkpoint (after its backward), exactly what the meter's in-flight accounting would
hold. Only the tensor that is the checkpoint's input is touched: the other arguments (rotary
tables, masks) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from tetrad.memory import storage_id
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group
from tetrad.parallel.offload import host_copy
from tetrad.spec.layout import ParallelConfig
from tetrad.spec.runtime_rules import padded

TAG = "activations"


def kept_inputs_of(parallel: ParallelConfig, comm: Comm | None = None,
                   tp_group: Group | None = None) -> "KeptInputs | None":
    """Where `parallel`'s recomputed blocks keep their inputs (None: whole, on the device)."""
    if not (parallel.partition_activations or parallel.offload_activations):
        return None
    return KeptInputs(comm, tp_group if parallel.partition_activations else None,
                      parallel.offload_activations)


class KeptInputs:
    """Where recomputed blocks keep their inputs: partitioned over `group` (None: whole) and/or
    in host memory (`offload`). host_peak_bytes: the most host bytes held at once so far."""

    def __init__(self, comm: Comm | None, group: Group | None, offload: bool):
        self.comm = comm
        self.group = group if group is not None and group.size > 1 else None
        self.offload = offload
        self.host_bytes = 0
        self.host_peak_bytes = 0

    def keeping(self, kept: torch.Tensor) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks to hold while a checkpoint with input `kept` saves its inputs."""
        outer_pack, outer_unpack = (torch._C._autograd._top_saved_tensors_default_hooks(False)
                                    or (None, None))
        key = storage_id(kept)

        def pack(tensor: torch.Tensor):
            if storage_id(tensor) != key or tensor.shape != kept.shape:
                return False, outer_pack(tensor) if outer_pack else tensor
            stored = self._share(tensor.detach())
            if self.offload:
                return True, (self._to_host(stored), tensor.shape, tensor.device)
            return True, (outer_pack(stored) if outer_pack else stored, tensor.shape, None)

        def unpack(packed):
            ours, inner = packed
            if not ours:
                return outer_unpack(inner) if outer_unpack else inner
            stored, shape, device = inner
            if device is not None:
                stored = stored.to(device, non_blocking=True)
            elif outer_unpack:
                stored = outer_unpack(stored)
            return self._whole(stored, shape)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _share(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the flat input padded to the group (a copy of its own, so the
        whole input can be freed), or the input itself without partitioning."""
        if self.group is None:
            return whole
        flat = whole.reshape(-1)
        size = self.group.size
        share = padded(flat.numel(), size) // size
        start = self.group.index * share
        out = flat.new_zeros(share)
        piece = flat[start:start + share]
        out[:piece.numel()] = piece
        return out

    def _whole(self, stored: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.group is None:
            return stored
        gathered = stored.new_empty(stored.numel() * self.group.size)
        self.comm.all_gather(gathered, stored, self.group, TAG)
        return gathered[:shape.numel()].view(shape)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = host_copy(tensor)
        nbytes = host.untyped_storage().nbytes()
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        weakref.finalize(host, self._freed, nbytes)
        return host

    def _freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes
