"""A server's side of sync steps, gathered by slot rather than by worker rank, so that a slot can
change hands in the middle of a step and a run can grow (docs/parameter_server.md, "Joining a
running job").

Every step's global batch is cut into as many equal shares as the step has slots; each PUSH,
STEP and METRIC names its sender's slot and the step's number of slots. A server applies a step
once every slot's STEP is in and answers the worker that last spoke for each slot. When a worker
dies mid-step, a spare takes its slot and redoes the step from the slot's last applied
parameters. What the dead worker had delivered stays: the spare's copy of it is the same
computation on the same numbers, so it is not added twice. What a server had applied already is
answered from memory: the step's norm (`last_square`), the loss mean (`answered`), the
parameters.
"""

from __future__ import annotations

from tetrad.parallel.ps.protocol import HAS_NORM, Kind, Message
from tetrad.parallel.ps.standby import Served


class SyncSteps:
    """`server` is the ParameterServer these steps belong to (its book, replies and state)."""

    def __init__(self, server):
        self.server = server
        # Scheduler: METRIC rounds by (clock, round within the step): slot -> (worker, value).
        self.rounds: dict[tuple[int, int], dict[int, tuple[int, float]]] = {}
        self.answered: dict[tuple[int, int], float] = {}  # this step's means, for a redo
        self.parked: list[Message] = []  # PULL_ALLs for parameters of a step not applied yet

    def _norm(self, served: Served, square: float) -> Message:
        return Message(Kind.NORM, self.server.rank, values=(square, 0.0), key_range=served.index)

    def on_push(self, served: Served, message: Message) -> None:
        server = self.server
        if message.clock < served.applied:  # a redo of a step applied here: only its norm
            if not message.flags & HAS_NORM:
                server._reply(message.sender, self._norm(served, served.last_square))
            return
        self._heard(served, message)
        if not message.flags & HAS_NORM:
            served.want_norm.add(message.sender)
        if message.slot not in served.pushed:  # else the slot's dead worker delivered it
            if served.index == server.index and server.is_scheduler:
                # A spare admitted while its slot's step was being applied is on the step it
                # pushes, whichever way that race went.
                server.book.clocks[message.sender] = message.clock
                server.book.push(message.sender, message.clock)
            served.keys.accumulate(*message.payload)
            served.pushed.add(message.slot)
            if len(served.pushed) == message.workers:
                mean = 1.0 / message.workers
                served.square = sum(float(g.mul_(mean).double().square().sum())
                                    for g in served.keys.grads)
        if served.square is not None:
            for worker in sorted(served.want_norm):
                server._reply(worker, self._norm(served, served.square))
            served.want_norm.clear()

    def on_step(self, served: Served, message: Message) -> None:
        server = self.server
        if message.clock < served.applied:  # applied before its sender (or its server) died
            server._reply(message.sender, server._params(served))
            return
        self._heard(served, message)
        served.step_args.setdefault(message.slot, message.values)
        if len(served.step_args) < message.workers:
            return
        values = set(served.step_args.values())
        assert len(values) == 1, values  # every worker got the same norms and learning rate
        (lr, scale), = values
        replicated = server.standby.replicate(served, message.clock, lr, scale)
        served.last_square, served.square = served.square, None
        server._apply(served, lr, scale)
        served.pushed.clear()
        served.step_args.clear()
        served.recipients = sorted(set().union(*served.speakers.values()))
        served.speakers.clear()
        if served.index == server.index and server.is_scheduler:
            workers = [served.holders[slot] for slot in sorted(served.holders)]
            server.book.applied(workers)
            for worker in workers:
                server.book.may_start(worker)
            server.members.grow(served.applied)  # before its PARAMS name the next step's slots
        self.answer_parked()
        if not replicated:  # else once the standby has it (StandbyRole.on_replicated)
            self.send_params(served)

    @staticmethod
    def _heard(served: Served, message: Message) -> None:
        served.holders[message.slot] = message.sender
        served.speakers.setdefault(message.slot, set()).add(message.sender)

    def send_params(self, served: Served) -> None:
        for worker in served.recipients:
            self.server._reply(worker, self.server._params(served))

    def on_metric(self, message: Message) -> None:
        """Scheduler: the mean of a value over the step's slots, in slot order."""
        server, key = self.server, (message.clock, message.count)
        if key in self.answered:  # a spare redoing the step of the worker it replaces
            server._reply(message.sender, Message(Kind.METRIC, server.rank,
                                                  values=(self.answered[key], 0.0)))
            return
        values = self.rounds.setdefault(key, {})
        kept = values.get(message.slot, (message.sender, message.values[0]))[1]  # the first
        values[message.slot] = (message.sender, kept)  # answered: whoever spoke for it last
        if len(values) < message.workers:
            return
        mean = sum(values[slot][1] for slot in sorted(values)) / message.workers
        del self.rounds[key]
        self.answered = {k: v for k, v in self.answered.items() if k[0] >= message.clock}
        self.answered[key] = mean
        for slot in sorted(values):
            server._reply(values[slot][0], Message(Kind.METRIC, server.rank, values=(mean, 0.0)))

    def waits_for(self, worker: int) -> bool:
        """Whether `worker` waits for this server's answer (its silence is no hang)."""
        return (any(worker == w for values in self.rounds.values() for w, _ in values.values())
                or any(s.holders.get(slot) == worker for s in self.server.served.values()
                       for slot in (*s.pushed, *s.step_args)))

    def park(self, served: Served, message: Message) -> bool:
        """A PULL_ALL for the parameters of a step not applied here yet (a spare joining a
        growing run) is answered once it is applied."""
        if message.clock <= served.applied:
            return False
        self.parked.append(message)
        return True

    def answer_parked(self) -> None:
        parked, self.parked = self.parked, []
        for message in parked:
            self.server._on_pull_all(message)
