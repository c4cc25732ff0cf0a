"""Collectives and their byte counts, on real gloo processes: one 4-rank job runs every check.

Layout dp=2 x tp=2 over 4 ranks, so collectives run on the world (4 ranks) and on sub-groups
whose members are not neighbours (dp groups [0,2] and [1,3]): group-relative addressing is
exercised, not only the default group.
"""

from fractions import Fraction

import torch
import torch.distributed as dist
from dist import run_ranks

from tetrad.spec.model import ParallelConfig
from tetrad.parallel.comm import Comm, CommCounter, ring_volume
from tetrad.parallel.mesh import Group, build_mesh


def sent(counter: CommCounter, kind: str) -> Fraction:
    return counter.totals()[kind]


def check_collectives(rank: int, world_size: int) -> dict:
    dims = ParallelConfig(dp=2, tp=2)
    mesh = build_mesh(dims, rank, world_size)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)

    # The mesh's groups are the grid's groups, and a collective on one stays inside it.
    for name in ("tp", "dp"):
        group = mesh[name]
        assert [list(group.ranks)] == [g for g in dims.group_ranks(name) if rank in g]
        total = torch.tensor([float(rank)])
        Comm().all_reduce(total, group, "test")
        assert total.item() == sum(group.ranks), (name, total)

    generator = torch.Generator().manual_seed(rank)
    for group in (world, mesh["dp"]):
        n = group.size
        for numel in (n * 1000, n * 7 + 3):  # equal chunks, then chunks one element apart
            data = torch.randn(numel, generator=generator, dtype=torch.float64)
            expected = data.clone()
            Comm().all_reduce(expected, group, "test")

            ring_counter = CommCounter()
            ring = data.clone()
            Comm(ring_counter, "ring").all_reduce(ring, group, "test")
            torch.testing.assert_close(ring, expected, rtol=1e-12, atol=1e-12)
            if numel % n == 0:  # bytes counted at the send calls equal the ring formula
                assert sent(ring_counter, "all_reduce") == 2 * (n - 1) * data.nbytes / n

            backend_counter = CommCounter()
            Comm(backend_counter).all_reduce(data.clone(), group, "test")
            assert sent(backend_counter, "all_reduce") == ring_volume("all_reduce",
                                                                      data.nbytes, n)

        # Reduce-scatter and all-gather: ring == backend, out of place and in place.
        full = torch.randn(n * 64, generator=generator, dtype=torch.float64)
        shard = slice(group.index * 64, (group.index + 1) * 64)
        reference = torch.empty(64, dtype=torch.float64)
        Comm().reduce_scatter(reference, full.clone(), group, "test")
        for algorithm in ("backend", "ring"):
            counter = CommCounter()
            comm = Comm(counter, algorithm)
            out = torch.empty(64, dtype=torch.float64)
            comm.reduce_scatter(out, full.clone(), group, "test")
            in_place = full.clone()
            comm.reduce_scatter(in_place[shard], in_place, group, "test")
            torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(in_place[shard], reference, rtol=1e-12, atol=1e-12)
            assert sent(counter, "reduce_scatter") == 2 * (n - 1) * full.nbytes / n

            gathered = torch.empty(n * 64, dtype=torch.float64)
            comm.all_gather(gathered, reference, group, "test")
            buffer = torch.zeros(n * 64, dtype=torch.float64)
            buffer[shard] = reference
            comm.all_gather(buffer, buffer[shard], group, "test")
            every = [torch.empty(64, dtype=torch.float64) for _ in range(n)]
            dist.all_gather(every, reference, group=group.handle)
            torch.testing.assert_close(gathered, torch.cat(every), rtol=0, atol=0)
            torch.testing.assert_close(buffer, torch.cat(every), rtol=0, atol=0)
            assert sent(counter, "all_gather") == 2 * (n - 1) * gathered.nbytes / n

    # The other kinds count their formulas; p2p counts on the sender only.
    counter = CommCounter()
    comm = Comm(counter)
    rows = torch.full((world_size * 2, 3), float(rank))
    received = torch.empty_like(rows)
    comm.all_to_all(received, rows, world, "test")
    assert received[:, 0].tolist() == [float(r) for r in range(world_size) for _ in range(2)]
    # Uneven splits (expert parallelism's dispatch): rank s sends rank i rows(s, i) rows.
    def rows_between(source: int, target: int) -> int:
        return (source + target) % 3 + 1

    uneven = Comm(CommCounter())
    splits_out = [rows_between(rank, i) for i in range(world_size)]
    splits_in = [rows_between(s, rank) for s in range(world_size)]
    outgoing = torch.cat([torch.full((n, 3), 100.0 * rank + i) for i, n in enumerate(splits_out)])
    incoming = torch.empty(sum(splits_in), 3)
    uneven.all_to_all(incoming, outgoing, world, "test", splits_in, splits_out)
    assert incoming[:, 0].tolist() == [100.0 * s + rank for s, n in enumerate(splits_in)
                                       for _ in range(n)]
    assert sent(uneven.counter, "all_to_all") == 3 * 4 * sum(
        n for i, n in enumerate(splits_out) if i != rank)
    value = torch.full((10,), float(rank))
    comm.broadcast(value, 1, world, "test")
    assert value.tolist() == [1.0] * 10
    message = torch.arange(5.0)
    if rank == 0:
        comm.send(message, 1, world, "test").wait()
    elif rank == 1:
        comm.recv(message := torch.zeros(5), 0, world).wait()
        assert message.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sent(counter, "all_to_all") == rows.nbytes * (world_size - 1) / world_size
    assert sent(counter, "broadcast") == value.nbytes * (world_size - 1) / world_size
    assert sent(counter, "p2p") == (20 if rank == 0 else 0)

    # Per-step totals leave out report traffic and divide by the number of steps.
    counter = CommCounter()
    comm = Comm(counter)
    for _ in range(2):
        comm.all_reduce(torch.zeros(100), world, "grads")
        counter.end_step()
    comm.all_gather_object({"rank": rank}, world, "report")
    return counter.totals_per_step()


def test_collectives_ring_and_counts():
    per_step = run_ranks(check_collectives, 4)
    for totals in per_step:
        assert totals["all_reduce"] == 2 * 3 * 400 // 4
        assert totals["all_gather"] == 0
