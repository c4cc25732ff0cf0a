"""A parameter server rank: it owns one key range (docs/parameter_server.md), fp32 parameters and
AdamW moments for it, applies the workers' pushes and answers their pulls. The first server is
also the scheduler: it tracks membership and clocks, holds back fast workers in ssp mode, and
ends the run.

One thread per peer receives that peer's messages in order (header, then the payload the header
implies) and queues them; the main thread handles them one at a time, so the state needs no lock
and only the main thread sends. (Not one receive from any source: on gloo only a receive from a
specific peer fails when that peer dies; docs/parameter_server.md, "Receiving".)

Modes: sync sums the pushes of every worker, sends each worker the squared norm of its range of
the mean gradient, waits for every worker's STEP (learning rate, clip coefficient: the same on
all, computed from the global norm) and applies one AdamW step: data-parallel SGD exactly.
async applies each push on arrival with the learning rate and clipping of the worker that made
it; ssp does the same, but the scheduler answers a push only while the worker stays within K
steps of the slowest live worker (clock.py).

With --ps-replicas 1 (sync) each server's key range has a standby, the next server, which keeps
a replica: after applying an update the server sends it the update (the mean gradient, learning
rate and clip coefficient: the standby's AdamW step is the same arithmetic on the same numbers)
and answers the workers only once the standby has applied it. When a server dies its standby
serves the range too (standby.py has the range's state; the workers replay their step's messages
to it, docs/parameter_server.md). Spare workers joining in a dead worker's place or, in sync mode,
as new workers: membership.py; sync steps gathered by slot: sync.py.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from tetrad.errors import TetradError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps.clock import Scheduler
from tetrad.parallel.ps.protocol import (FOREVER_S, LAST_KINDS, Kind, KeyLayout, Message,
                                         PSOptions, allocate, payload_spec, receive,
                                         record_received, send)
from tetrad.parallel.ps.keys import OwnedKeys
from tetrad.parallel.ps.membership import Membership
from tetrad.parallel.ps.report import run_report, server_entry
from tetrad.parallel.ps.standby import Served, StandbyRole
from tetrad.parallel.ps.sync import SyncSteps


@dataclass
class Lost:
    """A peer's connection failed (its process died)."""
    peer: int
    error: str


