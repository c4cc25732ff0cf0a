"""The process groups of a layout: which global ranks form each tensor-, context-, data-,
pipeline- and expert-parallel group (the rank grid of tetrad.spec.layout.ParallelConfig),
built once by `build_mesh` and then passed explicitly to whoever talks.

The module's top level is plain Python; `build_mesh` imports torch.distributed when it creates
the process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tetrad.spec.layout import GROUP_NAMES, ParallelConfig


@dataclass
class Group:
    """One process group seen from one member: its global ranks in order and where this rank sits.
    `handle` is the torch ProcessGroup, None for a group of one (nothing to talk to)."""

    name: str
    ranks: tuple[int, ...]
    index: int
    handle: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Mesh:
    """The groups this rank belongs to, by name (GROUP_NAMES), built once by build_mesh."""

    dims: ParallelConfig  # the layout; only its degrees matter here
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        coords = self.dims.coords(self.rank)
        return {axis: coords[axis] for axis in ("dp", "pp", "cp", "tp", "ep")}

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]


def build_mesh(dims: ParallelConfig, rank: int, world_size: int) -> Mesh:
    """Create every process group of the layout. Collective: every rank calls it, in the same
    order, after init_process_group. Groups of one rank get no handle; a group spanning the whole
    world reuses the default group instead of opening new connections."""
    import torch.distributed as dist

    dims.check_world_size(world_size)
    mesh = Mesh(dims, rank)
    for name in GROUP_NAMES:
        for ranks in dims.group_ranks(name):
            if len(ranks) == 1:
                handle = None
            elif len(ranks) == world_size:
                handle = dist.group.WORLD
            else:
                handle = dist.new_group(ranks)  # every rank must call new_group for every group
            if rank in ranks:
                mesh.groups[name] = Group(name, tuple(ranks), ranks.index(rank), handle)
    return mesh

