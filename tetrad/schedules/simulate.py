"""Run a schedule on paper: start and end of every compute, makespan, bubble, in-flight peaks.

Times are exact fractions (interleaved chunks take 1/vpp of a stage's time), so known results
such as (p-1)/(m+p-1) come out exactly. Communication takes no time. Two send semantics:

- asynchronous (the executor's rule, see docs/pipeline.md): SEND is an isend and RECV an irecv
  posted where it stands; the compute that needs the tensor waits for it. The timeline is then
  the ideal one, set by the dependencies alone.
- blocking: SEND and RECV both block until the other side reaches its matching action, as gloo's
  send/recv may (rendezvous). A schedule that completes here completes under any weaker rule;
  the validator runs this mode to prove a schedule free of deadlock.

A schedule without communication actions (a bare compute order, as the generators build it)
runs with tensors handed across ranks the moment they are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from tetrad.errors import ConfigError
from tetrad.schedules.actions import (COMPUTE_KINDS, Action, Schedule, ScheduleError,
                                      local_prerequisite, message, upstream)


@dataclass(frozen=True)
class Durations:
    """Time of one pass over a whole pipeline stage (all of a rank's layers); an interleaved
    chunk takes 1/vpp of it. Split backward parts default to half the backward each."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float | None = None
    backward_weight: float | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} duration must be > 0, got {value}")
        if self.backward_input is None and self.backward_weight is None:
            return
        if self.backward_input is None or self.backward_weight is None:
            given = self.backward_input or self.backward_weight
            if given >= self.backward:
                raise ConfigError(f"a split backward part of {given} leaves nothing of the "
                                  f"backward {self.backward} for the other: give both parts")

    def split(self) -> tuple[Fraction, Fraction]:
        """(backward-for-input, backward-for-weights) when the backward is split; a part not
        given is what the other leaves of `backward`."""
        backward = Fraction(self.backward)
        part_input = None if self.backward_input is None else Fraction(self.backward_input)
        part_weight = None if self.backward_weight is None else Fraction(self.backward_weight)
        if part_input is None and part_weight is None:
            return backward / 2, backward / 2
        if part_input is None:
            return backward - part_weight, part_weight
        if part_weight is None:
            return part_input, backward - part_input
        return part_input, part_weight

    def of(self, kind: str, schedule: Schedule) -> Fraction:
        if kind == "F":
            total = Fraction(self.forward)
        elif not schedule.split_backward:
            total = Fraction(self.backward)
        else:
            total = self.split()[0 if kind == "B" else 1]
        return total / schedule.vpp


@dataclass(frozen=True)
class ActionCosts:
    """Seconds of each action where stages differ (a last stage with the head and the loss, an
    uneven cut) and communication costs: `seconds[(kind, stage)]` for F, B, W (one stage's chunk,
    not a rank's pass) and "BW", the whole backward that a split schedule's B runs when its W
    comes next (`whole_backwards`); SEND_F, SEND_B, RECV_F, RECV_B occupy their rank (posting
    them), 0 when absent; a message arrives `transfer` after its send. Asynchronous mode only:
    measured from the executor (benchmarks/bench_pipeline.py) or modelled by a planner."""

    seconds: dict[tuple[str, int], float]
    transfer: float = 0.0

    def of(self, kind: str, stage: int) -> Fraction:
        if kind.startswith(("SEND", "RECV")):
            return Fraction(self.seconds.get((kind, stage), 0.0))
        if (kind, stage) not in self.seconds:
            raise ConfigError(f"no cost for {kind} of stage {stage}: give every compute's seconds")
        return Fraction(self.seconds[kind, stage])