class ParameterServer:
    def __init__(self, model: nn.Module, param_groups: list[dict], world: Group, comm: Comm,
                 options: PSOptions, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8):
        self.options, self.world, self.comm = options, world, comm
        self.rank = world.ranks[world.index]
        self.roles = options.roles(world.size)
        assert self.roles.is_server(self.rank), self.rank
        self.index = self.roles.server_index(self.rank)
        layout = KeyLayout.from_model(model, options.num_servers)
        self.keys = OwnedKeys(model, param_groups, layout, self.index, betas, eps)
        self.served = {self.index: Served(self.keys, self.index)}  # key ranges it answers for
        self.standby = StandbyRole(self, model, param_groups, layout, betas, eps)
        self.received = CommCounter()
        self.workers = list(self.roles.workers)
        self.is_scheduler = self.rank == self.roles.scheduler
        self.book = Scheduler(self.workers, options.mode, options.staleness)
        self.members = Membership(self)
        self.sync = SyncSteps(self)
        self.inbox: queue.Queue = queue.Queue()
        self.outgoing: list = []  # (worker, handle) of replies not yet known to be out
        self.updates = self.steps_seen = 0
        self.idle_s = 0.0
        self.started = time.perf_counter()
        self.done: dict[int, dict] = {}  # worker -> its run-report entry
        self.byes: set[int] = set()
        self.server_entries: dict[int, dict] = {}
        self.finish_sent = self.finished = False
        # Heartbeats start with a worker's first message: before it a worker may still be
        # tokenizing its corpus for minutes (a crash then is noticed anyway, by its socket).
        self.last_heard: dict[int, float] = {}
        self.result: dict = {}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint of any layout (whole tensors by name); the replica too."""
        self.keys.load_state_dict(state)
        if self.standby.replica is not None:
            self.standby.replica.keys.load_state_dict(state)

    def bytes_held(self) -> dict[str, int]:
        return {**self.keys.bytes_held(), "activations_peak": 0}

    # The loop -------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker said goodbye (or died). Returns {"entry": this rank's
        run-report entry, "summary": the run summary (the scheduler's; None elsewhere)}."""
        servers = ([s for s in self.roles.servers if s != self.rank] if self.is_scheduler
                   else [self.roles.scheduler])
        peers = [*self.workers, *self.roles.spares, *servers]
        peers += [p for p in self.standby.peers() if p not in peers]
        for peer in peers:
            threading.Thread(target=self._listen, args=(peer,), daemon=True).start()
        self.started = time.perf_counter()
        handlers = {Kind.PUSH: self._on_push, Kind.STEP: self._on_step,
                    Kind.PULL_ROWS: self._on_pull_rows, Kind.METRIC: self.sync.on_metric,
                    Kind.SAVE: self._on_save, Kind.DONE: self._on_done,
                    Kind.PULL_ALL: self._on_pull_all, Kind.BYE: self._on_bye,
                    Kind.FINISH: self._on_finish, Kind.SERVER_ENTRY: self._on_server_entry,
                    Kind.REPLICATE: self.standby.on_replicate,
                    Kind.REPLICATED: self.standby.on_replicated,
                    Kind.JOIN: self.members.on_join}
        self.next_check = time.monotonic() + self.options.heartbeat_s / 4
        while not self._complete():
            item = self._next()
            if item is None:
                continue
            if isinstance(item, Lost):
                self._on_lost(item.peer, item.error)
            elif item.sender not in self.book.dead:
                handlers[item.kind](item)
            elif self.is_scheduler and item.kind != Kind.BYE:
                # A hung worker came back after it was dropped: tell it, it is not readmitted.
                self._send(item.sender, Message(Kind.DROPPED, self.rank))
        self.drain()
        return self.result

    def _listen(self, peer: int) -> None:
        def buffers_for(message: Message) -> list[torch.Tensor]:
            keys = self.standby.keys_of(message)
            return allocate(payload_spec(message.kind, message.count, keys.grads[0].numel(),
                                         keys.layout.row_numel, keys.table_rows))
        while True:
            try:
                message = receive(self.comm, self.world, peer, buffers_for, FOREVER_S)
            except RuntimeError as error:
                self.inbox.put(Lost(peer, str(error).splitlines()[0]))
                return
            self.inbox.put(message)
            if message.kind in LAST_KINDS:
                return

    def _next(self) -> Message | Lost | None:
        """The next message (or lost peer); None when the scheduler's heartbeat check was due
        instead. Only the scheduler watches heartbeats: it alone decides membership."""
        timeout = None
        if self.is_scheduler:
            timeout = self.next_check - time.monotonic()
            if timeout <= 0:
                self.next_check = time.monotonic() + self.options.heartbeat_s / 4
                self._check_heartbeats()
                return None
        waited = time.perf_counter()
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        finally:
            self.idle_s += time.perf_counter() - waited
        if isinstance(item, Message):
            self.last_heard[item.sender] = time.monotonic()
            record_received(self.received, item)
        return item

    def _complete(self) -> bool:
        finished = self.finished if self.is_scheduler else self.finish_sent
        return finished and all(w in self.byes or w in self.book.dead for w in self.workers)

    def _send(self, peer: int, message: Message) -> None:
        """Send and wait until it is out; a peer that died meanwhile is handled as lost."""
        try:
            for handle in send(self.comm, self.world, peer, message):
                handle.wait(self.options.reply_timeout_s)
        except RuntimeError as error:
            self._on_lost(peer, str(error).splitlines()[0])

    def _reply(self, worker: int, message: Message) -> None:
        """Post a message to a worker and go on: waiting here could close a cycle (this server
        waits for a worker that waits for another server that waits for this one's standby
        duties). What it sends stays untouched until `_drain`, which every update calls first."""
        if worker in self.book.dead:
            return
        try:
            self.outgoing += [(worker, h) for h in send(self.comm, self.world, worker, message)]
        except RuntimeError as error:
            self._on_lost(worker, str(error).splitlines()[0])

    def drain(self) -> None:
        """Wait until every reply posted is out (a worker that died meanwhile is lost)."""
        outgoing, self.outgoing = self.outgoing, []
        for worker, handle in outgoing:
            try:
                handle.wait(self.options.reply_timeout_s)
            except RuntimeError as error:
                self._on_lost(worker, str(error).splitlines()[0])

    def _tick(self, clock: int) -> None:
        """Per-step byte counts: one step per step of the fastest worker."""
        while self.steps_seen <= clock:
            self.steps_seen += 1
            self.comm.counter.end_step()
            self.received.end_step()

    # Training messages ----------------------------------------------------------------------

    def _range(self, message: Message) -> Served:
        """The key range a worker's message is about (its own, or one this standby took over)."""
        index = self.index if message.key_range < 0 else message.key_range
        if index not in self.served:  # a worker saw the range's server die before we did
            self.standby.take_over()
        return self.served[index]

    def _apply(self, served: Served, lr: float, scale: float) -> None:
        self.drain()
        served.keys.apply(lr, scale)
        served.applied += 1
        self.updates += 1

    def _params(self, served: Served | None = None) -> Message:
        """A range's parameters; the scheduler's own also name the next step's slots (sync)."""
        served = served or self.served[self.index]
        slots = self.members.num_slots if self.is_scheduler and served.index == self.index else 0
        return Message(Kind.PARAMS, self.rank, payload=(served.keys.ranges[0].master,),
                       key_range=served.index, workers=slots)

    def _on_push(self, message: Message) -> None:
        worker, served = message.sender, self._range(message)
        if served.index == self.index:
            self._tick(message.clock)
        if self.options.mode == "sync":
            self.sync.on_push(served, message)
            return
        if served.index == self.index and self.is_scheduler:
            self.book.push(worker, message.clock)
        served.keys.accumulate(*message.payload)
        self._apply(served, lr=message.values[0], scale=1.0)  # the worker clipped its own
        if not self.is_scheduler:
            self._reply(worker, self._params())
            return
        self.book.applied([worker])
        if self.book.may_start(worker):
            self._reply(worker, self._params())
        self._release_held()

    def _release_held(self) -> None:
        for ready in self.book.release():
            self._reply(ready, self._params())

    def _on_step(self, message: Message) -> None:
        self.sync.on_step(self._range(message), message)

    def _on_pull_rows(self, message: Message) -> None:
        served = self._range(message)
        rows = served.keys.rows(message.payload[0])
        self._reply(message.sender, Message(Kind.ROWS, self.rank, count=message.count,
                                            payload=(rows,), key_range=served.index))

    def _on_save(self, message: Message) -> None:
        keys = self._range(message).keys
        dense, table = keys.ranges
        self._reply(message.sender, Message(
            Kind.STATE, self.rank, clock=keys.optimizer.step_count,
            payload=(dense.master, dense.exp_avg, dense.exp_avg_sq,
                     *keys.tables(table.master, table.exp_avg, table.exp_avg_sq)),
            key_range=keys.index))

    def _on_pull_all(self, message: Message) -> None:
        """Every parameter of the range and, in `clock`, the updates applied to it."""
        served = self._range(message)
        if self.options.mode == "sync" and self.sync.park(served, message):
            return
        keys = served.keys
        payload = (keys.ranges[0].master, *keys.tables(keys.ranges[1].master))
        self._reply(message.sender, Message(Kind.ALL_PARAMS, self.rank, served.applied,
                                            payload=payload, key_range=keys.index))

    # Membership and the end of the run --------------------------------------------------------

    def _owes(self, worker: int) -> bool:
        """Whether the worker is waiting on this server (so its silence means nothing)."""
        return (self.sync.waits_for(worker) or worker in self.book.held or worker in self.done)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for worker in self.book.live:
            silent = now - self.last_heard.get(worker, now)
            if self._owes(worker) or worker in self.byes or silent <= self.options.heartbeat_s:
                continue
            self._on_lost(worker, f"silent for {silent:.0f} s (heartbeat timeout "
                                  f"{self.options.heartbeat_s:.0f} s)")

    def _on_lost(self, peer: int, error: str) -> None:
        if self.roles.is_server(peer):
            if not self.standby.server_lost(peer):
                raise TetradError(f"{self.roles.describe(peer)} is gone ({error}): the job stops")
            if self.is_scheduler:
                self._maybe_finish()
            return
        if peer not in self.workers:  # a spare not admitted (yet, or here: at FINISH)
            self.members.spare_lost(peer)
            return
        if peer in self.book.dead or peer in self.byes:
            return
        if self.options.mode == "sync" and peer not in self.done and not self.options.spares:
            raise TetradError(
                f"worker rank {peer} is gone ({error}) and --ps-mode sync waits for every worker "
                f"at every step: the job stops (--ps-spares would take its place; --ps-mode "
                f"async or ssp trains on without it)")
        self.book.drop(peer)
        if self.is_scheduler:
            if peer not in self.done:
                self.members.vacate(peer)
            self._release_held()
            self._maybe_finish()

    def _on_done(self, message: Message) -> None:
        self.done[message.sender] = message.object()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        """Scheduler: once every worker is done or dead, collect the servers' entries, then
        send every live worker the report and the summary."""
        if not all(w in self.done or w in self.book.dead for w in self.workers):
            return
        live_servers = [s for s in self.roles.servers
                        if s != self.rank and s not in self.standby.dead_servers]
        if not self.finish_sent:
            self.finish_sent = True
            for server in live_servers:
                self._send(server, Message.carrying(Kind.FINISH, self.rank,
                                                    (self.workers, self.book.dead)))
            self.members.dismiss()
        if self.finished or any(s not in self.server_entries for s in live_servers):
            return
        self.finished = True
        report = run_report(self)
        self.result = {"entry": report["ranks"][self.rank], "summary": report["summary"]}
        for worker in self.done:
            self._reply(worker, Message.carrying(Kind.FINISHED, self.rank, report))

    def _on_finish(self, message: Message) -> None:
        self.workers, dead = message.object()  # with the spares that joined
        for worker in dead:
            self.book.drop(worker)
        self.finish_sent = True
        self.result = {"entry": server_entry(self), "summary": None}
        self._send(self.roles.scheduler,
                   Message.carrying(Kind.SERVER_ENTRY, self.rank, self.result["entry"]))

    def _on_server_entry(self, message: Message) -> None:
        self.server_entries[message.sender] = message.object()
        self._maybe_finish()

    def _on_bye(self, message: Message) -> None:
        self.byes.add(message.sender)
