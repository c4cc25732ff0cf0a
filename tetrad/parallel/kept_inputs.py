"""ZeRO-R's partitioned and offloaded activation checkpoints (Rajbhandari et al. 2020, "Pa" and
"Pa+cpu"; DeepSpeed's partition_activations / cpu_checkpointing).

Full and sqrt recomputation keep one tensor per checkpoint until backward: the block's (or
segment's) input, [batch, seq, hidden], which every tensor-parallel rank holds whole and alike.

- `--partition-activations`: each tp rank keeps only its 1/tp share of that input (the flat
  tensor padded to a multiple of tp, chunk `tp index`), and the shares are all-gathered through
  the counted collective layer (tag "activations") right before the rerun needs the input.
- `--offload-activations`: the kept tensor (the share, or the whole input) waits in host memory
  (pinned when a GPU copies it back) and is copied to the device before the rerun.

- `--contiguous-buffers`: the kept tensors (whole or shares) are copied into one buffer on the
  device (ZeRO-R's memory defragmentation, DeepSpeed's contiguous_memory_optimization),
  allocated at the first checkpoint, when a slot's size is known, and reused for the rest of the
  run, so these long-lived tensors never sit between the short-lived ones. It has a slot per
  checkpoint of every microbatch this rank keeps in flight at once: one microbatch without a
  pipeline; with one, the most its schedule holds between a forward and its backward (its W
  under zero bubble), counted by walking the rank's action list as the planner does
  (tetrad.planner.eager_activations.in_flight_peak). A slot returns to the free ones when
  autograd drops its checkpoint, after that microbatch's backward, and a later microbatch takes
  it. Under zero bubble that is its W on a stage that recomputes (B keeps the graph for W's
  rerun of the block), or its B where B runs the whole backward (W comes next, so the walk's
  release at W peaks the same). The run report's activation_buffer is the most bytes of it in
  use at once.

All act on the one place torch's non-reentrant checkpoint stores its inputs: it saves them as
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
from dataclasses import dataclass
from typing import Sequence

import torch

from tetrad.memory import storage_id
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group
from tetrad.parallel.offload import host_copy
from tetrad.planner.eager_activations import in_flight_peak
from tetrad.schedules.generate import V_SHAPED
from tetrad.spec.layout import FORWARD_AGAIN, ParallelConfig
from tetrad.spec.runtime_rules import padded, rank_stages

TAG = "activations"


def kept_inputs_of(parallel: ParallelConfig, comm: Comm | None = None,
                   tp_group: Group | None = None, pp_rank: int = 0) -> "KeptInputs | None":
    """Where `parallel`'s recomputed blocks keep their inputs on a rank of pipeline rank
    `pp_rank` (None: whole, on the device)."""
    contiguous = parallel.contiguous_buffers and parallel.recompute in FORWARD_AGAIN
    if not (parallel.partition_activations or parallel.offload_activations or contiguous):
        return None
    return KeptInputs(comm, tp_group if parallel.partition_activations else None,
                      parallel.offload_activations,
                      InFlight.of(parallel, pp_rank) if contiguous else None)


@dataclass(frozen=True)
class InFlight:
    """The pipeline position --contiguous-buffers sizes its slots for: the schedule of a rank of
    pipeline rank `pp_rank` (pp 1: no pipeline)."""

    schedule: str = "1f1b"
    pp: int = 1
    microbatches: int = 1
    vpp: int = 1
    pp_rank: int = 0

    @classmethod
    def of(cls, parallel: ParallelConfig, pp_rank: int) -> "InFlight":
        return cls(parallel.schedule, parallel.pp, parallel.microbatches, parallel.vpp, pp_rank)

    def slots(self, checkpoints: Sequence[int]) -> int:
        """Slots for `checkpoints`, the checkpoints one microbatch opens in each of the rank's
        stages in the order rank_stages gives them."""
        stages = (rank_stages(self.pp_rank, self.pp * self.vpp, self.pp, self.schedule in V_SHAPED)
                  if self.pp > 1 else (0,))
        per_stage = dict(zip(stages, checkpoints, strict=True))
        return round(in_flight_peak(self.schedule, self.pp, self.microbatches, self.vpp,
                                    self.pp_rank, per_stage.__getitem__))


class KeptInputs:
    """Where recomputed blocks keep their inputs: partitioned over `group` (None: whole) and/or
    in host memory (`offload`) or in slots of one device buffer (`in_flight`, the pipeline
    position its slots are counted for; `slots`, set by tetrad.parallel.recompute through
    size_slots). host_peak_bytes and buffer_peak_bytes: the most bytes held at once so far in
    host memory and in the buffer."""

    def __init__(self, comm: Comm | None, group: Group | None, offload: bool,
                 in_flight: InFlight | None = None):
        self.comm = comm
        self.group = group if group is not None and group.size > 1 else None
        self.offload = offload
        self.in_flight = in_flight
        self.contiguous = in_flight is not None
        self.slots = 0
        self.buffer: torch.Tensor | None = None  # [slots, slot elements]
        self.free_slots: list[int] = []
        self.host_bytes = self.host_peak_bytes = 0
        self.buffer_bytes = self.buffer_peak_bytes = 0

    def size_slots(self, checkpoints: Sequence[int]) -> None:
        """--contiguous-buffers: a slot per checkpoint of every microbatch in flight at once,
        `checkpoints` being what one microbatch opens in each of the rank's stages."""
        self.slots = self.in_flight.slots(checkpoints)

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
            if self.contiguous:  # held by the buffer, which the report counts apart
                return True, (self._to_slot(stored), tensor.shape, None)
            return True, (outer_pack(stored) if outer_pack else stored, tensor.shape, None)

        def unpack(packed):
            ours, inner = packed
            if not ours:
                return outer_unpack(inner) if outer_unpack else inner
            stored, shape, device = inner
            if device is not None:
                stored = stored.to(device, non_blocking=True)
            elif outer_unpack and not self.contiguous:
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

    def _to_slot(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into a free slot of the buffer (a view of it, shaped like `tensor`),
        which returns to the free slots when autograd drops the checkpoint."""
        if self.buffer is None:
            self.buffer = tensor.new_empty((self.slots, tensor.numel()))
            self.free_slots = list(range(self.slots - 1, -1, -1))
        assert self.free_slots and self.buffer.shape[1] == tensor.numel(), \
            (self.slots, self.buffer.shape, tensor.shape)
        index = self.free_slots.pop()
        slot = self.buffer[index].view(tensor.shape).copy_(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.buffer_bytes += nbytes
        self.buffer_peak_bytes = max(self.buffer_peak_bytes, self.buffer_bytes)
        weakref.finalize(slot, self._slot_freed, index, nbytes)
        return slot

    def _slot_freed(self, index: int, nbytes: int) -> None:
        self.free_slots.append(index)
        self.buffer_bytes -= nbytes
