"""The 4D device mesh: which global ranks form each tensor-, context-, data- and pipeline-parallel
group, and the process groups built from that, once, then passed explicitly to whoever talks.

Rank order (Megatron's "tp-cp-dp-pp"): TP is innermost (fastest-varying), then CP, then DP, and
PP is outermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

TP exchanges activations in every layer, so its ranks are neighbours and stay inside one node
(NVLink); PP only passes activations between stages, so its ranks are the farthest apart. The
classic 16-GPU example, tp=2, pp=4, dp=2: TP groups [0,1] [2,3] ..., DP groups [0,2] [1,3]
[4,6] ..., PP groups [0,4,8,12] [1,5,9,13] ... (`tetrad mesh --tp 2 --pp 4 --dp 2` prints them).

Expert parallelism does not multiply the world: the dp*cp ranks of one (pp, tp) position are
re-read as ep x edp, EP innermost (Megatron's expert order "tp-ep-dp-pp"). With d the position of
a rank in its dp*cp block (d = dp_index * cp + cp_index), ep_index = d % ep and the expert-data-
parallel index is d // ep: experts are split over neighbouring ranks and each expert shard is
replicated edp = dp*cp/ep times, and its gradients are reduced over that edp group.

This module's top level is plain Python (the planner and `tetrad mesh` use the grid without
torch); `build_mesh` imports torch.distributed when it creates the process groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from tetrad.config import ParallelConfig
from tetrad.errors import ConfigError

# Outermost to innermost: the order of the rank formula above.
AXES = ("pp", "dp", "cp", "tp")

# Every group the runtime uses: a name -> the axes whose ranks it spans. "dp_cp" reduces the
# gradients of replicated (non-expert) parameters: CP ranks hold the same weights, like DP ranks.
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
    "world": AXES,
}
EXPERT_GROUPS = ("ep", "edp")
GROUP_NAMES = (*GROUP_AXES, *EXPERT_GROUPS)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh, validated once on construction."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{axis} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep {self.ep} must divide dp*cp = {self.dp * self.cp}: expert "
                              f"parallelism is folded over the data- and context-parallel ranks")

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> "ParallelDims":
        return cls(dp=parallel.dp, pp=parallel.pp, cp=parallel.cp, tp=parallel.tp,
                   ep=parallel.ep)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Replicas of each expert shard."""
        return self.dp * self.cp // self.ep

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"{world_size} processes cannot hold the layout dp={self.dp} x pp={self.pp} x "
                f"cp={self.cp} x tp={self.tp} = {self.world_size}: make the process count equal "
                f"the product of the degrees")

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along every axis, expert axes included."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        folded = dp * self.cp + cp
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep": folded % self.ep,
                "edp": folded // self.ep}

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of kind `name` as lists of global ranks, in group-rank order."""
        if name in GROUP_AXES:
            return self._axis_groups(GROUP_AXES[name])
        if name in EXPERT_GROUPS:
            return self._expert_groups(name)
        raise ValueError(f"unknown group {name!r} (known: {', '.join(GROUP_NAMES)})")

    def _axis_groups(self, spanned: tuple[str, ...]) -> list[list[int]]:
        sizes = {axis: getattr(self, axis) for axis in AXES}
        fixed = [axis for axis in AXES if axis not in spanned]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[axis]) for axis in fixed)):
            position = dict(zip(fixed, fixed_values))
            members = [self.rank_of(**position, **dict(zip(spanned, values)))
                       for values in itertools.product(*(range(sizes[a]) for a in spanned))]
            groups.append(sorted(members))
        return sorted(groups)

    def _expert_groups(self, name: str) -> list[list[int]]:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            # An EP group shares (pp, tp, edp index); an EDP group shares (pp, tp, ep index).
            key = (c["pp"], c["tp"], c["edp"] if name == "ep" else c["ep"])
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def describe(self) -> str:
        """The layout and every group, one kind per line (what `tetrad mesh` prints)."""
        lines = [f"world {self.world_size} = pp {self.pp} x dp {self.dp} x cp {self.cp} x "
                 f"tp {self.tp} (rank order tp innermost, then cp, dp, pp outermost); "
                 f"ep {self.ep} folded over dp x cp (edp {self.edp})"]
        for name in GROUP_NAMES:
            groups = self.group_ranks(name)
            if name == "world":
                continue
            if len(groups[0]) == 1:
                lines.append(f"{name:>6} groups: size 1 (every rank alone)")
                continue
            shown = " ".join("[" + ",".join(f"g{r}" for r in group) + "]" for group in groups)
            lines.append(f"{name:>6} groups ({len(groups)} of {len(groups[0])}): {shown}")
        return "\n".join(lines)


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

    dims: ParallelDims
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        coords = self.dims.coords(self.rank)
        return {axis: coords[axis] for axis in ("dp", "pp", "cp", "tp", "ep")}

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]


def build_mesh(dims: ParallelDims, rank: int, world_size: int) -> Mesh:
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

