"""A parameter server rank: it owns one key range (docs/parameter_server.md), fp32 parameters and
AdamW moments for it, applies the workers' pushes and answers their pulls. The first server is
also the scheduler: it tracks membership and clocks, holds back fast workers in ssp mode, and
ends the run.

One thread per peer receives that peer's messages in order (header, then the payload the header
implies) and queues them; the main thread handles them one at a time, so the state needs no lock
and only the main thread sends. Why a thread per peer rather than one receive from any source:
on gloo a receive from a specific peer fails at once when that peer's process dies (which is how
a dead worker is noticed), while a receive from any source never hears of it and cannot be
cancelled (a gloo wait that times out breaks the whole process group), and gloo's p2p work
objects cannot be polled (is_completed only turns true inside wait).

Modes: sync sums the pushes of every worker, sends each worker the squared norm of its range of
the mean gradient, waits for every worker's STEP (learning rate, clip coefficient: the same on
all, computed from the global norm) and applies one AdamW step: data-parallel SGD exactly.
async applies each push on arrival with the learning rate and clipping of the worker that made
it; ssp does the same, but the scheduler answers a push only while the worker stays within K
steps of the slowest live worker (clock.py).
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
                                         PSOptions, allocate, empty_entry, payload_spec,
                                         per_step_by_tag, receive, record_received, send)
from tetrad.parallel.ps.keys import OwnedKeys


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
        self.keys = OwnedKeys(model, param_groups, KeyLayout.from_model(model, options.num_servers),
                              self.index, betas, eps)
        self.received = CommCounter()
        self.workers = list(self.roles.workers)
        self.is_scheduler = self.rank == self.roles.scheduler
        self.book = Scheduler(self.workers, options.mode, options.staleness)
        self.inbox: queue.Queue = queue.Queue()
        self.updates = self.steps_seen = 0
        self.idle_s = 0.0
        self.started = time.perf_counter()
        self.pushed: set[int] = set()  # sync: workers whose push of this step arrived
        self.step_args: dict[int, tuple[float, float]] = {}  # sync: STEP values by worker
        self.metrics: dict[int, float] = {}  # sync: METRIC values of this round
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
        """Resume from a checkpoint of any layout (whole tensors by name, as ZeRO's)."""
        self.keys.load_state_dict(state)

    def bytes_held(self) -> dict[str, int]:
        return {**self.keys.bytes_held(), "activations_peak": 0}

    # The loop -------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker said goodbye (or died). Returns {"entry": this rank's
        run-report entry, "summary": the run summary (the scheduler's; None elsewhere)}."""
        peers = list(self.workers)
        if self.is_scheduler:
            peers += [s for s in self.roles.servers if s != self.rank]
        else:
            peers.append(self.roles.scheduler)
        for peer in peers:
            threading.Thread(target=self._listen, args=(peer,), daemon=True).start()
        self.started = time.perf_counter()
        handlers = {Kind.PUSH: self._on_push, Kind.STEP: self._on_step,
                    Kind.PULL_ROWS: self._on_pull_rows, Kind.METRIC: self._on_metric,
                    Kind.SAVE: self._on_save, Kind.DONE: self._on_done,
                    Kind.PULL_ALL: self._on_pull_all, Kind.BYE: self._on_bye,
                    Kind.FINISH: self._on_finish, Kind.SERVER_ENTRY: self._on_server_entry}
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
        return self.result

    def _listen(self, peer: int) -> None:
        def buffers_for(message: Message) -> list[torch.Tensor]:
            return allocate(payload_spec(message.kind, message.count,
                                         self.keys.grads[0].numel(), self.keys.layout.row_numel, 0))
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
        if worker not in self.book.dead:
            self._send(worker, message)

    def _tick(self, clock: int) -> None:
        """Per-step byte counts: one step per step of the fastest worker."""
        while self.steps_seen <= clock:
            self.steps_seen += 1
            self.comm.counter.end_step()
            self.received.end_step()

    # Training messages ----------------------------------------------------------------------

    def _accumulate(self, message: Message) -> None:
        self.keys.accumulate(*message.payload)

    def _apply(self, lr: float, scale: float) -> None:
        self.keys.apply(lr, scale)
        self.updates += 1

    def _params(self) -> Message:
        return Message(Kind.PARAMS, self.rank, payload=(self.keys.ranges[0].master,))

    def _on_push(self, message: Message) -> None:
        worker = message.sender
        self._tick(message.clock)
        if self.is_scheduler:
            self.book.push(worker, message.clock)
        self._accumulate(message)
        if self.options.mode == "sync":
            self.pushed.add(worker)
            if len(self.pushed) == len(self.workers):
                mean = 1.0 / len(self.workers)
                square = sum(float(g.mul_(mean).double().square().sum()) for g in self.keys.grads)
                for w in self.workers:
                    self._reply(w, Message(Kind.NORM, self.rank, values=(square, 0.0)))
            return
        self._apply(lr=message.values[0], scale=1.0)  # the worker clipped its own gradient
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
        self.step_args[message.sender] = message.values
        if len(self.step_args) < len(self.workers):
            return
        values = set(self.step_args.values())
        assert len(values) == 1, values  # every worker got the same norms and learning rate
        (lr, scale), = values
        self._apply(lr, scale)
        self.pushed.clear()
        self.step_args.clear()
        self.book.applied(self.workers)
        for worker in self.workers:
            self.book.may_start(worker)
            self._reply(worker, self._params())

    def _on_pull_rows(self, message: Message) -> None:
        rows = self.keys.rows(message.payload[0])
        self._reply(message.sender, Message(Kind.ROWS, self.rank, count=message.count,
                                            payload=(rows,)))

    def _on_metric(self, message: Message) -> None:
        self.metrics[message.sender] = message.values[0]
        if len(self.metrics) == len(self.workers):
            mean = sum(self.metrics[w] for w in self.workers) / len(self.workers)
            self.metrics.clear()
            for worker in self.workers:
                self._reply(worker, Message(Kind.METRIC, self.rank, values=(mean, 0.0)))

    def _on_save(self, message: Message) -> None:
        dense, table = self.keys.ranges
        self._reply(message.sender, Message(
            Kind.STATE, self.rank, clock=self.keys.optimizer.step_count,
            payload=(dense.master, dense.exp_avg, dense.exp_avg_sq,
                     *self.keys.tables(table.master, table.exp_avg, table.exp_avg_sq))))

    def _on_pull_all(self, message: Message) -> None:
        dense, table = self.keys.ranges
        self._reply(message.sender, Message(
            Kind.ALL_PARAMS, self.rank, payload=(dense.master, *self.keys.tables(table.master))))

    # Membership and the end of the run --------------------------------------------------------

    def _owes(self, worker: int) -> bool:
        """Whether the worker is waiting on this server (so its silence means nothing)."""
        return (worker in self.pushed or worker in self.step_args or worker in self.metrics
                or worker in self.book.held or worker in self.done)

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
            raise TetradError(f"{self.roles.describe(peer)} is gone ({error}): the job stops")
        if peer in self.book.dead or peer in self.byes:
            return
        if self.options.mode == "sync" and peer not in self.done:
            raise TetradError(
                f"worker rank {peer} is gone ({error}) and --ps-mode sync waits for every worker "
                f"at every step: the job stops (--ps-mode async or ssp trains on without it)")
        self.book.drop(peer)
        if self.is_scheduler:
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
        if not self.finish_sent:
            self.finish_sent = True
            for server in self.roles.servers:
                if server != self.rank:
                    self._send(server, Message.carrying(Kind.FINISH, self.rank,
                                                                  self.book.dead))
        if self.finished or len(self.server_entries) < self.roles.num_servers - 1:
            return
        self.finished = True
        entries = {rank: {**entry, "role": "worker"} for rank, entry in self.done.items()}
        for worker in self.book.dead:
            entries[worker] = {**empty_entry(worker, "worker"), "dead": True}
        entries.update(self.server_entries)
        entries[self.rank] = self._entry()
        summary = {**self.book.summary(), "num_servers": self.roles.num_servers}
        self.result = {"entry": entries[self.rank], "summary": summary}
        report = {"ranks": [entries[rank] for rank in range(self.world.size)],
                  "summary": summary}
        for worker in self.done:
            self._reply(worker, Message.carrying(Kind.FINISHED, self.rank, report))

    def _on_finish(self, message: Message) -> None:
        for worker in message.object():
            self.book.drop(worker)
        self.finish_sent = True
        self.result = {"entry": self._entry(), "summary": None}
        self._send(self.roles.scheduler,
                             Message.carrying(Kind.SERVER_ENTRY, self.rank, self.result["entry"]))

    def _on_server_entry(self, message: Message) -> None:
        self.server_entries[message.sender] = message.object()
        self._maybe_finish()

    def _on_bye(self, message: Message) -> None:
        self.byes.add(message.sender)

    def _entry(self) -> dict:
        entry = empty_entry(self.rank, "server")
        entry["server"] = self.index
        entry["bytes"] = self.bytes_held()
        entry["comm_bytes"].update(self.comm.counter.totals_per_step())
        entry["idle_fraction"] = self.idle_s / max(time.perf_counter() - self.started, 1e-9)
        entry["parameter_server"] = {"sent_per_step": per_step_by_tag(self.comm.counter),
                                     "received_per_step": per_step_by_tag(self.received),
                                     "updates_applied": self.updates}
        return entry
