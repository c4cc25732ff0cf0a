"""ZeRO-R's constant-size buffers for ZeRO-3 (Rajbhandari et al. 2020, "CB"; DeepSpeed's
allgather_bucket_size and reduce_bucket_size, Megatron's distributed-optimizer buckets):
`--zero-bucket-size N` moves a unit's parameters and gradients N elements at a time through two
flat buffers allocated once, so the memory communication needs stays the same however large a
layer grows.

A unit's flat buffer is sharded rank-major (rank r owns [r S, (r+1) S) of it), so a call that
moves a piece of every rank's shard touches one run of the unit per rank: it goes through a
buffer laid out rank-major too (rank r's k elements at [r k, (r+1) k)), which a gather empties
into those runs and a reduce-scatter is filled from, straight from the parameters' gradients
(the unit-sized flat gradient of the unbucketed path is never made). Each buffer has at most
one call in flight: its next use waits for that call and finishes it (copies the gathered
pieces out, adds the reduced piece to the gradient shard), so the last piece of a unit still
overlaps the compute that follows, as the whole-unit calls do.
"""

from __future__ import annotations

from typing import Callable

import torch

from tetrad.parallel.comm import Comm, Handle
from tetrad.parallel.mesh import Group
from tetrad.parallel.zero_optimizer import FlatShard, nbytes
from tetrad.spec.runtime_rules import bucket_buffer_elements, bucket_chunks


class BucketBuffer:
    """One reused flat buffer and the call that is using it (owner, handle, what finishes it)."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device):
        self.flat = torch.empty(elements, dtype=dtype, device=device)
        self.pending: tuple[object, Handle, Callable[[], None]] | None = None

    def take(self, numel: int) -> torch.Tensor:
        self.finish()
        return self.flat[:numel]

    def finish(self, owner: object | None = None) -> None:
        """Wait for the call in flight (only `owner`'s, when given) and finish it."""
        if self.pending is not None and (owner is None or self.pending[0] is owner):
            _, handle, done = self.pending
            self.pending = None
            handle.wait()
            done()


class UnitGather:
    """What FullyShardedDataParallel waits on for a bucketed gather: its last piece in flight."""

    def __init__(self, buffer: BucketBuffer, owner: object):
        self.buffer, self.owner = buffer, owner

    def wait(self) -> None:
        self.buffer.finish(self.owner)


class ZeroBuckets:
    """ZeRO-3's gathers and reduce-scatters of `group`, piece by piece through two buffers sized
    for the largest piece of the rank's unit shards (`shard_numels`)."""

    def __init__(self, comm: Comm, group: Group, bucket_elements: int, shard_numels: list[int],
                 dtype: torch.dtype, device: torch.device):
        self.comm, self.group, self.bucket_elements = comm, group, bucket_elements
        elements = bucket_buffer_elements(shard_numels, group.size, bucket_elements)
        self.gather_buffer = BucketBuffer(elements, dtype, device)
        self.reduce_buffer = BucketBuffer(elements, dtype, device)

    def bytes_held(self) -> int:
        return nbytes(self.gather_buffer.flat) + nbytes(self.reduce_buffer.flat)

    def _chunks(self, shard: FlatShard) -> list[tuple[int, int]]:
        return bucket_chunks(shard.shard_numel, self.group.size, self.bucket_elements)

    def gather(self, shard: FlatShard, full: torch.Tensor, source: torch.Tensor,
               owner: object) -> UnitGather:
        """All-gather the unit into `full` [numel] from this rank's `source` [numel / N] (in
        host memory with parameter offload: each piece copied to the device for its call)."""
        runs = full.view(self.group.size, shard.shard_numel)  # rank r's shard in row r
        for start, end in self._chunks(shard):
            width = end - start
            out = self.gather_buffer.take(width * self.group.size)
            piece = source[start:end].to(full.device)

            def empty(out=out, start=start, end=end, width=width) -> None:
                # Writes storage autograd saved for backward with the same weights (as the
                # unbucketed gather does): keep the version counter from flagging it.
                with torch.autograd._unsafe_preserve_version_counter(full):
                    runs[:, start:end].copy_(out.view(self.group.size, width))

            handle = self.comm.all_gather(out, piece, self.group, "params", async_op=True)
            self.gather_buffer.pending = (owner, handle, empty)
        return UnitGather(self.gather_buffer, owner)

    def reduce_scatter(self, shard: FlatShard, grads: list[torch.Tensor],
                       grad_shard: torch.Tensor) -> None:
        """Average `grads` (shaped like the unit's parameters) over the group and add this
        rank's part to `grad_shard` [numel / N] (in host memory with parameter offload)."""
        size = self.group.size
        for start, end in self._chunks(shard):
            width = end - start
            flat = self.reduce_buffer.take(width * size)
            for rank, run in enumerate(flat.view(size, width)):
                fill_run(run, shard, grads, rank * shard.shard_numel + start)
            flat.div_(size)
            mine = flat[self.group.index * width:(self.group.index + 1) * width]

            def add(mine=mine, start=start, end=end) -> None:
                grad_shard[start:end].add_(mine.to(grad_shard.device))

            handle = self.comm.reduce_scatter(mine, flat, self.group, "grads", async_op=True)
            self.reduce_buffer.pending = (None, handle, add)

    def finish(self) -> None:
        self.gather_buffer.finish()
        self.reduce_buffer.finish()


def fill_run(run: torch.Tensor, shard: FlatShard, grads: list[torch.Tensor], first: int) -> None:
    """Elements [first, first + len(run)) of the unit's flat layout, taken from `grads` (one per
    parameter at shard.offsets); the padding past the last parameter is zero."""
    run.zero_()
    last = first + run.numel()
    for offset, grad in zip(shard.offsets, grads):
        lo, hi = max(first, offset), min(last, offset + grad.numel())
        if lo < hi:
            run[lo - first:hi - first].copy_(grad.reshape(-1)[lo - offset:hi - offset])
