"""The rooted collectives (broadcast, reduce, gather, scatter, gather_object) of the counted layer,
on real gloo processes: each result against torch.distributed's own all-reduce / all-gather of
the same tensors, each rank's counted bytes against the formula of what it sends.

One 4-rank job: the world, the dp groups [0,2] and [1,3] of dp=2 x tp=2 (members that are not
neighbours, so the root is a group rank, not a global one) and a 3-rank group [0,1,3]; every
root of each group in turn.
"""

import pickle
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.spec.model import ParallelConfig
from tetrad.spec.runtime_rules import ring_share, rooted_share

CHUNK = 37  # elements each rank contributes or receives: odd, so nothing divides by accident


def rooted_checks(group: Group, generator: torch.Generator) -> list[str]:
    """Every rooted call with every root of `group`; returns the checks that failed."""
    failures = []
    n, me = group.size, group.index
    for root in range(n):
        # Every rank draws every rank's data from the same generator state: the expected values
        # are torch's own collectives of the same tensors.
        data = torch.randn(n, CHUNK, generator=generator, dtype=torch.float64)
        mine = data[me].clone()

        counter = CommCounter()
        reduced = mine.clone()
        Comm(counter).reduce(reduced, root, group, "test")
        summed = mine.clone()
        dist.all_reduce(summed, group=group.handle)
        if me == root and not torch.equal(reduced, summed):
            failures.append(f"reduce root {root}")
        if counter.totals()["reduce"] != Fraction(n - 1, n) * mine.nbytes:
            failures.append(f"reduce bytes root {root}")

        counter = CommCounter()
        largest = mine.clone()
        Comm(counter).reduce(largest, root, group, "test", op="max")
        torch_max = mine.clone()
        dist.all_reduce(torch_max, dist.ReduceOp.MAX, group=group.handle)
        if me == root and not torch.equal(largest, torch_max):
            failures.append(f"reduce max root {root}")

        counter = CommCounter()
        gathered = torch.full((n * CHUNK,), float("nan"), dtype=torch.float64) if me == root \
            else None
        Comm(counter).gather(gathered, mine, root, group, "test")
        everyone = torch.empty(n * CHUNK, dtype=torch.float64)
        dist.all_gather_into_tensor(everyone, mine, group=group.handle)
        if me == root and not torch.equal(gathered, everyone):
            failures.append(f"gather root {root}")
        # A sender sends its chunk to the root; the root sends nothing.
        if counter.totals()["gather"] != (0 if me == root else mine.nbytes):
            failures.append(f"gather bytes root {root}")

        counter = CommCounter()
        received = torch.full((CHUNK,), float("nan"), dtype=torch.float64)
        Comm(counter).scatter(received, data.view(-1).clone() if me == root else None, root,
                              group, "test")
        if not torch.equal(received, data[me]):
            failures.append(f"scatter root {root}")
        # The root sends every chunk but its own; the others send nothing.
        if counter.totals()["scatter"] != ((n - 1) * mine.nbytes if me == root else 0):
            failures.append(f"scatter bytes root {root}")

        counter = CommCounter()
        copied = data[root].clone() if me == root else torch.zeros(CHUNK, dtype=torch.float64)
        Comm(counter).broadcast(copied, root, group, "test")
        if not torch.equal(copied, data[root]):
            failures.append(f"broadcast root {root}")
        if counter.totals()["broadcast"] != Fraction(n - 1, n) * mine.nbytes:
            failures.append(f"broadcast bytes root {root}")

        counter = CommCounter()
        entry = {"rank": group.ranks[me], "payload": "x" * (me + 1)}
        entries = Comm(counter).gather_object(entry, root, group, "report")
        expected = [{"rank": r, "payload": "x" * (i + 1)} for i, r in enumerate(group.ranks)]
        if (entries if me == root else None) != (expected if me == root else None):
            failures.append(f"gather_object root {root}")
        if counter.totals()["gather"] != (0 if me == root else len(pickle.dumps(entry))):
            failures.append(f"gather_object bytes root {root}")
        if counter.totals_per_step()["gather"] != 0:  # "report" is an off-step tag
            failures.append(f"gather_object per-step root {root}")
    return failures


def check_rooted(rank: int, world_size: int) -> list[str]:
    torch.set_num_threads(1)
    mesh = build_mesh(ParallelConfig(dp=2, tp=2), rank, world_size)
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    three = (0, 1, 3)
    handle = dist.new_group(list(three))  # every rank calls new_group
    failures = []
    for group in (world, mesh["dp"]):
        generator = torch.Generator().manual_seed(hash(group.ranks) % 2**31)
        failures += [f"{group.ranks}: {f}" for f in rooted_checks(group, generator)]
    if rank in three:
        group = Group("three", three, three.index(rank), handle)
        generator = torch.Generator().manual_seed(3)
        failures += [f"{three}: {f}" for f in rooted_checks(group, generator)]
    # A group of one copies and sends nothing.
    alone = Group("alone", (rank,), 0)
    counter = CommCounter()
    source = torch.arange(5.0)
    out = torch.empty(5)
    Comm(counter).gather(out, source, 0, alone, "test")
    Comm(counter).scatter(out, source, 0, alone, "test")
    if not torch.equal(out, source) or any(counter.totals().values()):
        failures.append("group of one")
    return failures


def test_rooted_collectives_match_torch_and_count_what_they_send():
    for rank, failures in enumerate(run_ranks(check_rooted, 4)):
        assert failures == [], (rank, failures)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_rooted_shares_sum_to_what_the_group_moves(size):
    full = Fraction(1)
    # Gather and scatter move every chunk but the root's once: (N-1)/N of the full tensor in all.
    for kind in ("gather", "scatter"):
        total = sum(rooted_share(kind, size, is_root=index == 0) for index in range(size))
        assert total == (Fraction(size - 1, size) if size > 1 else 0) * full, kind
        # The planner prices the fullest rank.
        assert ring_share(kind, size) == max(rooted_share(kind, size, is_root=r)
                                             for r in (True, False)), kind
    for kind in ("broadcast", "reduce"):  # a pipelined chain: N-1 forwards of S, averaged
        assert size * rooted_share(kind, size, is_root=True) == max(size - 1, 0) * full
    with pytest.raises(ValueError, match="has no root"):
        rooted_share("all_reduce", size, True)