@dataclass(frozen=True)
class Span:
    action: Action
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    spans: tuple[tuple[Span, ...], ...]  # spans[rank]: that rank's computes, in time order
    makespan: Fraction
    peak_in_flight: tuple[int, ...]

    @property
    def idle_time(self) -> Fraction:
        busy = sum((span.end - span.start for rank in self.spans for span in rank), Fraction(0))
        return self.schedule.pp * self.makespan - busy

    @property
    def bubble_fraction(self) -> float:
        return float(self.idle_time / (self.schedule.pp * self.makespan))

    def to_dict(self) -> dict:
        return {**self.schedule.to_dict(),
                "timeline": {str(rank): [{"kind": s.action.kind, "stage": s.action.stage,
                                          "microbatch": s.action.microbatch,
                                          "start": float(s.start), "end": float(s.end)}
                                         for s in spans]
                             for rank, spans in enumerate(self.spans)},
                "makespan": float(self.makespan), "bubble_fraction": self.bubble_fraction,
                "peak_in_flight": list(self.peak_in_flight)}


def peak_in_flight(schedule: Schedule, release: str = "B") -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) pairs whose forward ran and whose `release` action
    (B frees the activations a full backward needs; W frees what the weight gradient still
    needs) has not. Counts follow list order, so they do not depend on durations. With vpp > 1
    each pair holds one chunk, 1/vpp of the rank's layers."""
    peaks = []
    for rank_actions in schedule.actions:
        live = peak = 0
        for action in rank_actions:
            if action.kind == "F":
                live += 1
                peak = max(peak, live)
            elif action.kind == release:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def whole_backwards(schedule: Schedule) -> set[Action]:
    """The B's that the executor runs as the whole backward (one walk of the graph, W then only
    marking it done): those whose own W is the next compute on their rank (sends and receives
    aside), so nothing else can run between the two, except where the B's input gradient is
    sent before that W to a B on another rank that would wait for it: those split, so the
    gradient leaves a W earlier. Which do wait is read off the as-executed timeline (forward 1,
    backward 2), again after each round of splits, until none does."""
    if not schedule.split_backward:
        return set()
    whole, sent = set(), set()
    for actions in schedule.actions:
        pending, sent_first = None, False
        for action in actions:
            if action.is_compute:
                if pending is not None and action == Action("W", pending.stage,
                                                            pending.microbatch):
                    whole.add(pending)
                    if sent_first:
                        sent.add(pending)
                pending, sent_first = (action if action.kind == "B" else None), False
            elif (pending is not None and action.kind == "SEND_B"
                  and (action.stage, action.microbatch) == (pending.stage, pending.microbatch)):
                sent_first = True
    while sent:
        run = _Run(schedule, Durations(), False, True, whole=whole)
        run.go()
        spans = {span.action: (span, rank) for rank, rank_spans in enumerate(run.spans)
                 for span in rank_spans}
        previous_end = {span.action: before.end for rank_spans in run.spans
                        for before, span in zip(rank_spans, rank_spans[1:])}
        waited = set()
        for backward in sent:
            consumer = Action("B", backward.stage - 1, backward.microbatch)
            span = spans[consumer][0]
            if span.start == spans[backward][0].end and previous_end.get(consumer, 0) < span.start:
                waited.add(backward)
        if not waited:
            break
        whole -= waited
        sent -= waited
    return whole


def simulate(schedule: Schedule, durations: Durations = Durations(),
             blocking: bool = False, as_executed: bool = False,
             costs: ActionCosts | None = None) -> Timeline:
    """Time every compute; raise ScheduleError naming each rank's stuck action on deadlock.
    `as_executed`: as the executor runs a split schedule, each B of `whole_backwards` taking
    the whole backward (its input gradient leaves only then) and its W no time. `costs`, when
    given, replaces `durations` (asynchronous mode)."""
    if costs is not None and blocking:
        raise ConfigError("action costs time the asynchronous mode: drop blocking=True")
    if not blocking and not schedule.has_communication and costs is None:
        scale, spans = _scaled_compute_spans(
            schedule, durations, whole_backwards(schedule) if as_executed else set())
        if spans is not None:
            return Timeline(schedule, tuple(
                tuple(Span(action, Fraction(start, scale), Fraction(end, scale))
                      for action, start, end in rank_spans) for rank_spans in spans),
                Fraction(max((rank_spans[-1][2] for rank_spans in spans if rank_spans),
                             default=0), scale), peak_in_flight(schedule))
    run = _Run(schedule, durations, blocking, as_executed, costs)
    run.go()
    return Timeline(schedule, tuple(tuple(spans) for spans in run.spans),
                    max(run.clock, default=Fraction(0)), peak_in_flight(schedule))


