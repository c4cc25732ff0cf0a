"""Spare workers (--ps-spares, async and ssp modes): the scheduler's side of a worker joining a
running job in a dead worker's place (docs/parameter_server.md, "Joining a running job").

The process group's world is fixed when the job starts (gloo's point-to-point sends need every
rank in it), so a worker cannot appear from nowhere: spare worker ranks start with the job, ask
the scheduler to JOIN and wait. When the scheduler drops a worker that had not finished (its
process died, or it fell silent past the heartbeat), its slot falls vacant; the first waiting
spare is ADMITted to it at once with the slot's clock (the dropped worker's applied pushes). The
spare pulls the servers' current parameters (every row) and trains on from that step with the
slot's slice of each global batch. Spares still waiting when the run ends are told they were not
needed.
"""

from __future__ import annotations

from tetrad.parallel.ps.protocol import Kind, Message

NOT_NEEDED = -1  # ADMIT's slot when the run ended without a vacancy for the spare


class Membership:
    """`server` is the scheduler (a ParameterServer): its book, worker list and replies."""

    def __init__(self, server):
        self.server = server
        self.slot_of = {worker: worker for worker in server.workers}
        self.vacant: list[tuple[int, int]] = []  # (slot, clock) of workers dropped unfinished
        self.waiting: list[int] = []  # spares that asked to join, in the order they asked
        self.joined: dict[int, int] = {}  # spare -> the slot it took

    def on_join(self, message: Message) -> None:
        self.waiting.append(message.sender)
        self._fill()

    def vacate(self, worker: int) -> None:
        """`worker` was dropped before it was done: a spare takes its slot from its clock on."""
        self.vacant.append((self.slot_of[worker], self.server.book.clocks[worker]))
        self._fill()

    def spare_lost(self, spare: int) -> None:
        if spare in self.waiting:
            self.waiting.remove(spare)

    def _fill(self) -> None:
        server = self.server
        while self.vacant and self.waiting and not server.finish_sent:
            (slot, clock), spare = self.vacant.pop(0), self.waiting.pop(0)
            server.workers.append(spare)
            server.book.admit(spare, clock)
            self.slot_of[spare] = self.joined[spare] = slot
            server._reply(spare, Message(Kind.ADMIT, server.rank, clock=clock, count=slot))

    def dismiss(self) -> None:
        """The run ended: the spares still waiting go home."""
        for spare in self.waiting:
            self.server._reply(spare, Message(Kind.ADMIT, self.server.rank, count=NOT_NEEDED))
        self.waiting.clear()
