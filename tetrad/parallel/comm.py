"""Every collective the runtime issues goes through `Comm`, which counts the bytes this rank sends.

Counting uses the ring-algorithm volumes (tetrad.spec.runtime_rules.ring_share, which the
planner prices too) for a full tensor of S bytes over a group of N ranks:
all-reduce 2(N-1)/N*S, reduce-scatter and all-gather (N-1)/N*S, all-to-all (N-1)/N*S (the share a
rank keeps for itself is not sent), broadcast and reduce (N-1)/N*S (a pipelined chain: every rank
but the last forwards S; averaged over the ranks), point-to-point S. Gather and scatter move
chunks straight to and from the root: a gather's sender S/N, its root nothing; a scatter's root
(N-1)/N*S, its receivers nothing. Group-of-one calls send nothing.

With `algorithm="ring"` all-reduce, reduce-scatter and all-gather run on tetrad's own ring over
send/recv (tetrad.parallel.ring), and the counter records the bytes at each send call instead of the formula, which is
how the tests check that the formula is what a ring really sends.

Each count carries a tag (what the traffic is for: "grads", "params", "metrics", ...). Tags in
OFF_STEP_TAGS (the initial broadcast, checkpoints, the end-of-run report) are kept out of the
per-step numbers of the run report. The autograd-aware operators of tensor and sequence
parallelism (Megatron's f and g) are built on these same calls, so they are counted too.

The counter also counts the calls, which the planner's ledger predicts one by one (a ring
algorithm's call is one, whatever its sends; a p2p call is a send, or an exchange's send and
receive together; `calls_per_step` is the run report's comm_calls), and times the
communication a rank waits for (exposed): a synchronous call whole, an async one
(async_op=True, send, recv) only inside Handle.wait(), where the rank stops until the
collective it overlapped with compute is done. `exposed_per_step` is the run report's
comm_exposed_s (tetrad.train.metrics).

Under --compile every collective and every wait is a graph break (`eager_collective`): it runs
eagerly between compiled pieces.
"""

from __future__ import annotations

import datetime
import pickle
import statistics
import time
from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist

from tetrad.parallel.mesh import Group
from tetrad.parallel.ring import (exchange_, ring_all_gather_, ring_all_reduce_,
                                  ring_reduce_scatter_)
from tetrad.spec.runtime_rules import COLLECTIVE_KINDS, ring_share, rooted_share

# torch 2.13 (requirements.txt) renamed all_gather_into_tensor / reduce_scatter_tensor; older
# releases, such as the 2.11 of the GPU machines the benchmarks run on, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

KINDS = COLLECTIVE_KINDS
OFF_STEP_TAGS = ("setup", "checkpoint", "report")
ALGORITHMS = ("backend", "ring")


def ring_volume(kind: str, nbytes: int, size: int) -> Fraction:
    """Bytes one rank sends for a collective over `size` ranks on a tensor of `nbytes` (the full
    tensor: the input of reduce-scatter, the output of all-gather)."""
    return ring_share(kind, size) * nbytes