def makespan(schedule: Schedule, durations: Durations = Durations()) -> Fraction:
    """simulate(schedule, durations).makespan, without timing each compute as a Fraction."""
    if schedule.has_communication:
        return simulate(schedule, durations).makespan
    scale, spans = _scaled_compute_spans(schedule, durations, set())
    if spans is None:
        return simulate(schedule, durations).makespan  # raises the deadlock's ScheduleError
    return Fraction(max((rank_spans[-1][2] for rank_spans in spans if rank_spans), default=0),
                    scale)


def _scaled_compute_spans(schedule: Schedule, durations: Durations, whole: set[Action]
                          ) -> tuple[int, list[list[tuple[Action, int, int]]] | None]:
    """_Run's asynchronous timeline of a compute-only schedule, with every duration scaled by
    the least common denominator so that the clocks are integers (exact, and many times faster
    than Fractions): (scale, per-rank (action, start, end)), or spans None on deadlock."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    exact = {kind: durations.of(kind, schedule) for kind in kinds}
    scale = math.lcm(*(value.denominator for value in exact.values()))
    units = {kind: int(value * scale) for kind, value in exact.items()}
    last_stage, microbatches = schedule.num_stages - 1, schedule.microbatches
    # End times per kind, at stage * microbatches + microbatch; None until the compute ran.
    ends = {kind: [None] * (schedule.num_stages * microbatches) for kind in COMPUTE_KINDS}
    forward_ends, backward_ends = ends["F"], ends["B"]
    spans: list[list[tuple[Action, int, int]]] = [[] for _ in range(schedule.pp)]
    pos, clock = [0] * schedule.pp, [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.actions):
            index, time, rank_spans = pos[rank], clock[rank], spans[rank]
            while index < len(actions):
                action = actions[index]
                kind, stage = action.kind, action.stage
                slot = stage * microbatches + action.microbatch
                if kind == "F":
                    inputs = (forward_ends[slot - microbatches] if stage else time,)
                elif kind == "B":
                    inputs = (forward_ends[slot], backward_ends[slot + microbatches]
                              if stage < last_stage else time)
                else:
                    inputs = (backward_ends[slot],)
                if None in inputs:
                    break
                duration = units[kind]
                if whole and (action in whole or kind == "W" and
                              Action("B", stage, action.microbatch) in whole):
                    duration = units["B"] + units["W"] if kind == "B" else 0
                start = max(time, *inputs)
                time = ends[kind][slot] = start + duration
                rank_spans.append((action, start, time))
                index += 1
            if index != pos[rank]:
                progress = True
            pos[rank], clock[rank] = index, time
    if any(index < len(actions) for index, actions in zip(pos, schedule.actions)):
        return scale, None
    return scale, spans


class _Run:
    def __init__(self, schedule: Schedule, durations: Durations, blocking: bool,
                 as_executed: bool, costs: ActionCosts | None = None,
                 whole: set[Action] | None = None) -> None:
        self.schedule, self.durations, self.blocking = schedule, durations, blocking
        self.costs = costs
        self.transfer = Fraction(costs.transfer) if costs else Fraction(0)
        # B's run as the whole backward, their W taking no time: `whole` when given.
        self.whole = (whole if whole is not None
                      else whole_backwards(schedule) if as_executed else set())
        self.with_comm = schedule.has_communication
        self.pos = [0] * schedule.pp
        self.clock = [Fraction(0)] * schedule.pp
        self.finished: dict[Action, Fraction] = {}  # compute -> end time
        self.arrived: dict[tuple, Fraction] = {}  # message -> when it reached the receiver
        self.posted: set[tuple] = set()  # messages whose RECV has been reached
        self.spans: list[list[Span]] = [[] for _ in range(schedule.pp)]

    def head(self, rank: int) -> Action | None:
        actions = self.schedule.actions[rank]
        return actions[self.pos[rank]] if self.pos[rank] < len(actions) else None

    def go(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in range(self.schedule.pp):
                while (action := self.head(rank)) is not None and self.step(rank, action):
                    progress = True
        stuck = [f"rank {rank} at {action}: {self.blocker(rank, action)}"
                 for rank in range(self.schedule.pp) if (action := self.head(rank))]
        if stuck:
            raise ScheduleError(f"schedule {self.schedule.name!r} deadlocks: " + "; ".join(stuck))

    def step(self, rank: int, action: Action) -> bool:
        """Run the rank's next action if it can run now; the rank's pointer moves past it."""
        if self.blocker(rank, action) is not None:
            return False
        if action.is_compute:
            start = max([self.clock[rank], *self.input_times(rank, action)])
            end = start + self.duration(action)
            self.spans[rank].append(Span(action, start, end))
            self.finished[action] = self.clock[rank] = end
        elif not self.blocking:
            if self.costs is not None:
                self.clock[rank] += self.costs.of(action.kind, action.stage)
            if action.kind.startswith("SEND"):
                self.arrived[message(action)] = self.clock[rank] + self.transfer
            else:
                self.posted.add(message(action))
        else:  # rendezvous: both sides leave at the later of their two clocks
            peer = action.peer
            self.clock[rank] = self.clock[peer] = max(self.clock[rank], self.clock[peer])
            self.arrived[message(action)] = self.clock[rank]
            self.posted.add(message(action))
            self.pos[peer] += 1
        self.pos[rank] += 1
        return True

    def duration(self, action: Action) -> Fraction:
        kind = action.kind
        if action.kind == "W" and Action("B", action.stage, action.microbatch) in self.whole:
            return Fraction(0)
        if action in self.whole:
            if self.costs is None:
                return (self.durations.of("B", self.schedule)
                        + self.durations.of("W", self.schedule))
            kind = "BW"
        if self.costs is None:
            return self.durations.of(kind, self.schedule)
        return self.costs.of(kind, action.stage)

    def blocker(self, rank: int, action: Action) -> str | None:
        """Why the action cannot run yet, or None when it can."""
        before = local_prerequisite(action)
        if before is not None and before not in self.finished:
            return f"needs {before} first"
        if action.is_compute:
            source = upstream(action, self.schedule.num_stages)
            if source is None or self.schedule.rank_of(source.stage) == rank:
                return None if source is None or source in self.finished else f"needs {source}"
            if not self.with_comm:
                return None if source in self.finished else f"needs {source}"
            key = message(Action("RECV_" + action.kind, action.stage, action.microbatch))
            if key not in self.posted:
                return "no RECV of its input was posted before it"
            return None if key in self.arrived else f"waits for {source}'s tensor"
        if not self.blocking:
            return None
        known_peer = action.peer is not None and 0 <= action.peer < self.schedule.pp
        peer_action = self.head(action.peer) if known_peer else None
        partner = None if peer_action is None or peer_action.is_compute else peer_action
        if (partner is None or message(partner) != message(action)
                or partner.kind[:4] == action.kind[:4] or partner.peer != rank):
            return (f"blocks until rank {action.peer} reaches the matching send/recv "
                    f"(it is at {peer_action})")
        sender = action if action.kind.startswith("SEND") else partner
        before = local_prerequisite(sender)
        return None if before in self.finished else f"the sender needs {before} first"

    def input_times(self, rank: int, action: Action) -> list[Fraction]:
        times = []
        before = local_prerequisite(action)
        if before is not None:
            times.append(self.finished[before])
        source = upstream(action, self.schedule.num_stages)
        if source is not None:
            if self.schedule.rank_of(source.stage) == rank:
                times.append(self.finished[source])
            elif self.with_comm:
                times.append(self.arrived[message(Action("RECV_" + action.kind, action.stage,
                                                         action.microbatch))])
            else:
                times.append(self.finished[source] + self.transfer)
        return times
