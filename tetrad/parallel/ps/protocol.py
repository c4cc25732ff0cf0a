"""What the parameter server's ranks agree on: the options, who plays which role, how the
parameters are cut into key ranges, and the messages on the wire.

Roles: of N ranks, the first W = N - S - J are workers (so rank 0, which writes the run report,
is a worker, as in every other layout), then J spare workers (membership.py), and the last S are
servers; the first server is also the scheduler (membership, clocks, the staleness gate, the end
of the run).

Keys: the parameters in model order, flattened into one dense key space that the servers split
into S equal contiguous ranges, plus one sparse table (the untied input embedding) that they
split by rows. A tied embedding is dense (the output projection touches every row), and so is an
untied lm_head: its gradient is a product with the softmax over the whole vocabulary, so every
row of it changes every step.

A message is a header (int64[10]: kind, sender rank, clock, count, two float64s stored as bits,
the key range it is about, flags, the sender's slot and the step's number of slots) then the payload tensors its kind implies; `payload_spec` is the
one place both sides read the payload shapes from, so a sender and its receiver cannot disagree.
The key range matters once a server stands in for a dead one (--ps-replicas 1): it then serves two
ranges, its own and the one it kept a replica of. The slot fields matter once a sync run's slots
change hands or grow (--ps-spares, sync.py): a server counts a step's pushes and STEPs by slot,
up to the number of slots the senders name.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.parallel.comm import KINDS, OFF_STEP_TAGS, Comm, CommCounter, Handle
from tetrad.parallel.mesh import Group

MODES = ("sync", "async", "ssp")
DEFAULT_STALENESS = 1
HEADER_LEN = 10
FOREVER_S = 30 * 24 * 3600.0  # a wait with no useful bound (a peer that may idle for hours)


@dataclass(frozen=True)
class PSOptions:
    """`--servers`, `--ps-mode`, `--staleness` and the failure timeouts. heartbeat_s: a worker
    the scheduler has heard nothing from for this long, while it owes the worker nothing, is
    dropped (async, ssp) or stops the job (sync); a crashed worker is noticed at once, this only
    catches hung ones. reply_timeout_s: how long a worker waits for a server's answer."""

    num_servers: int = 1
    mode: str = "sync"
    staleness: int | None = None
    heartbeat_s: float = 120.0
    reply_timeout_s: float = 600.0
    replicas: int = 0  # 1: each server's key range replicated on the next server (its standby)
    spares: int = 0  # worker ranks that wait to take a dead worker's place
    join_step: int | None = None  # sync: waiting spares join as new workers from this step on

    def __post_init__(self) -> None:
        if not isinstance(self.num_servers, int) or self.num_servers < 1:
            raise ConfigError(f"--servers must be a positive integer, got {self.num_servers!r}")
        if self.mode not in MODES:
            raise ConfigError(f"--ps-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.staleness is not None and self.mode != "ssp":
            raise ConfigError(f"--staleness bounds --ps-mode ssp only: drop it or use "
                              f"--ps-mode ssp (got --ps-mode {self.mode})")
        if self.mode == "ssp":
            if self.staleness is None:
                object.__setattr__(self, "staleness", DEFAULT_STALENESS)
            if not isinstance(self.staleness, int) or self.staleness < 0:
                raise ConfigError(f"--staleness must be an integer >= 0, got {self.staleness!r}")
        if self.replicas not in (0, 1):
            raise ConfigError(f"--ps-replicas must be 0 or 1, got {self.replicas!r}")
        if self.replicas and self.num_servers < 2:
            raise ConfigError("--ps-replicas 1 keeps each server's key range on the next server: "
                              "it needs --servers 2 or more")
        if self.replicas and self.mode != "sync":
            raise ConfigError(f"--ps-replicas 1 runs with --ps-mode sync only (got --ps-mode "
                              f"{self.mode}): an asynchronous update has no step to replay")
        if not isinstance(self.spares, int) or self.spares < 0:
            raise ConfigError(f"--ps-spares must be an integer >= 0, got {self.spares!r}")
        if self.join_step is not None and (self.mode != "sync" or not self.spares
                                           or not isinstance(self.join_step, int)
                                           or self.join_step < 1):
            raise ConfigError(f"a join step adds spare workers to a --ps-mode sync run from a "
                              f"step >= 1: it needs --ps-spares and --ps-mode sync (got step "
                              f"{self.join_step!r}, {self.spares} spares, --ps-mode {self.mode})")
        if not 0 < self.heartbeat_s < self.reply_timeout_s:
            # A worker held by the ssp gate waits for the scheduler to drop a hung worker.
            raise ConfigError(f"the worker reply timeout ({self.reply_timeout_s} s) must exceed "
                              f"the heartbeat timeout ({self.heartbeat_s} s), both positive")

    def roles(self, world_size: int) -> "Roles":
        if world_size <= self.num_servers + self.spares:
            raise ConfigError(f"{world_size} processes leave no worker beside {self.num_servers} "
                              f"parameter server(s) and {self.spares} spare(s): make --nproc "
                              f"larger than --servers plus --ps-spares")
        return Roles(world_size - self.num_servers - self.spares, self.num_servers, self.spares)


@dataclass(frozen=True)
class Roles:
    """Ranks: the workers that start the run, the spares that wait to replace one, then the
    servers."""

    num_workers: int
    num_servers: int
    num_spares: int = 0

    @property
    def workers(self) -> range:
        return range(self.num_workers)

    def most_workers(self, options: PSOptions) -> int:
        """How many workers a step may have: with a join step (sync), every spare joined."""
        return self.num_workers + self.num_spares * (options.join_step is not None)

    @property
    def spares(self) -> range:
        return range(self.num_workers, self.first_server)

    @property
    def first_server(self) -> int:
        return self.num_workers + self.num_spares

    @property
    def servers(self) -> range:
        return range(self.first_server, self.first_server + self.num_servers)

    @property
    def scheduler(self) -> int:
        return self.first_server

    def is_server(self, rank: int) -> bool:
        return rank >= self.first_server

    def is_spare(self, rank: int) -> bool:
        return rank in self.spares

    def server_index(self, rank: int) -> int:
        return rank - self.first_server

    def server_rank(self, index: int) -> int:
        return self.first_server + index % self.num_servers

    def standby(self, index: int) -> int:
        """The server rank that keeps key range `index`'s replica (--ps-replicas 1)."""
        return self.server_rank(index + 1)

    def describe(self, rank: int) -> str:
        if self.is_server(rank):
            role = "scheduler and server" if rank == self.scheduler else "server"
            return f"parameter {role} rank {rank} ({self.server_index(rank)} of {self.num_servers})"
        return f"{'spare ' if self.is_spare(rank) else ''}worker rank {rank}"


def check_run(batch_size: int, grad_accum: int, dtype: str, device: torch.device,
              num_workers: int, most_workers: int | None = None) -> None:
    """What a training run must satisfy to use the parameter server; `most_workers`: a sync run
    that spares may grow to that many workers."""
    if device.type != "cpu":
        raise ConfigError("--strategy ps runs on CPU over gloo (it detects dead peers by "
                          "gloo's point-to-point errors): add --device cpu, or train with --dp")
    if dtype == "fp16":
        raise ConfigError("--strategy ps has no fp16 loss scaling: use --dtype bf16 or fp32")
    for workers in range(num_workers, (most_workers or num_workers) + 1):  # equal shares
        if batch_size % (workers * grad_accum):
            raise ConfigError(f"--batch-size {batch_size} does not split into {workers} workers "
                              f"x grad-accum {grad_accum} equal microbatches: make it a multiple "
                              f"of {workers * grad_accum}")


@dataclass(frozen=True)
class KeyLayout:
    """The key space: dense parameters (name, numel) in model order, one flat range cut into
    num_servers equal pieces, and the sparse table's rows cut likewise."""

    dense: tuple[tuple[str, int], ...]
    sparse: str | None
    num_rows: int
    row_numel: int
    num_servers: int

    @classmethod
    def from_model(cls, model: nn.Module, num_servers: int) -> "KeyLayout":
        embed = getattr(model, "embed", None)
        sparse = ("embed.weight" if embed is not None and getattr(model, "lm_head", None)
                  is not None else None)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        rows, row_numel = (embed.weight.shape if sparse else (0, 0))
        return cls(tuple((name, p.numel()) for name, p in named if name != sparse), sparse,
                   rows, row_numel, num_servers)

    @property
    def dense_numel(self) -> int:
        return sum(numel for _, numel in self.dense)

    def dense_range(self, server: int) -> tuple[int, int]:
        total = self.dense_numel
        return total * server // self.num_servers, total * (server + 1) // self.num_servers

    def row_range(self, server: int) -> tuple[int, int]:
        return (self.num_rows * server // self.num_servers,
                self.num_rows * (server + 1) // self.num_servers)

    def dense_offsets(self) -> dict[str, int]:
        offsets, total = {}, 0
        for name, numel in self.dense:
            offsets[name] = total
            total += numel
        return offsets

    def dense_pieces(self, server: int) -> list[tuple[str, int, int, int]]:
        """(name, start, end, offset): elements [start, end) of `server`'s dense range hold the
        parameter's flat elements from `offset` on."""
        lo, hi = self.dense_range(server)
        pieces = []
        for (name, numel), (_, begin) in zip(self.dense, self.dense_offsets().items()):
            start, end = max(lo, begin), min(hi, begin + numel)
            if start < end:
                pieces.append((name, start - lo, end - lo, start - begin))
        return pieces


class Kind(IntEnum):
    PUSH = 1  # worker -> server: gradients (dense range, touched rows); async: lr in values[0]
    STEP = 2  # worker -> server (sync): lr, clip coefficient
    NORM = 3  # server -> worker (sync): squared norm of its range of the mean gradient
    PARAMS = 4  # server -> worker: its dense range
    PULL_ROWS = 5  # worker -> server: row ids
    ROWS = 6  # server -> worker: those rows
    METRIC = 7  # worker <-> scheduler (sync): a value to average over the workers, the mean
    SAVE = 8  # worker -> server: send me your state (checkpoint)
    STATE = 9  # server -> worker: params, exp_avg, exp_avg_sq; AdamW's step count in `clock`
    DONE = 10  # worker -> scheduler: my run-report entry
    FINISHED = 11  # scheduler -> worker: every rank's entry and the run summary
    PULL_ALL = 12  # worker -> server: the whole range and every row (end of run)
    ALL_PARAMS = 13  # server -> worker: its dense range and all its rows
    BYE = 14  # worker -> server: last message
    FINISH = 15  # scheduler -> server: the workers are done; which died
    SERVER_ENTRY = 16  # server -> scheduler: its run-report entry (its last message)
    DROPPED = 17  # scheduler -> worker: the answer to anything from a worker it dropped
    REPLICATE = 18  # server -> its standby: one applied update (mean gradient; lr, clip scale)
    REPLICATED = 19  # standby -> server: applied to the replica (the workers may have it now)
    JOIN = 20  # spare -> scheduler: I can take a dead worker's place
    ADMIT = 21  # scheduler -> spare: the slot (count; -1: not needed), its clock, the slots


# After these a peer sends nothing more: its receiving thread ends.
LAST_KINDS = (Kind.BYE, Kind.FINISH, Kind.SERVER_ENTRY)
OBJECT_KINDS = (Kind.DONE, Kind.FINISHED, Kind.FINISH, Kind.SERVER_ENTRY)


# Message flags.
HAS_NORM = 1  # a replayed PUSH whose sender already has this step's norm of the range: no NORM
NEW_SLOT = 2  # an ADMIT to a slot added to a sync run (not a dead worker's)


@dataclass
class Message:
    kind: Kind
    sender: int
    clock: int = 0
    count: int = 0
    values: tuple[float, float] = (0.0, 0.0)
    payload: tuple[torch.Tensor, ...] = ()
    key_range: int = -1  # the server index whose key range this is about; -1: the receiver's
    flags: int = 0
    slot: int = -1  # sync: the sender's slot (which share of the global batch it trains on)
    workers: int = 0  # sync: the step's number of slots (PARAMS of range 0: the next step's)

    def header(self) -> torch.Tensor:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[:4] = torch.tensor([int(self.kind), self.sender, self.clock, self.count])
        header[4:6] = torch.tensor(self.values, dtype=torch.float64).view(torch.int64)
        header[6:] = torch.tensor([self.key_range, self.flags, self.slot, self.workers])
        return header

    @classmethod
    def from_header(cls, header: torch.Tensor) -> "Message":
        kind, sender, clock, count = header[:4].tolist()
        values = tuple(header[4:6].clone().view(torch.float64).tolist())
        key_range, flags, slot, workers = header[6:].tolist()
        return cls(Kind(kind), sender, clock, count, values, key_range=key_range, flags=flags,
                   slot=slot, workers=workers)

    @classmethod
    def carrying(cls, kind: Kind, sender: int, value) -> "Message":
        """A message whose payload is one picklable object (report entries, the dead list)."""
        payload = encode_object(value)
        return cls(kind, sender, count=payload.numel(), payload=(payload,))

    def object(self):
        return decode_object(self.payload[0])


def payload_spec(kind: Kind, count: int, dense_numel: int, row_numel: int,
                 table_rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the payload of a message to or from one server, whose dense range
    has `dense_numel` elements and whose table has `table_rows` rows of `row_numel`."""
    f32, i64 = torch.float32, torch.int64
    if kind == Kind.PUSH:
        rows = [((count,), i64), ((count, row_numel), f32)] if count else []
        return [((dense_numel,), f32), *rows]
    if kind == Kind.PARAMS:
        return [((dense_numel,), f32)]
    if kind == Kind.PULL_ROWS:
        return [((count,), i64)]
    if kind == Kind.ROWS:
        return [((count, row_numel), f32)]
    tables = [((table_rows, row_numel), f32)] if table_rows else []  # no empty messages
    if kind == Kind.STATE:
        return [((dense_numel,), f32)] * 3 + tables * 3
    if kind == Kind.REPLICATE:
        return [((dense_numel,), f32)] + [((table_rows * row_numel,), f32)] * bool(table_rows)
    if kind == Kind.ALL_PARAMS:
        return [((dense_numel,), f32)] + tables
    if kind in OBJECT_KINDS:
        return [((count,), torch.uint8)]
    return []


def payload_tags(kind: Kind, num_tensors: int) -> tuple[str, ...]:
    """What each payload tensor is for, in the byte counters. Off-step tags ("checkpoint",
    "report") stay out of the run report's per-step numbers."""
    tags = {Kind.PUSH: ("grads", "row_ids", "grad_rows"), Kind.PARAMS: ("params",),
            Kind.PULL_ROWS: ("row_ids",), Kind.ROWS: ("param_rows",),
            Kind.STATE: ("checkpoint",) * 6, Kind.ALL_PARAMS: ("report",) * 2,
            Kind.REPLICATE: ("replica",) * 2}
    return tags.get(kind, ("report",) if kind in OBJECT_KINDS else ())[:num_tensors]


def allocate(spec: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape, dtype in spec]


def encode_object(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def decode_object(tensor: torch.Tensor):
    return pickle.loads(tensor.numpy().tobytes())


def empty_entry(rank: int, role: str) -> dict:
    """A run-report rank entry with every number zero (a worker that died sent none)."""
    return {"rank": rank, "role": role, "coords": {"dp": 0, "pp": 0, "cp": 0, "tp": 0, "ep": 0},
            "bytes": {"params": 0, "grads": 0, "optimizer": 0, "activations_peak": 0},
            "comm_bytes": dict.fromkeys(KINDS, 0), "idle_fraction": 0.0}


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def send(comm: Comm, group: Group, dst: int, message: Message) -> list[Handle]:
    """Post the header (tag "control") and the payload; wait on the handles before touching
    the payload."""
    tags = payload_tags(message.kind, len(message.payload))
    assert len(tags) == len(message.payload), message.kind
    handles = [comm.send(message.header(), dst, group, "control")]
    handles += [comm.send(tensor, dst, group, tag)
                for tensor, tag in zip(message.payload, tags)]
    return handles


def receive(comm: Comm, group: Group, src: int,
            buffers_for: Callable[[Message], list[torch.Tensor]], timeout_s: float) -> Message:
    """The next message from `src`: its header, then the payload into `buffers_for(message)`
    (fresh tensors, or views to fill in place)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    comm.recv(header, src, group).wait(timeout_s)
    message = Message.from_header(header)
    buffers = buffers_for(message)
    handles = [comm.recv(buffer, src, group) for buffer in buffers]
    for handle in handles:
        handle.wait(timeout_s)
    message.payload = tuple(buffers)
    return message


def record_received(counter: CommCounter, message: Message) -> None:
    """Count a received message's bytes under the tags its sender counted them."""
    counter.record("p2p", HEADER_LEN * 8, "control")
    for tensor, tag in zip(message.payload, payload_tags(message.kind, len(message.payload))):
        counter.record("p2p", nbytes(tensor), tag)


def per_step_by_tag(counter: CommCounter) -> dict[str, int]:
    """Bytes per step by tag, off-step tags left out (the run report's parameter_server part)."""
    steps = max(counter.steps, 1)
    return {tag: round(counter.totals((tag,))["p2p"] / steps)
            for tag in sorted(counter.tags()) if tag not in OFF_STEP_TAGS}
