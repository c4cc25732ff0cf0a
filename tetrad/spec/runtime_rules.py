"""The runtime's rules that the planner's model prices: one torch-free copy the runtime runs and
the planner reads, so that changing how tetrad trains changes the prediction with it.

- Collectives (tetrad.parallel.comm counts them, tetrad.planner.comm predicts them): the kinds
  the byte counter knows, and the share of a tensor one rank sends in each, as ring algorithms
  send it.
- Data-parallel buckets (tetrad.parallel.data_parallel, zero, zero_optimizer; the planner's
  eager_state): torch DDP's caps, the greedy fill in reverse registration order, ZeRO-2's buckets
  per pipeline stage, and a flat buffer padded to a multiple of the group.
- Pipelines (tetrad.parallel.parallelize and pipeline; the planner's eager_params): the virtual
  stages a pipeline rank runs.
- Tensor-parallel overlap (tetrad.parallel.tp_overlap; the planner's eager_overlap): how many
  chunks each TP collective is cut into.
- FP8 (tetrad.models.fp8; the planner's precision): the block DeepSeek-V3's recipe scales by.

tests/test_runtime_rules.py checks, rule by rule, that what the runtime builds is what the
planner assumes.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from typing import Callable, Sequence, TypeVar

Item = TypeVar("Item")

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                    "reduce", "gather", "scatter", "p2p")
ROOTED_KINDS = ("broadcast", "reduce", "gather", "scatter")

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket, torch's too (dist._DEFAULT_FIRST_BUCKET_BYTES)

# More chunks hide more of each collective, fewer keep the matmuls large.
TP_OVERLAP_CHUNKS = 4

FP8_BLOCK = 128  # DeepSeek-V3's groups: 128x128 weight blocks, 1x128 activation tiles


@lru_cache(maxsize=None)
def ring_share(kind: str, size: int) -> Fraction:
    """The share of a collective's full tensor (the input of reduce-scatter and scatter, the
    output of all-gather and gather) one rank of a group of `size` sends: all-reduce 2(N-1)/N;
    reduce-scatter, all-gather and all-to-all (N-1)/N (the share a rank keeps is not sent);
    broadcast and reduce (N-1)/N (a pipelined chain: every rank but the last forwards it,
    averaged over the ranks); point-to-point the whole message. Gather and scatter go straight
    to and from the root, so ranks differ: this is the fullest rank's share (a gather's senders
    1/N, a scatter's root (N-1)/N; rooted_share has each rank's). A group of one sends nothing."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if size <= 1:
        return Fraction(0)
    if kind == "p2p":
        return Fraction(1)
    if kind == "gather":
        return Fraction(1, size)
    return Fraction(2 * (size - 1) if kind == "all_reduce" else size - 1, size)


def rooted_share(kind: str, size: int, is_root: bool) -> Fraction:
    """The share of a rooted collective's full tensor that one rank sends: gather's root and
    scatter's other ranks send nothing; broadcast and reduce send ring_share on every rank."""
    if kind not in ROOTED_KINDS:
        raise ValueError(f"{kind!r} has no root (rooted kinds: {', '.join(ROOTED_KINDS)})")
    if (kind == "gather" and is_root) or (kind == "scatter" and not is_root):
        return Fraction(0)
    return ring_share(kind, size)


def bucket_chunks(shard_numel: int, group: int, bucket_elements: int) -> list[tuple[int, int]]:
    """(start, end) in a rank's shard of a flat ZeRO-3 unit of each collective that moves it
    through --zero-bucket-size buffers: every rank's piece of at most bucket_elements // group
    elements (one at least) per call, so a call moves at most the bucket; without a bucket (0)
    the whole shard in one call."""
    if not bucket_elements:
        return [(0, shard_numel)]
    step = max(1, bucket_elements // group)
    return [(start, min(start + step, shard_numel)) for start in range(0, shard_numel, step)]


def bucket_buffer_elements(shard_numels: Sequence[int], group: int, bucket_elements: int) -> int:
    """Elements of each of ZeRO-3's two --zero-bucket-size buffers (gather, reduce-scatter): the
    largest call bucket_chunks makes of the rank's unit shards `shard_numels`."""
    return group * max((end - start for numel in shard_numels
                        for start, end in bucket_chunks(numel, group, bucket_elements)),
                       default=0)


def fill_buckets(items: Sequence[Item], nbytes: Callable[[Item], int], bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> list[list[Item]]:
    """Greedy buckets of about `bucket_bytes`, in reverse registration order (about the order
    backward produces gradients); the first of about `first_bucket_bytes` when given. A bucket
    closes once it holds its limit or more; an item never straddles two."""
    buckets: list[list[Item]] = [[]]
    size, limit = 0, first_bucket_bytes or bucket_bytes
    for item in reversed(items):
        if size >= limit:
            buckets.append([])
            size, limit = 0, bucket_bytes
        buckets[-1].append(item)
        size += nbytes(item)
    return buckets


def ddp_buckets(items: Sequence[Item], nbytes: Callable[[Item], int],
                bucket_bytes: int = BUCKET_BYTES) -> list[list[Item]]:
    """DDP's gradient buckets: a small first one (torch DDP's) starts communicating while
    backward has most of the model left; a model under `bucket_bytes` would otherwise be one
    bucket, reduced after backward with nothing left to hide it behind."""
    return fill_buckets(items, nbytes, bucket_bytes, min(FIRST_BUCKET_BYTES, bucket_bytes))


def stage_buckets(stages: dict[int, list[Item]], tied: Callable[[Item], bool],
                  nbytes: Callable[[Item], int], bucket_bytes: int = BUCKET_BYTES
                  ) -> dict[int, list[list[Item]]]:
    """ZeRO-2's buckets under a pipeline, per stage (`stages`: each stage's parameters in
    registration order): a tied embedding's copy in a bucket of its own, last, so that its two
    copies, on the first and the last stage, are laid out alike."""
    buckets = {}
    for stage, held in stages.items():
        copies = [item for item in held if tied(item)]
        buckets[stage] = (fill_buckets([item for item in held if not tied(item)], nbytes,
                                       bucket_bytes) + ([copies] if copies else []))
    return buckets


def reduces_per_stage(zero: int, pp: int) -> bool:
    """ZeRO-2/3 reduce every microbatch, so under a pipeline they bucket (or unit) and reduce
    stage by stage; ZeRO-1 reduces once after the step's last backward, over one run."""
    return pp > 1 and zero > 1


def padded(elements: int, group: int) -> int:
    """A flat buffer of `elements`, padded so that each of `group` ranks owns an equal shard."""
    return -(-elements // group) * group


def rank_stages(pp_rank: int, num_stages: int, pp: int,
                v_shape: bool = False) -> tuple[int, ...]:
    """The virtual stages pipeline rank `pp_rank` runs: stage s lives on rank s % pp
    (Megatron's interleaving), or, in the V placement of ZB-V and DualPipeV (two stages per
    rank), stages pp_rank and 2 * pp - 1 - pp_rank (tetrad.schedules.actions)."""
    if v_shape:
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(range(pp_rank, num_stages, pp))
