"""tetrad's own ring collectives over send/recv (`Comm(algorithm="ring")`): what the ring volumes
of tetrad.spec.runtime_rules.ring_share describe, run for real so that the tests can count the
bytes each send carries.

Ranks sit on a ring (index i sends to i+1, receives from i-1); a tensor is cut into N chunks.
Reduce-scatter: at step s, rank r passes its running sum of chunk r-s-1 to the right and adds what
arrives from the left into chunk r-s-2; after N-1 steps chunk r holds the full sum on rank r.
All-gather: rank r forwards chunk r-s at step s, so after N-1 steps every rank has every chunk.
Each step moves S/N bytes per rank, hence the (N-1)/N*S volumes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.parallel.mesh import Group


def exchange_(outgoing: torch.Tensor, dst: int, incoming: torch.Tensor, src: int,
              group: Group) -> list:
    """Comm.exchange's batch, uncounted: the works to wait on."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, outgoing, group=group.handle, group_peer=dst),
        dist.P2POp(dist.irecv, incoming, group=group.handle, group_peer=src)])


def _exchange(outgoing: torch.Tensor, incoming: torch.Tensor, group: Group, sent) -> None:
    right, left = (group.index + 1) % group.size, (group.index - 1) % group.size
    # Both in one batch before waiting: with blocking sends every rank would wait on its left
    # neighbour, and on NCCL two ranks would each wait on the other's send (Comm.exchange).
    works = exchange_(outgoing, right, incoming, left, group)
    sent(outgoing)
    for work in works:
        work.wait()


def ring_reduce_scatter_(chunks: list[torch.Tensor], group: Group, sent) -> None:
    """In place: afterwards chunks[group.index] is the sum of that chunk over the group (the
    other chunks hold partial sums). `sent(tensor)` is called for every tensor sent."""
    size, index = group.size, group.index
    scratch = torch.empty_like(max(chunks, key=torch.numel))
    for step in range(size - 1):
        outgoing = chunks[(index - step - 1) % size]
        target = chunks[(index - step - 2) % size]
        incoming = scratch[:target.numel()]
        _exchange(outgoing, incoming, group, sent)
        target.add_(incoming)


def ring_all_gather_(chunks: list[torch.Tensor], group: Group, sent) -> None:
    """In place: chunks[group.index] is this rank's; afterwards every chunk is filled."""
    size, index = group.size, group.index
    for step in range(size - 1):
        _exchange(chunks[(index - step) % size], chunks[(index - step - 1) % size], group, sent)


def ring_all_reduce_(tensor: torch.Tensor, group: Group, sent) -> None:
    """Sum over the group in place: a ring reduce-scatter, then a ring all-gather of the sums."""
    chunks = list(tensor.view(-1).tensor_split(group.size))
    ring_reduce_scatter_(chunks, group, sent)
    ring_all_gather_(chunks, group, sent)
