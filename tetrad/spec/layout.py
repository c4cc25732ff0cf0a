"""The one description of a parallel layout: its degrees and strategy knobs, the rules they obey
on their own, and the rank grid they span. The launcher, `parallelize`, the process mesh,
`tetrad mesh` and the planner all read this object (the planner's TrainLayout adds the batch
split to it); the rules that also need the model live in tetrad.planner.rules. No torch here.

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
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Sequence

from tetrad.errors import ConfigError, check_choice, check_positive
from tetrad.schedules.generate import SCHEDULES, V_SHAPED

RECOMPUTE_MODES = ("none", "selective", "full", "sqrt")
# The modes that run every block's forward again in backward (sqrt a segment at a time).
FORWARD_AGAIN = ("full", "sqrt")


def sqrt_segments(blocks: int) -> list[int]:
    """--recompute sqrt's checkpointed segments of a stage of `blocks` blocks, in order:
    ceil(sqrt(N)) consecutive blocks each, the last one the remainder (tetrad.parallel.recompute,
    the planner's activation counts)."""
    if blocks == 0:
        return []
    size = math.isqrt(blocks - 1) + 1  # ceil(sqrt(blocks))
    return [min(size, blocks - start) for start in range(0, blocks, size)]


def sqrt_segment_ends(blocks: Sequence[int]) -> list[int]:
    """The last block of each --recompute sqrt segment of a stage running `blocks` in order."""
    ends, start = [], 0
    for size in sqrt_segments(len(blocks)):
        start += size
        ends.append(blocks[start - 1])
    return ends


# Where ZeRO's state lives (docs/distributed.md, "Offload"): optimizer state (fp32 master, moments,
# fp32 gradient) on the host; "params" also ZeRO-3's parameter and gradient shards; "nvme" the
# parameter shards and optimizer state in files under offload_dir (gradients on the host).
OFFLOAD_MODES = ("none", "optimizer", "params", "nvme")

# Outermost to innermost: the order of the rank formula above.
AXES = ("pp", "dp", "cp", "tp")

# Every group the runtime uses: a name -> the axes whose ranks it spans. "dp_cp" reduces the
# gradients of replicated (non-expert) parameters: CP ranks hold the same weights, like DP ranks.
# "mp" is Megatron's model-parallel group (tp x pp: the ranks that together hold one replica).
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
    "mp": ("pp", "tp"), "world": AXES,
}
EXPERT_GROUPS = ("ep", "edp")
GROUP_NAMES = (*GROUP_AXES, *EXPERT_GROUPS)