class CommCounter:
    """Bytes sent by one rank, by (tag, kind). One per rank, handed to whoever communicates.
    Fractions keep sums of N-way shares exact; reports round to whole bytes."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.steps = 0
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._waiting: dict[str, float] = defaultdict(float)  # this step's exposed seconds
        self._step_waits: list[dict[str, float]] = []  # every finished step's, by kind

    def record(self, kind: str, nbytes: int | Fraction, tag: str, calls: int = 1) -> None:
        """`nbytes` sent by `calls` calls (0: more bytes of a call already counted)."""
        assert kind in KINDS, kind
        self._bytes[tag, kind] += nbytes
        self._calls[tag, kind] += calls

    def record_wait(self, kind: str, seconds: float, tag: str) -> None:
        """Seconds this rank stood still for communication of `kind` (off-step tags left out)."""
        if tag not in OFF_STEP_TAGS:
            self._waiting[kind] += seconds

    def end_step(self) -> None:
        self.steps += 1
        self._step_waits.append(dict(self._waiting))
        self._waiting.clear()

    def exposed_per_step(self) -> tuple[float, dict[str, float]] | None:
        """Median over the steps after the first (which pays for warm-up; the one step if there
        is one) of the seconds spent waiting on communication: in all, and by kind. None before
        any step."""
        steps = self._step_waits[1:] or self._step_waits
        if not steps:
            return None
        by_kind = {kind: statistics.median(step.get(kind, 0.0) for step in steps)
                   for kind in KINDS}
        return (statistics.median(sum(step.values()) for step in steps),
                {kind: seconds for kind, seconds in by_kind.items() if seconds})

    def totals(self, tags: tuple[str, ...] | None = None) -> dict[str, Fraction]:
        """Bytes by kind, over all tags or only `tags`."""
        totals = {kind: Fraction(0) for kind in KINDS}
        for (tag, kind), value in self._bytes.items():
            if tags is None or tag in tags:
                totals[kind] += value
        return totals

    def calls_per_step(self) -> dict[str, float]:
        """Mean calls per optimizer step by kind, leaving out OFF_STEP_TAGS (the run report)."""
        calls = dict.fromkeys(KINDS, 0)
        for (tag, kind), count in self._calls.items():
            if tag not in OFF_STEP_TAGS:
                calls[kind] += count
        return {kind: count / max(self.steps, 1) for kind, count in calls.items()}

    def tags(self) -> set[str]:
        return {tag for tag, _ in self._bytes}

    def totals_per_step(self) -> dict[str, int]:
        """Mean bytes per optimizer step by kind, leaving out OFF_STEP_TAGS (the run report)."""
        step_tags = tuple(tag for tag in self.tags() if tag not in OFF_STEP_TAGS)
        return {kind: round(value / max(self.steps, 1))
                for kind, value in self.totals(step_tags).items()}

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()
        self.steps = 0
        self._waiting.clear()
        self._step_waits.clear()


def eager_collective(method):
    """A collective runs outside any torch.compile graph (tetrad.parallel.compile): the block
    around it is compiled in pieces, and the call, its byte count and its handle stay Python."""
    return torch.compiler.disable(method, recursive=True)


class Handle:
    """What an async collective returns: wait() before touching its tensors. `work` is one
    torch Work, or a list of them (a batch of sends and receives). The wait is timed into
    `counter` (the exposed part of the communication) under its kind and tag."""

    def __init__(self, work=None, counter: CommCounter | None = None, kind: str = "p2p",
                 tag: str = ""):
        self._works = work if isinstance(work, list) else [work] if work is not None else []
        self._counter, self._kind, self._tag = counter, kind, tag

    @eager_collective
    def wait(self, timeout_s: float | None = None) -> None:
        """`timeout_s` replaces the process group's timeout for this wait (the parameter server
        waits on peers that may legitimately stay silent longer). On gloo a wait that times out
        breaks the process group: only for waits whose failure ends the job."""
        started = time.perf_counter()
        for work in self._works:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout_s))
        if self._works and self._counter is not None:
            self._counter.record_wait(self._kind, time.perf_counter() - started, self._tag)
        self._works = []


DONE = Handle()


class Comm:
    """The collectives, bound to one rank's counter and the algorithm choice. Tensors are
    contiguous; reduce-scatter's input is N equal chunks (the caller pads) and its contents are
    scratch afterwards. Ring collectives are synchronous: their Handle is already done. A call
    with async_op=False waits before returning, timed like an async call's wait."""

    def __init__(self, counter: CommCounter | None = None, algorithm: str = "backend"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.counter = counter if counter is not None else CommCounter()
        self.algorithm = algorithm

    def _count(self, kind: str, nbytes: int, group: Group, tag: str) -> None:
        self.counter.record(kind, ring_volume(kind, nbytes, group.size), tag)

    def _sent(self, kind: str, tag: str):
        return lambda tensor: self.counter.record(kind, tensor.numel() * tensor.element_size(),
                                                  tag, calls=0)

    def _issued(self, work, kind: str, tag: str, async_op: bool) -> Handle:
        """The Handle of a backend call issued async; waited for here unless `async_op`."""
        handle = Handle(work, self.counter, kind, tag)
        if async_op:
            return handle
        handle.wait()
        return DONE

    def _ring(self, kind: str, tag: str, run, *args) -> Handle:
        """Run one of tetrad's ring collectives (synchronous: all of it is exposed)."""
        started = time.perf_counter()
        self.counter.record(kind, 0, tag)
        run(*args, self._sent(kind, tag))
        self.counter.record_wait(kind, time.perf_counter() - started, tag)
        return DONE

    @eager_collective
    def all_reduce(self, tensor: torch.Tensor, group: Group, tag: str, op: str = "sum",
                   async_op: bool = False) -> Handle:
        if group.size == 1:
            return DONE
        if self.algorithm == "ring" and op == "sum":
            return self._ring("all_reduce", tag, ring_all_reduce_, tensor, group)
        self._count("all_reduce", _nbytes(tensor), group, tag)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._issued(dist.all_reduce(tensor, reduce_op, group=group.handle, async_op=True),
                            "all_reduce", tag, async_op)

    @eager_collective
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Group, tag: str,
                       async_op: bool = False) -> Handle:
        """Sum `input` over the group; this rank gets chunk `group.index` in `output`. `output`
        may be that chunk of `input` itself (in place)."""
        assert input.numel() == output.numel() * group.size, (input.shape, output.shape)
        if group.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return DONE
        if self.algorithm == "ring":
            chunks = list(input.view(-1).chunk(group.size))
            self._ring("reduce_scatter", tag, ring_reduce_scatter_, chunks, group)
            if output.data_ptr() != chunks[group.index].data_ptr():
                output.copy_(chunks[group.index].view_as(output))
            return DONE
        self._count("reduce_scatter", _nbytes(input), group, tag)
        return self._issued(reduce_scatter_single(output, input, group=group.handle,
                                                   async_op=True),
                            "reduce_scatter", tag, async_op)

    @eager_collective
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, tag: str,
                   async_op: bool = False) -> Handle:
        """Concatenate every rank's `input` into `output`; `input` may be this rank's chunk of
        `output` (in place)."""
        assert output.numel() == input.numel() * group.size, (input.shape, output.shape)
        if group.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return DONE
        if self.algorithm == "ring":
            chunks = list(output.view(-1).chunk(group.size))
            if chunks[group.index].data_ptr() != input.data_ptr():
                chunks[group.index].copy_(input.view(-1))
            return self._ring("all_gather", tag, ring_all_gather_, chunks, group)
        self._count("all_gather", _nbytes(output), group, tag)
        return self._issued(all_gather_single(output, input, group=group.handle,
                                               async_op=True),
                            "all_gather", tag, async_op)

    @eager_collective
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, tag: str,
                   output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None, async_op: bool = False) -> Handle:
        """Chunk i of `input` (along dim 0, sizes `input_splits`) goes to group rank i."""
        if group.size == 1:
            output.copy_(input)
            return DONE
        rows = input_splits or [input.shape[0] // group.size] * group.size
        row_bytes = _nbytes(input) // max(input.shape[0], 1)
        self.counter.record("all_to_all", (sum(rows) - rows[group.index]) * row_bytes, tag)
        return self._issued(dist.all_to_all_single(output, input, output_splits, input_splits,
                                                   group=group.handle, async_op=True),
                            "all_to_all", tag, async_op)

    @eager_collective
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, tag: str) -> None:
        """Copy group rank `src`'s tensor to every rank of the group."""
        if group.size == 1:
            return
        self._count("broadcast", _nbytes(tensor), group, tag)
        self._issued(dist.broadcast(tensor, group=group.handle, group_src=src, async_op=True),
                     "broadcast", tag, async_op=False)

    def _count_rooted(self, kind: str, nbytes: int, root: int, group: Group, tag: str) -> None:
        share = rooted_share(kind, group.size, group.index == root)
        self.counter.record(kind, share * nbytes, tag)

    @eager_collective
    def reduce(self, tensor: torch.Tensor, dst: int, group: Group, tag: str,
               op: str = "sum") -> None:
        """Sum (or max) `tensor` over the group into group rank `dst`'s copy; the other ranks'
        copies are scratch afterwards (for what only `dst` reads: a logged loss)."""
        if group.size == 1:
            return
        self._count_rooted("reduce", _nbytes(tensor), dst, group, tag)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._issued(dist.reduce(tensor, op=reduce_op, group=group.handle, group_dst=dst,
                                 async_op=True), "reduce", tag, async_op=False)

    @eager_collective
    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int, group: Group,
               tag: str) -> None:
        """Every rank's `input` concatenated into `output` on group rank `dst` (N times its
        size; None on the other ranks)."""
        assert (output is None) == (group.index != dst), (group.index, dst)
        if group.size == 1:
            output.copy_(input.view_as(output))
            return
        self._count_rooted("gather", _nbytes(input) * group.size, dst, group, tag)
        chunks = list(output.view(group.size, -1)) if output is not None else None
        self._issued(dist.gather(input.view(-1), chunks, group=group.handle, group_dst=dst,
                                 async_op=True), "gather", tag, async_op=False)

    @eager_collective
    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int, group: Group,
                tag: str) -> None:
        """Chunk i of group rank `src`'s `input` (N times `output`'s size; None on the other
        ranks) into group rank i's `output`."""
        assert (input is None) == (group.index != src), (group.index, src)
        if group.size == 1:
            output.copy_(input.view_as(output))
            return
        self._count_rooted("scatter", _nbytes(output) * group.size, src, group, tag)
        chunks = list(input.view(group.size, -1)) if input is not None else None
        self._issued(dist.scatter(output.view(-1), chunks, group=group.handle, group_src=src,
                                  async_op=True), "scatter", tag, async_op=False)

    @eager_collective
    def send(self, tensor: torch.Tensor, dst: int, group: Group, tag: str) -> Handle:
        """Send to group rank `dst` (async: wait before reusing `tensor`)."""
        self.counter.record("p2p", _nbytes(tensor), tag)
        return Handle(dist.isend(tensor, group=group.handle, group_dst=dst), self.counter, "p2p",
                      tag)

    @eager_collective
    def recv(self, tensor: torch.Tensor, src: int, group: Group, tag: str = "") -> Handle:
        """Receive from group rank `src`; only the sender counts the bytes (the wait is timed
        under `tag`)."""
        return Handle(dist.irecv(tensor, group=group.handle, group_src=src), self.counter, "p2p",
                      tag)

    @eager_collective
    def exchange(self, outgoing: torch.Tensor, dst: int, incoming: torch.Tensor, src: int,
                 group: Group, tag: str) -> Handle:
        """Send `outgoing` to group rank `dst` and receive `incoming` from `src`, posted as one
        batch. NCCL runs a pair of ranks' sends and receives in issue order on one stream, so
        two ranks that each send to the other first (a ring of two) would both wait for a
        receive that never starts once the tensor outgrows NCCL's buffers; a batch
        (batch_isend_irecv: one NCCL group) runs both at once. Only the send is counted."""
        self.counter.record("p2p", _nbytes(outgoing), tag)
        return Handle(exchange_(outgoing, dst, incoming, src, group), self.counter, "p2p", tag)

    def all_gather_object(self, value, group: Group, tag: str) -> list:
        """Every rank's picklable `value`, in group order (small metadata, e.g. the report)."""
        if group.size == 1:
            return [value]
        self._count("all_gather", len(pickle.dumps(value)) * group.size, group, tag)
        values = [None] * group.size
        started = time.perf_counter()
        dist.all_gather_object(values, value, group=group.handle)
        self.counter.record_wait("all_gather", time.perf_counter() - started, tag)
        return values


    def gather_object(self, value, dst: int, group: Group, tag: str) -> list | None:
        """Every rank's picklable `value` in group order on group rank `dst`, None elsewhere
        (what only `dst` reads: the run report's rank entries)."""
        if group.size == 1:
            return [value]
        # A sender's pickle is its share: the gather's formula with S = N times it.
        self._count_rooted("gather", len(pickle.dumps(value)) * group.size, dst, group, tag)
        values = [None] * group.size if group.index == dst else None
        started = time.perf_counter()
        dist.gather_object(value, values, group=group.handle, group_dst=dst)
        self.counter.record_wait("gather", time.perf_counter() - started, tag)
        return values


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
