"""Place the sends and receives of a compute order so that blocking send/recv cannot deadlock.

Placing each send right after its compute and each receive right before its compute deadlocks
1F1B under blocking p2p: in the steady state rank r sends an activation to r+1 while r+1 sends
a gradient to r, and both wait forever for the other to receive. Megatron avoids this with
batched isend/irecv pairs; tetrad instead puts the messages in one global order:

1. time the compute order (any positive durations do; we use the defaults);
2. give every message the key (time its tensor is ready, sender, receiver, direction, stage,
   microbatch), the same key on both ends;
3. on each rank, merge computes (at their start) and messages (at their key), messages first on
   ties, so a send follows the compute that makes its tensor and a receive precedes the compute
   that needs it.

Each rank then meets its messages in increasing key order. Take the smallest message not yet
done: both its ends have finished every smaller message, and the computes before it on either
rank only need tensors from smaller messages, so both ends reach it and it completes; by
induction the whole schedule does. The argument holds for blocking send and recv; isend and
irecv only loosen the waits. Per pair of ranks, both ends also see their messages in the same
order, so plain FIFO matching (no tags) pairs every send with the right receive.
"""

from __future__ import annotations

from dataclasses import replace

from tetrad.schedules.actions import Action, Schedule, downstream
from tetrad.schedules.simulate import simulate


def add_communication(bare: Schedule) -> Schedule:
    """`bare` holds computes only; return it with SEND_* / RECV_* actions merged in."""
    timeline = simulate(bare)
    events: list[list[tuple[tuple, Action]]] = [[] for _ in range(bare.pp)]
    for rank, spans in enumerate(timeline.spans):
        for index, span in enumerate(spans):
            action = span.action
            events[rank].append(((span.start, 1, index), action))
            target = downstream(action, bare.num_stages)
            if target is None or bare.rank_of(target.stage) == rank:
                continue  # no consumer, or the consumer shares this rank's memory
            peer = bare.rank_of(target.stage)
            key = (span.end, 0, (span.end, rank, peer, action.kind, target.stage,
                                 action.microbatch))
            events[rank].append((key, Action("SEND_" + action.kind, action.stage,
                                             action.microbatch, peer)))
            events[peer].append((key, Action("RECV_" + action.kind, target.stage,
                                             action.microbatch, rank)))
    actions = tuple(tuple(action for _, action in sorted(rank_events, key=lambda e: e[0]))
                    for rank_events in events)
    return replace(bare, actions=actions)