def check_offload_dir(folder: str) -> None:
    """--offload nvme writes into `folder`: an existing folder this user may write in."""
    if not os.path.isdir(folder):
        raise ConfigError(f"--offload-dir {folder} is not a folder: create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--offload-dir {folder} is not writable by this user")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the 4D layout and the strategy knobs, validated once on construction. The world
    size is dp*pp*cp*tp; expert parallelism is folded over dp*cp, so ep does not multiply the world
    size (as in Megatron). strategy "ps" (docs/parameter_server.md) adds `servers` processes beside
    the dp workers."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    vpp: int = 1
    zero: int = 0
    offload: bool = False  # the optimizer state off the device (every offload_mode but "none")
    offload_mode: str = "none"  # OFFLOAD_MODES; offload=True alone means "optimizer"
    offload_dir: str = ""  # nvme: the folder its files go in
    offload_keep: bool = False  # nvme: leave the files there at the end
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # naive | gpipe | 1f1b | interleaved | zb | zbv | dualpipe
    microbatches: int = 0  # per pipeline pass; 0 means pp (the fewest that keep every stage busy)
    recompute: str = "none"  # none | selective | full | sqrt
    # ZeRO-R (docs/distributed.md): the block inputs full/sqrt recomputation keeps, as this
    # rank's 1/tp flat slice (gathered before the rerun) and/or in host memory.
    partition_activations: bool = False
    offload_activations: bool = False
    # ZeRO-R's constant-size buffers: ZeRO-3 gathers parameters and reduce-scatters gradients
    # through two reused flat buffers of at most this many elements (0: each unit whole).
    zero_bucket_size: int = 0
    # ZeRO-R's defragmentation: full/sqrt checkpoints' kept inputs and ZeRO's gradient shards in
    # buffers allocated once, each a slice of one contiguous block.
    contiguous_buffers: bool = False
    collectives: str = "backend"  # backend | ring (tetrad's own ring all-reduce on send/recv)
    # TP/SP and EP collectives hidden behind compute (chunked, async). None: the launcher decides
    # (on with NCCL; off on gloo, where the same CPU cores move the bytes and do the matmuls,
    # and chunking only multiplies the calls); unresolved None counts as off.
    overlap: bool | None = None
    stage_layers: tuple[int, ...] = ()  # layers per pipeline stage; () balances by cost
    strategy: str = "collective"  # collective | ps (parameter servers)
    servers: int = 0  # ps: server processes after the dp workers
    ps_mode: str = "sync"  # sync | async | ssp
    staleness: int | None = None  # ssp's bound K; None: PSOptions' default
    ps_replicas: int = 0  # ps: 1 keeps each server's key range on the next server (a standby)
    ps_spares: int = 0  # ps: idle worker ranks that take a dead worker's place
    ps_join_step: int | None = None  # ps sync: the step from which waiting spares join as workers

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "cp", "tp", "ep", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        check_positive("microbatches", self.microbatches, allow_zero=True)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        self._check_offload()
        check_choice("schedule", self.schedule, tuple(SCHEDULES))
        if self.schedule in V_SHAPED:
            if self.vpp != 2:
                raise ConfigError(f"the {self.schedule} schedule places two model chunks per "
                                  f"rank in a V: use --vpp 2")
            if self.schedule == "dualpipe" and (self.microbatches or self.pp) < 2 * self.pp:
                raise ConfigError(f"the dualpipe schedule needs at least 2 * pp = {2 * self.pp} "
                                  f"microbatches (one per stage): use --microbatches "
                                  f"{2 * self.pp} or more")
        elif (self.vpp > 1) != (self.schedule == "interleaved"):
            raise ConfigError("virtual stages go with the interleaved schedule: use --schedule "
                              "interleaved with --vpp 2 or more, or --vpp 1 with other schedules")
        check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        self._check_kept_inputs()
        self._check_buffers()
        check_choice("collectives", self.collectives, ("backend", "ring"))
        self._check_expert_fold()
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # TOML gives a list
        if self.microbatches == 0:
            object.__setattr__(self, "microbatches", self.pp)
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ConfigError(f"the interleaved schedule needs microbatches ({self.microbatches}) "
                              f"to be a multiple of pp ({self.pp})")
        self._check_strategy()

    def _check_offload(self) -> None:
        check_choice("offload", self.offload_mode, OFFLOAD_MODES)
        if self.offload_mode == "none" and self.offload:
            object.__setattr__(self, "offload_mode", "optimizer")  # configs from before the modes
        object.__setattr__(self, "offload", self.offload_mode != "none")
        if self.offload_params and self.zero != 3:
            raise ConfigError(f"--offload {self.offload_mode} moves ZeRO-3's parameter shard: "
                              f"use --zero 3, or --offload optimizer")
        if self.offload and self.zero == 0:
            raise ConfigError("--offload needs a ZeRO stage: add --zero 1, 2 or 3")
        if (self.offload_dir or self.offload_keep) and not self.offload_files:
            raise ConfigError("--offload-dir and --offload-keep are for --offload nvme: add it or "
                              "drop them")

    def _check_kept_inputs(self) -> None:
        """--partition-activations / --offload-activations act on the block inputs that full and
        sqrt recomputation keep (selective keeps q, k, v, which tp already splits by heads)."""
        for flag, on in (("--partition-activations", self.partition_activations),
                         ("--offload-activations", self.offload_activations)):
            if on and self.recompute not in FORWARD_AGAIN:
                raise ConfigError(f"{flag} acts on the block inputs full or sqrt recomputation "
                                  f"keeps: add --recompute full or sqrt")
        if self.partition_activations and self.tp == 1:
            raise ConfigError("--partition-activations splits the kept block inputs over the "
                              "tensor-parallel ranks: use --tp 2 or more")
        if self.partition_activations and self.sequence_parallel:
            raise ConfigError("--partition-activations splits block inputs that sequence "
                              "parallelism already splits over tp: drop one of them")

    def _check_buffers(self) -> None:
        """--zero-bucket-size and --contiguous-buffers (ZeRO-R's CB and MD) act on ZeRO-3's
        collectives, ZeRO's gradient shards and the inputs full/sqrt checkpoints keep."""
        check_positive("zero_bucket_size", self.zero_bucket_size, allow_zero=True)
        if self.zero_bucket_size and self.zero != 3:
            raise ConfigError("--zero-bucket-size bounds ZeRO-3's parameter gathers and gradient "
                              "reduce-scatters: add --zero 3 (ZeRO-1/2 reduce in 25 MiB buckets)")
        if not self.contiguous_buffers:
            return
        checkpoints = self.recompute in FORWARD_AGAIN
        if not (checkpoints or self.zero):
            raise ConfigError("--contiguous-buffers holds ZeRO's gradient shards and the inputs "
                              "full or sqrt recomputation keeps: add --zero 1, 2 or 3, or "
                              "--recompute full or sqrt")
        if checkpoints and self.offload_activations:
            raise ConfigError("--contiguous-buffers keeps the checkpoints' inputs on the device, "
                              "--offload-activations in host memory: drop one of them")

    @property
    def offload_params(self) -> bool:
        """ZeRO-3's parameter and gradient shards off the device (host memory or files)."""
        return self.offload_mode in ("params", "nvme")

    @property
    def offload_files(self) -> bool:
        """Parameter shards and optimizer state in files (ZeRO-Infinity's NVMe offload)."""
        return self.offload_mode == "nvme"

    def check_offload_dir(self) -> None:
        """What a run needs of --offload-dir (the planner needs none of it)."""
        if self.offload_files:
            if not self.offload_dir:
                raise ConfigError("--offload nvme needs --offload-dir PATH: the folder for its "
                                  "files")
            check_offload_dir(self.offload_dir)

    def _check_expert_fold(self) -> None:
        """The rank grid folds ep over the dp*cp ranks of one (pp, tp) position. This one rule is
        the place for a layout that spreads experts wider (a planner-only allowance) to widen."""
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep {self.ep} must divide dp*cp = {self.dp * self.cp}: expert "
                              f"parallelism is folded over the data- and context-parallel ranks")

    def _check_strategy(self) -> None:
        check_choice("strategy", self.strategy, ("collective", "ps"))
        if self.strategy == "collective":
            for flag, value, default in (("--servers", self.servers, 0),
                                         ("--ps-mode", self.ps_mode, "sync"),
                                         ("--staleness", self.staleness, None),
                                         ("--ps-replicas", self.ps_replicas, 0),
                                         ("--ps-spares", self.ps_spares, 0),
                                         ("--ps-join-step", self.ps_join_step, None)):
                if value != default:
                    raise ConfigError(f"{flag} configures the parameter server: add --strategy ps "
                                      f"or drop {flag}")
            return
        if self.servers < 1:
            raise ConfigError(f"--strategy ps needs --servers 1 or more (the processes that hold "
                              f"the parameters), got {self.servers}")
        # The workers are whole-model data-parallel replicas: nothing else splits the model.
        others = [f"--{name} {getattr(self, name)}" for name in ("tp", "pp", "cp", "ep", "vpp")
                  if getattr(self, name) > 1] + ([f"--zero {self.zero}"] if self.zero else [])
        if self.sequence_parallel:
            others.append("--sequence-parallel")
        if others:
            raise ConfigError(f"--strategy ps is data parallel only (--dp workers + --servers): "
                              f"drop {' '.join(others)}")
        check_choice("ps_mode", self.ps_mode, ("sync", "async", "ssp"))
        if self.staleness is not None:
            if self.ps_mode != "ssp":
                raise ConfigError(f"--staleness bounds --ps-mode ssp only: drop it or use "
                                  f"--ps-mode ssp (got --ps-mode {self.ps_mode})")
            check_positive("staleness", self.staleness, allow_zero=True)
        if self.ps_replicas not in (0, 1):
            raise ConfigError(f"--ps-replicas must be 0 or 1, got {self.ps_replicas!r}")
        if self.ps_replicas and (self.servers < 2 or self.ps_mode != "sync"):
            raise ConfigError(f"--ps-replicas 1 keeps each server's key range on the next server "
                              f"and replays sync steps: it needs --servers 2 or more and --ps-mode "
                              f"sync (got --servers {self.servers}, --ps-mode {self.ps_mode})")
        check_positive("ps_spares", self.ps_spares, allow_zero=True)
        if self.ps_join_step is not None:
            if self.ps_mode != "sync" or not self.ps_spares:
                raise ConfigError(f"--ps-join-step joins the --ps-spares of a --ps-mode sync run "
                                  f"as new workers: add --ps-spares N (got --ps-mode "
                                  f"{self.ps_mode}, --ps-spares {self.ps_spares})")
            check_positive("ps_join_step", self.ps_join_step)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def num_processes(self) -> int:
        """Processes the run needs: the world, plus the parameter servers and spare workers with
        --strategy ps."""
        return self.world_size + (self.servers + self.ps_spares if self.strategy == "ps" else 0)

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

    # The rank grid ------------------------------------------------------------------------

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
