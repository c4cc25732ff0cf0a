"""A server's standby duties under --ps-replicas 1 (docs/parameter_server.md, "Failures"): the
replica of the previous server's key range, kept equal to it update by update, and what happens
when a server dies.

Server i's standby is server i+1 (mod S). After applying a sync step, server i sends its standby
the update (REPLICATE: the mean gradient of its range before clipping, the learning rate, the
clip coefficient); the standby runs the same AdamW step on its replica (the same arithmetic on the
same numbers, so the replica equals the range bit for bit) and answers REPLICATED; only then does
server i send the workers their parameters. So whenever a worker holds the parameters of step t,
the replica has step t too.

When server i dies the standby serves range i beside its own. The workers replay to it what they
had sent i in the unfinished step (tetrad.parallel.ps.worker); `Served.applied` tells the standby
whether the replica already has that step (then it answers at once) or must gather it from the
replays. The scheduler is not replicated: its death still stops the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from tetrad.parallel.ps.keys import OwnedKeys
from tetrad.parallel.ps.protocol import Kind, KeyLayout, Message, nbytes


@dataclass
class Served:
    """A key range a server answers for, and the sync step it is gathering."""

    keys: OwnedKeys
    index: int  # the server index that owns the range
    applied: int = 0  # updates applied: the clock of the step being gathered
    pushed: set[int] = field(default_factory=set)  # slots whose push of this step arrived
    want_norm: set[int] = field(default_factory=set)  # workers still waiting for its NORM
    step_args: dict[int, tuple[float, float]] = field(default_factory=dict)  # slot: STEP values
    holders: dict[int, int] = field(default_factory=dict)  # slot -> the worker that last spoke
    # Slot -> every worker that spoke for it in this step (a dead one and its replacement, or a
    # dropped one that woke up): each gets the parameters, the stale one does not read them.
    speakers: dict[int, set[int]] = field(default_factory=dict)
    recipients: list[int] = field(default_factory=list)  # the applied step's speakers
    square: float | None = None  # this step's squared norm of the mean gradient, once known
    last_square: float = 0.0  # the applied step's (a replacement redoing it asks again)


class StandbyRole:
    """`server` is the ParameterServer it belongs to (whose replies and state it shares)."""

    def __init__(self, server, model: nn.Module, param_groups: list[dict],
                 layout: KeyLayout, betas: tuple[float, float], eps: float):
        self.server, self.roles = server, server.roles
        self.enabled = server.options.replicas > 0
        self.dead_servers: set[int] = set()
        self.awaiting: list[Served] = []  # updates sent to the standby, not yet confirmed
        self.replica: Served | None = None
        if self.enabled:
            index = server.index
            self.primary = self.roles.server_rank(index - 1)  # whose range this one keeps
            self.standby = self.roles.standby(index)
            replica_index = self.roles.server_index(self.primary)
            self.replica = Served(OwnedKeys(model, param_groups, layout, replica_index, betas,
                                            eps), replica_index)

    def peers(self) -> list[int]:
        """Servers this one hears from as a standby or as a standby's server."""
        return [self.standby, self.primary] if self.enabled else []

    def keys_of(self, message: Message) -> OwnedKeys:
        """The keys whose shapes a message's payload has (called by the receiving threads)."""
        if self.replica is not None and message.key_range == self.replica.index:
            return self.replica.keys
        return self.server.keys

    def take_over(self) -> None:
        """Serve the replica's range from now on (its server died)."""
        self.server.served.setdefault(self.replica.index, self.replica)

    # The replication stream ------------------------------------------------------------------

    def replicate(self, served: Served, clock: int, lr: float, scale: float) -> bool:
        """Before `served` applies step `clock`: send the update to the standby. True when the
        workers must wait for its REPLICATED (the standby is alive and got it)."""
        if not self.enabled or served.index != self.server.index \
                or self.standby in self.dead_servers:
            return False
        payload = (served.keys.grads[0], *served.keys.grads[1:2] * bool(served.keys.table_rows))
        self.server._send(self.standby, Message(Kind.REPLICATE, self.server.rank, clock,
                                                values=(lr, scale), payload=payload,
                                                key_range=served.index))
        if self.standby in self.dead_servers:  # it died while we sent
            return False
        self.awaiting.append(served)
        return True

    def on_replicate(self, message: Message) -> None:
        replica = self.replica
        if message.clock < replica.applied:  # the replays made this step already
            return
        for grad, received in zip(replica.keys.grads, message.payload):
            grad.copy_(received)
        lr, scale = message.values
        replica.last_square = sum(float(g.double().square().sum()) for g in replica.keys.grads)
        replica.keys.apply(lr, scale)
        replica.applied += 1
        # Replays that arrived before the update (the workers saw the death first) are answered.
        for worker in sorted(set().union(*(replica.speakers[s] for s in replica.step_args))):
            self.server._reply(worker, self.server._params(replica))
        replica.speakers.clear()
        replica.pushed.clear()
        replica.want_norm.clear()
        replica.step_args.clear()
        replica.square = None
        if self.primary not in self.dead_servers:
            self.server._send(self.primary, Message(Kind.REPLICATED, self.server.rank,
                                                    message.clock, key_range=replica.index))

    def on_replicated(self, message: Message) -> None:
        self.server.sync.send_params(self.awaiting.pop(0))

    # Failures ---------------------------------------------------------------------------------

    def server_lost(self, peer: int) -> bool:
        """A server's connection failed. True when the job goes on without it: its range has a
        live standby and it was not the scheduler."""
        if not self.enabled or peer == self.roles.scheduler \
                or self.roles.standby(self.roles.server_index(peer)) in self.dead_servers:
            return False
        self.dead_servers.add(peer)
        if peer == self.primary:
            self.take_over()
        if peer == self.standby:  # the workers need not wait for a replica that is gone
            while self.awaiting:
                self.server.sync.send_params(self.awaiting.pop(0))
        return True

    def bytes_held(self) -> int:
        if self.replica is None:
            return 0
        keys = self.replica.keys
        return sum(nbytes(r.master) + nbytes(r.exp_avg) + nbytes(r.exp_avg_sq)
                   for r in keys.ranges) + sum(nbytes(g) for g in keys.grads)
