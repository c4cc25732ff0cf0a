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
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from tetrad.errors import TetradError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps.protocol import (FOREVER_S, Kind, KeyLayout, Message, PSOptions,
                                         allocate, payload_spec, per_step_by_tag, receive,
                                         record_received, send)
from tetrad.sharded_tensors import CHECKPOINT_KINDS, Piece, whole_pieces


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
        self.layout = KeyLayout.from_model(model, options.num_servers)
        self.clock = 0
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

    # Talking to the servers ----------------------------------------------------------------

    @contextlib.contextmanager
    def _talking_to(self, server: int) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            raise TetradError(
                f"{self.roles.describe(server)} failed to answer ({str(error).splitlines()[0]}): "
                f"it holds the only copy of its key range, so training stops; restart from the "
                f"last checkpoint with --resume") from None

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
        def fresh(message: Message) -> list[torch.Tensor]:
            return allocate(payload_spec(message.kind, message.count, 0,
                                         self.layout.row_numel, 0))
        with self._talking_to(server):
            message = receive(self.collectives, self.world, server, buffers_for or fresh,
                              timeout_s or self.options.reply_timeout_s)
        if message.kind == Kind.DROPPED:
            raise TetradError(
                f"worker rank {self.rank} was silent for more than {self.options.heartbeat_s:.0f}"
                f" s and the scheduler dropped it; the other workers trained on without it")
        assert message.kind == kind, (message.kind, kind)
        record_received(self.received, message)
        return message

    def _index(self, server: int) -> int:
        return self.roles.server_index(server)

    def _dense(self, flat: torch.Tensor, server: int) -> torch.Tensor:
        lo, hi = self.layout.dense_range(self._index(server))
        return flat[lo:hi]

    def _rows_by_server(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Sorted row ids -> the ids each server owns (servers owning none left out)."""
        starts = [self.layout.row_range(self._index(s))[0] for s in self.servers]
        cuts = torch.searchsorted(ids, torch.tensor(starts[1:] + [self.layout.num_rows]))
        pieces = torch.tensor_split(ids, cuts[:-1].tolist())
        return {server: piece for server, piece in zip(self.servers, pieces) if piece.numel()}

    @torch.no_grad()
    def pull_rows(self, ids: torch.Tensor) -> None:
        """The rows `ids` (sorted) of the sparse table, from their servers; the push of this
        step carries exactly their gradients."""
        self.touched = ids
        wanted = self._rows_by_server(ids)
        self._post({s: Message(Kind.PULL_ROWS, self.rank, self.clock, len(piece),
                               payload=(piece,)) for s, piece in wanted.items()})
        for server, piece in wanted.items():
            rows = self._receive(server, Kind.ROWS).payload[0]
            self.embed.data.index_copy_(0, piece, rows)

    def push(self, lr: float) -> None:
        """This step's gradient, each server its range (and its touched rows); `lr` in async and
        ssp modes, where a push is an update."""
        wanted = self._rows_by_server(self.touched) if self.embed is not None else {}
        grad = self.embed.grad if self.embed is not None else None
        messages = {}
        for server in self.servers:
            payload = (self._dense(self.flat_grad, server),)
            piece = wanted.get(server)
            if piece is not None:
                payload += (piece, grad.index_select(0, piece))
            messages[server] = Message(Kind.PUSH, self.rank, self.clock,
                                       0 if piece is None else len(piece), (lr, 0.0), payload)
        self._post(messages)

    # The step ------------------------------------------------------------------------------

    def squared_norm(self) -> float:
        """Sync: the mean gradient's squared norm, each server's range summed."""
        return sum(self._receive(server, Kind.NORM).values[0] for server in self.servers)

    def step(self, lr: float, clip_scale: float) -> None:
        """Sync: STEP (lr, clip coefficient) to every server; async and ssp: push this worker's
        gradient with its lr. Then pull the fresh parameters (PARAMS) and start the next step."""
        if self.options.mode == "sync":
            self._post({s: Message(Kind.STEP, self.rank, self.clock, values=(lr, clip_scale))
                        for s in self.servers})
        else:
            self.push(lr)
        for server in self.servers:
            self._receive(server, Kind.PARAMS, lambda m, s=server: [self._dense(self.flat, s)])
        self.flat_grad.zero_()
        if self.embed is not None:
            self.embed.grad = None
        self.clock += 1
        self.sent.end_step()
        self.received.end_step()

    def mean(self, value: float) -> float:
        """The mean of `value` over the workers, by the scheduler (sync)."""
        scheduler = self.roles.scheduler
        self._post({scheduler: Message(Kind.METRIC, self.rank, self.clock, values=(value, 0.0))})
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
        self._post({s: Message(Kind.BYE, self.rank, self.clock) for s in self.servers})
        return report

    @torch.no_grad()
    def _pull_all(self) -> None:
        self._post({s: Message(Kind.PULL_ALL, self.rank, self.clock) for s in self.servers})
        for server in self.servers:
            tables = [self.embed.data] if self.embed is not None else []
            self._receive(server, Kind.ALL_PARAMS,
                          lambda m, s=server, t=tables: [self._dense(self.flat, s),
                                                         *self._table_rows(s, t)])

    def _table_rows(self, server: int, tables: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows `server` owns of each table; none when it owns no rows (nothing is sent)."""
        lo, hi = self.layout.row_range(self._index(server))
        return [table[lo:hi] for table in tables] if hi > lo else []

    def fetch_state(self) -> tuple[list[Piece], int]:
        """Every server's range and moments, as whole tensors (pieces of CHECKPOINT_KINDS), and
        the optimizer's step count."""
        dense = [torch.empty(self.layout.dense_numel) for _ in range(3)]
        tables = [torch.empty(self.layout.num_rows, self.layout.row_numel) for _ in range(3)]
        self._post({s: Message(Kind.SAVE, self.rank, self.clock) for s in self.servers})
        steps = []
        for server in self.servers:
            into = [self._dense(flat, server) for flat in dense] + self._table_rows(server, tables)
            steps.append(self._receive(server, Kind.STATE, lambda m, into=into: into).clock)
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
