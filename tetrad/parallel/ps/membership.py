"""Spare workers (--ps-spares): the scheduler's side of a worker joining a running job in a dead
worker's place, or in sync mode from a join step on as a new worker (docs/parameter_server.md,
"Joining a running job").

The process group's world is fixed when the job starts (gloo's point-to-point sends need every
rank in it), so a worker cannot appear from nowhere: spare worker ranks start with the job, ask
the scheduler to JOIN and wait. When the scheduler drops a worker that had not finished (its
process died, or it fell silent past the heartbeat), its slot falls vacant; the first waiting
spare is ADMITted to it at once with the slot's clock (the dropped worker's applied pushes). The
spare pulls the servers' current parameters (every row) and trains on from that step with the
slot's slice of each global batch. Spares still waiting when the run ends are told they were not
needed.

In sync mode a slot stops every step while it is vacant, so a vacancy with no spare left to take
it stops the job. With a join step, the spares waiting when the scheduler applies the step before
it (or, for a later one, before the next step after it asked) join as new slots: every step's
global batch is then cut into more, smaller shares (sync.py).
"""

from __future__ import annotations

from tetrad.errors import TetradError
from tetrad.parallel.ps.protocol import NEW_SLOT, Kind, Message

NOT_NEEDED = -1  # ADMIT's slot when the run ended without a vacancy for the spare


class Membership:
    """`server` is the scheduler (a ParameterServer): its book, worker list and replies."""

    def __init__(self, server):
        self.server = server
        self.slot_of = {worker: worker for worker in server.workers}
        self.vacant: list[tuple[int, int]] = []  # (slot, clock) of workers dropped unfinished
        self.waiting: list[int] = []  # spares that asked to join, in the order they asked
        self.joined: dict[int, int] = {}  # spare -> the slot it took
        self.lost: set[int] = set()  # spares that died before they were admitted
        self.num_slots = len(server.workers)  # sync: the shares of each global batch

    def on_join(self, message: Message) -> None:
        self.waiting.append(message.sender)
        self._fill()

    def vacate(self, worker: int) -> None:
        """`worker` was dropped before it was done: a spare takes its slot from its clock on."""
        self.vacant.append((self.slot_of[worker], self.server.book.clocks[worker]))
        self._fill()
        self._check_replaceable()

    def spare_lost(self, spare: int) -> None:
        if spare in self.waiting:
            self.waiting.remove(spare)
        self.lost.add(spare)
        self._check_replaceable()

    def _check_replaceable(self) -> None:
        """Sync: every step waits for every slot, so a vacant slot no spare can take any more
        stops the job."""
        server = self.server
        if server.options.mode != "sync" or not self.vacant or server.finish_sent:
            return
        if not set(server.roles.spares) - set(self.joined) - self.lost:
            raise TetradError(
                f"worker slot {self.vacant[0][0]} lost its worker and no spare is left to take "
                f"it: --ps-mode sync waits for every slot at every step, so the job stops; "
                f"restart from the last checkpoint with --resume")

    def _fill(self) -> None:
        while self.vacant and self.waiting and not self.server.finish_sent:
            (slot, clock), spare = self.vacant.pop(0), self.waiting.pop(0)
            self._admit(spare, slot, clock)

    def grow(self, clock: int) -> None:
        """Sync, the scheduler applied step clock - 1: from the join step on, the spares waiting
        join as new slots at step `clock` (the next step)."""
        join = self.server.options.join_step
        if join is None or clock < join or not self.waiting or self.server.finish_sent:
            return
        joining, self.waiting = self.waiting, []
        first = self.num_slots
        self.num_slots += len(joining)
        for slot, spare in enumerate(joining, first):
            self._admit(spare, slot, clock, NEW_SLOT)

    def _admit(self, spare: int, slot: int, clock: int, flags: int = 0) -> None:
        server = self.server
        server.workers.append(spare)
        server.book.admit(spare, clock)
        self.slot_of[spare] = self.joined[spare] = slot
        server._reply(spare, Message(Kind.ADMIT, server.rank, clock=clock, count=slot,
                                     flags=flags, workers=self.num_slots))

    def dismiss(self) -> None:
        """The run ended: the spares still waiting go home."""
        for spare in self.waiting:
            self.server._reply(spare, Message(Kind.ADMIT, self.server.rank, count=NOT_NEEDED))
        self.waiting.clear()
