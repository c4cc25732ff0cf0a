"""A parameter-server worker's side of the protocol: what it sends the servers and the
scheduler, and what it receives (tetrad.train.ps_strategy drives it as the trainer's strategy).

The worker holds a full replica of the model. Its dense parameters are views of one flat
buffer and their gradients views of another (as DDP's buckets), so a server's key range is one
contiguous slice to push from and to pull into, with no copies. The sparse table (the untied
embedding) is pulled row by row: the strategy sees which rows this step's inputs read and pulls
exactly those, and the push carries exactly those rows' gradients. Rows the batch does not read
may be stale on the worker; nothing reads them until the end of the run, when `finish` pulls
every row so evaluation and sampling see the servers' final parameters.

Per step (sync):  pull_rows  PULL_ROWS -> ROWS          mean  METRIC -> METRIC
                  push  PUSH                            squared_norm  <- NORM (each server)
                  step  STEP(lr, clip coefficient) -> PARAMS
Per step (async, ssp): the worker clips its own gradient (it is the whole update), and step
pushes it with its learning rate; the PARAMS reply is the pull (held back in ssp while the
worker is K steps ahead of the slowest).

Messages to the servers are addressed by key range (`route`: range -> the server answering for
it). With --ps-replicas 1, a server that fails mid-conversation hands its range to its standby:
the worker sends the standby what the dead server had from it in this step (`_replay`: the push,
marked HAS_NORM once the worker has that range's norm) and the message it was sending, and takes
the answer from the standby.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn

from tetrad.errors import TetradError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps.protocol import (FOREVER_S, HAS_NORM, NEW_SLOT, Kind, KeyLayout,
                                         Message, PSOptions, allocate, payload_spec,
                                         per_step_by_tag, receive, record_received, send)
from tetrad.parallel.ps.membership import NOT_NEEDED
from tetrad.sharded_tensors import CHECKPOINT_KINDS, Piece, whole_pieces


@dataclass(frozen=True)
class Admission:
    """A spare's place in a running job: the slot of the worker it replaces, or in sync mode a
    new slot (which share of each global batch it trains on), that slot's clock (the step it
    continues at) and, in sync mode, how many slots the step has."""

    slot: int
    clock: int
    slots: int = 0
    new_slot: bool = False


def await_admission(world: Group, comm: Comm, options: PSOptions) -> Admission | None:
    """A spare rank asks the scheduler to JOIN and waits, with no useful bound (a spare may wait
    out the whole run), until it is admitted to a dead worker's slot; None when the run ended
    without needing it."""
    roles, rank = options.roles(world.size), world.ranks[world.index]
    try:
        for handle in send(comm, world, roles.scheduler, Message(Kind.JOIN, rank)):
            handle.wait(options.reply_timeout_s)
        answer = receive(comm, world, roles.scheduler, lambda message: [], FOREVER_S)
    except RuntimeError as error:
        raise TetradError(f"{roles.describe(rank)} could not join: "
                          f"{roles.describe(roles.scheduler)} failed to answer "
                          f"({str(error).splitlines()[0]})") from None
    if answer.count == NOT_NEEDED:
        return None
    return Admission(answer.count, answer.clock, answer.workers, bool(answer.flags & NEW_SLOT))


class WorkerClient:
    """One worker rank's conversation with the servers and the scheduler, over its replica."""

    def __init__(self, model: nn.Module, world: Group, comm: Comm, options: PSOptions):
        self.model, self.world, self.collectives, self.options = model, world, comm, options
        self.sent = comm.counter
        self.received = CommCounter()
        self.roles = options.roles(world.size)
        self.rank = world.ranks[world.index]
        assert not self.roles.is_server(self.rank), self.rank
        self.servers = list(self.roles.servers)
        self.route = {self.roles.server_index(s): s for s in self.servers}
        self.dead_servers: set[int] = set()
        self.pushes: dict[int, Message] = {}  # this step's push of each range (for replays)
        self.layout = KeyLayout.from_model(model, options.num_servers)
        self.clock = 0
        self.slot = self.rank  # which share of each global batch it trains on
        self.slots = self.roles.num_workers  # sync: how many shares this step's batch has
        self.rounds = 0  # sync: METRIC rounds of this step so far
        self.touched: torch.Tensor | None = None  # sorted ids of the rows this step reads
        params = dict(model.named_parameters())
        self.flat = torch.empty(self.layout.dense_numel)
        self.flat_grad = torch.zeros(self.layout.dense_numel)
        for name, offset in self.layout.dense_offsets().items():
            param = params[name]
            view = self.flat[offset:offset + param.numel()].view_as(param)
            view.copy_(param.detach())
            param.data = view
            param.grad = self.flat_grad[offset:offset + param.numel()].view_as(param)
        self.embed = params[self.layout.sparse] if self.layout.sparse else None

    def take_over(self, admission: Admission) -> None:
        """A spare admitted to a running job: its slot and clock, the servers' current parameters
        (every row). Sync: a new slot waits for the parameters of its first step; a dead
        worker's slot goes on from the step no server has applied yet (the earliest range's
        count), which the spare then redoes."""
        self.slot, self.clock = admission.slot, admission.clock
        if self.options.mode != "sync":
            self._pull_all()
            return
        self.slots = admission.slots
        applied = self._pull_all(admission.clock if admission.new_slot else 0)
        self.clock = min(applied.values())

    def _for_step(self, kind: Kind, **fields) -> Message:
        """A message of this step, naming this worker's slot and the step's slots (sync)."""
        return Message(kind, self.rank, self.clock, slot=self.slot, workers=self.slots, **fields)

    # Talking to the servers ----------------------------------------------------------------

    @contextlib.contextmanager
    def _talking_to(self, server: int) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            raise self._lost(server, error) from None

    def _lost(self, server: int, error: Exception) -> TetradError:
        detail = str(error).splitlines()[0]
        if self.options.replicas and server == self.roles.scheduler:
            return TetradError(
                f"{self.roles.describe(server)} failed to answer ({detail}): the scheduler "
                f"(membership, clocks, the loss mean) has no standby, so training stops; restart "
                f"from the last checkpoint with --resume")
        if self.options.replicas:
            return TetradError(
                f"{self.roles.describe(server)} failed to answer ({detail}) after its standby "
                f"did too: no copy of its key range is left, so training stops; restart from "
                f"the last checkpoint with --resume")
        return TetradError(
            f"{self.roles.describe(server)} failed to answer ({detail}): it holds the only copy "
            f"of its key range, so training stops; restart from the last checkpoint with "
            f"--resume")

    def _post(self, messages: dict[int, Message]) -> None:
        """Send one message to each of several servers, then wait for all of them."""
        posted = {}
        for server, message in messages.items():
            with self._talking_to(server):
                posted[server] = send(self.collectives, self.world, server, message)
        for server, handles in posted.items():
            with self._talking_to(server):
                for handle in handles:
                    handle.wait(self.options.reply_timeout_s)

    def _receive(self, server: int, kind: Kind,
                 buffers_for: Callable[[Message], list[torch.Tensor]] | None = None,
                 timeout_s: float | None = None) -> Message:
        with self._talking_to(server):
            return self._receive_raw(server, kind, buffers_for, timeout_s)

    def _receive_raw(self, server: int, kind: Kind,
                     buffers_for: Callable[[Message], list[torch.Tensor]] | None = None,
                     timeout_s: float | None = None) -> Message:
        def fresh(message: Message) -> list[torch.Tensor]:
            return allocate(payload_spec(message.kind, message.count, 0,
                                         self.layout.row_numel, 0))
        message = receive(self.collectives, self.world, server,
                          lambda m: (buffers_for and buffers_for(m)) or fresh(m),
                          timeout_s or self.options.reply_timeout_s)
        if message.kind == Kind.DROPPED:
            raise TetradError(
                f"worker rank {self.rank} was silent for more than {self.options.heartbeat_s:.0f}"
                f" s and the scheduler dropped it; the other workers trained on without it")
        assert message.kind == kind, (message.kind, kind)
        record_received(self.received, message)
        return message

    def _converse(self, messages: dict[int, Message | None], reply: Kind | None,
                  buffers_for: Callable[[int], list[torch.Tensor]] | None = None,
                  replay: Callable[[int], list[Message]] = lambda r: []) -> dict[int, Message]:
        """Send each key range's message (None: nothing, only the answer) to the server that
        answers for it, then take each range's `reply` (its payload into `buffers_for(range)`).
        A server that fails hands its ranges to its standby (_fail_over), which gets
        `replay(range)` and the message again. Returns the replies by range."""
        def into(message: Message) -> list[torch.Tensor] | None:
            return buffers_for(message.key_range) if buffers_for else None

        todo, replies, moved = dict(messages), {}, set()
        while todo:
            by_server: dict[int, list[int]] = {}
            for key_range in todo:
                by_server.setdefault(self.route[key_range], []).append(key_range)
            failed: dict[int, RuntimeError] = {}
            posted = {}
            for server, ranges in by_server.items():
                outgoing = [m for r in ranges
                            for m in (replay(r) if r in moved else []) + [todo[r]] if m]
                try:
                    posted[server] = [h for m in outgoing
                                      for h in send(self.collectives, self.world, server, m)]
                except RuntimeError as error:
                    failed[server] = error
            for server, handles in posted.items():
                try:
                    for handle in handles:
                        handle.wait(self.options.reply_timeout_s)
                except RuntimeError as error:
                    failed[server] = error
            for server, ranges in by_server.items():
                if server in failed:
                    continue
                if reply is None:
                    for key_range in ranges:
                        del todo[key_range]
                    continue
                try:
                    for _ in ranges:  # in the order the server answers, each naming its range
                        message = self._receive_raw(server, reply, into)
                        replies[message.key_range] = message
                        del todo[message.key_range]
                except RuntimeError as error:
                    failed[server] = error
            for server, error in failed.items():
                moved.update(self._fail_over(server, error))
        return replies

    def _fail_over(self, server: int, error: RuntimeError) -> list[int]:
        """`server` died: its own range goes to its standby (which kept a replica). Returns the
        ranges that moved; raises when no copy is left."""
        index = self.roles.server_index(server)
        standby = self.roles.standby(index)
        if (not self.options.replicas or server == self.roles.scheduler
                or standby in self.dead_servers):
            raise self._lost(server, error)
        self.dead_servers.add(server)
        moved = [r for r, s in self.route.items() if s == server]
        if moved != [index]:  # it had taken over a range already: that range has no copy left
            raise self._lost(server, error)
        self.route[index] = standby
        return moved

    def _dense(self, flat: torch.Tensor, key_range: int) -> torch.Tensor:
        lo, hi = self.layout.dense_range(key_range)
        return flat[lo:hi]

    def _rows_by_range(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Sorted row ids -> the ids each key range holds (ranges holding none left out)."""
        starts = [self.layout.row_range(r)[0] for r in range(self.roles.num_servers)]
        cuts = torch.searchsorted(ids, torch.tensor(starts[1:] + [self.layout.num_rows]))
        pieces = torch.tensor_split(ids, cuts[:-1].tolist())
        return {r: piece for r, piece in enumerate(pieces) if piece.numel()}

    @torch.no_grad()
    def pull_rows(self, ids: torch.Tensor) -> None:
        """The rows `ids` (sorted) of the sparse table, from their servers; the push of this
        step carries exactly their gradients."""
        self.touched = ids
        wanted = self._rows_by_range(ids)
        replies = self._converse(
            {r: Message(Kind.PULL_ROWS, self.rank, self.clock, len(piece), payload=(piece,),
                        key_range=r) for r, piece in wanted.items()}, Kind.ROWS)
        for key_range, piece in wanted.items():
            self.embed.data.index_copy_(0, piece, replies[key_range].payload[0])

    def push(self, lr: float) -> None:
        """This step's gradient, each key range its share (and its touched rows); `lr` in async
        and ssp modes, where a push is an update."""
        wanted = self._rows_by_range(self.touched) if self.embed is not None else {}
        grad = self.embed.grad if self.embed is not None else None
        self.pushes = {}
        for key_range in range(self.roles.num_servers):
            payload = (self._dense(self.flat_grad, key_range),)
            piece = wanted.get(key_range)
            if piece is not None:
                payload += (piece, grad.index_select(0, piece))
            self.pushes[key_range] = self._for_step(
                Kind.PUSH, count=0 if piece is None else len(piece), values=(lr, 0.0),
                payload=payload, key_range=key_range)
        self._converse(dict(self.pushes), None)

    # The step ------------------------------------------------------------------------------

    def _replay_push(self, has_norm: bool) -> Callable[[int], list[Message]]:
        def replay(key_range: int) -> list[Message]:
            return [replace(self.pushes[key_range], flags=HAS_NORM if has_norm else 0)]
        return replay

    def squared_norm(self) -> float:
        """Sync: the mean gradient's squared norm, each server's range summed."""
        replies = self._converse(dict.fromkeys(range(self.roles.num_servers)), Kind.NORM,
                                 replay=self._replay_push(has_norm=False))
        return sum(replies[r].values[0] for r in sorted(replies))

    def step(self, lr: float, clip_scale: float) -> None:
        """Sync: STEP (lr, clip coefficient) to every server; async and ssp: push this worker's
        gradient with its lr. Then pull the fresh parameters (PARAMS) and start the next step."""
        ranges = range(self.roles.num_servers)
        if self.options.mode == "sync":
            replies = self._converse(
                {r: self._for_step(Kind.STEP, values=(lr, clip_scale), key_range=r)
                 for r in ranges}, Kind.PARAMS, lambda r: [self._dense(self.flat, r)],
                replay=self._replay_push(has_norm=True))
            self.slots = replies[0].workers  # the scheduler's range names the next step's
        else:
            self.push(lr)
            self._converse(dict.fromkeys(ranges), Kind.PARAMS,
                           lambda r: [self._dense(self.flat, r)])
        self.flat_grad.zero_()
        if self.embed is not None:
            self.embed.grad = None
        self.clock += 1
        self.rounds = 0
        self.sent.end_step()
        self.received.end_step()

    def mean(self, value: float) -> float:
        """The mean of `value` over the workers, by the scheduler (sync)."""
        scheduler = self.roles.scheduler
        self._post({scheduler: self._for_step(Kind.METRIC, count=self.rounds,
                                              values=(value, 0.0))})
        self.rounds += 1
        return self._receive(scheduler, Kind.METRIC).values[0]

    def finish(self, entry: dict) -> dict:
        """Ends the session with the servers: sends this worker's run-report entry to the
        scheduler, waits until every worker is done or dead, pulls the final parameters (every
        row), says goodbye. Returns the scheduler's report: every rank's entry ("ranks") and the
        run summary ("summary")."""
        entry = {**entry, "role": "worker",
                 "parameter_server": {"pushed_per_step": per_step_by_tag(self.sent),
                                      "pulled_per_step": per_step_by_tag(self.received)}}
        scheduler = self.roles.scheduler
        self._post({scheduler: Message.carrying(Kind.DONE, self.rank, entry)})
        report = self._receive(scheduler, Kind.FINISHED, timeout_s=FOREVER_S).object()
        self._pull_all()
        for server in self.servers:
            if server in self.dead_servers or server in report["summary"].get("dead_servers", ()):
                continue
            self._post({server: Message(Kind.BYE, self.rank, self.clock)})
        return report

    @torch.no_grad()
    def _pull_all(self, clock: int | None = None) -> dict[int, int]:
        """Every range's parameters once (sync) it has applied `clock` updates (None: this
        worker's clock); returns each range's count of applied updates."""
        tables = [self.embed.data] if self.embed is not None else []
        clock = self.clock if clock is None else clock
        replies = self._converse(
            {r: Message(Kind.PULL_ALL, self.rank, clock, key_range=r)
             for r in range(self.roles.num_servers)}, Kind.ALL_PARAMS,
            lambda r: [self._dense(self.flat, r), *self._table_rows(r, tables)])
        return {r: reply.clock for r, reply in replies.items()}

    def _table_rows(self, key_range: int, tables: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows range `key_range` holds of each table; none when it holds no rows (nothing
        is sent)."""
        lo, hi = self.layout.row_range(key_range)
        return [table[lo:hi] for table in tables] if hi > lo else []

    def fetch_state(self) -> tuple[list[Piece], int]:
        """Every server's range and moments, as whole tensors (pieces of CHECKPOINT_KINDS), and
        the optimizer's step count."""
        dense = [torch.empty(self.layout.dense_numel) for _ in range(3)]
        tables = [torch.empty(self.layout.num_rows, self.layout.row_numel) for _ in range(3)]
        replies = self._converse(
            {r: Message(Kind.SAVE, self.rank, self.clock, key_range=r)
             for r in range(self.roles.num_servers)}, Kind.STATE,
            lambda r: [self._dense(flat, r) for flat in dense] + self._table_rows(r, tables))
        steps = [replies[r].clock for r in sorted(replies)]
        shapes = {name: p.shape for name, p in self.model.named_parameters()}

        def by_name(flat: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
            named = {name: flat[offset:offset + shapes[name].numel()].view(shapes[name]).clone()
                     for name, offset in self.layout.dense_offsets().items()}
            if self.layout.sparse:
                named[self.layout.sparse] = table
            return named

        pieces = [piece for index, kind in enumerate(CHECKPOINT_KINDS)
                  for piece in whole_pieces(kind, by_name(dense[index], tables[index]))]
        # The scheduler's count: in async mode a worker that died between two pushes leaves the
        # servers one update apart.
        return pieces, steps[0]
