"""Check that a schedule can be run by the one pipeline executor, before any rank starts.

Static checks name the first problem precisely; the blocking simulation then proves that the
order completes even when every send and receive blocks (cross-stage dependencies included: a
forward that runs before its input can arrive shows up there as a deadlock).
"""

from __future__ import annotations

from collections import Counter

from tetrad.schedules.actions import (Action, Schedule, ScheduleError, downstream, message,
                                      upstream)
from tetrad.schedules.simulate import simulate


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError on the first problem found."""
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{len(schedule.actions)} action lists for pp={schedule.pp} ranks")
    _check_computes(schedule)
    _check_communication(schedule)
    simulate(schedule, blocking=True)


def _check_computes(schedule: Schedule) -> None:
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    expected = Counter(Action(kind, stage, mb) for kind in kinds
                       for stage in range(schedule.num_stages)
                       for mb in range(schedule.microbatches))
    found: Counter[Action] = Counter()
    for rank, actions in enumerate(schedule.actions):
        position = {}
        for index, action in enumerate(actions):
            if not 0 <= action.stage < schedule.num_stages:
                raise ScheduleError(f"rank {rank}: {action} names a stage outside "
                                    f"0..{schedule.num_stages - 1}")
            if schedule.rank_of(action.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {action}, but stage {action.stage} "
                                    f"lives on rank {schedule.rank_of(action.stage)}")
            if action.is_compute:
                found[action] += 1
                position[action] = index
        # F before B before W on the same (stage, microbatch): B needs F's saved activations,
        # W the output gradient B received.
        for later, earlier in (("B", "F"), ("W", "B")):
            for action, index in position.items():
                if action.kind == later:
                    before = Action(earlier, action.stage, action.microbatch)
                    if position.get(before, len(actions)) > index:
                        raise ScheduleError(f"rank {rank}: {action} comes before {before}")
    missing, extra = expected - found, found - expected
    if missing or extra:
        problems = [f"missing {a}" for a in sorted(missing, key=str)[:3]]
        problems += [f"{'repeated' if a in expected else 'unexpected'} {a}"
                     for a in sorted(extra, key=str)[:3]]
        raise ScheduleError(f"schedule {schedule.name!r}: " + ", ".join(problems))


def _check_communication(schedule: Schedule) -> None:
    """Every tensor crossing ranks has one SEND after its producer and one RECV before its
    consumer, and both ends of a rank pair list their messages in the same order."""
    needed: dict[tuple, tuple[str, int]] = {}  # message -> (kind, rank) of each end required
    for rank, actions in enumerate(schedule.actions):
        for action in filter(lambda a: a.is_compute, actions):
            for neighbour, kind in ((downstream(action, schedule.num_stages), "SEND_"),
                                    (upstream(action, schedule.num_stages), "RECV_")):
                if neighbour is not None and schedule.rank_of(neighbour.stage) != rank:
                    end = Action(kind + action.kind, action.stage, action.microbatch,
                                 schedule.rank_of(neighbour.stage))
                    needed[(end.kind, message(end))] = (rank, end)
    per_pair: dict[tuple[int, int, str], list[tuple]] = {}
    for rank, actions in enumerate(schedule.actions):
        done = set()
        for action in actions:
            if action.is_compute:
                done.add(action)
                recv = _cross_rank_recv(schedule, rank, action)
                if recv is not None and (recv.kind, message(recv)) in needed:
                    raise ScheduleError(f"rank {rank}: {action} runs before {recv}")
                continue
            rank_and_end = needed.pop((action.kind, message(action)), None)
            if rank_and_end != (rank, action):
                raise ScheduleError(f"rank {rank}: {action} is not a needed send/receive "
                                    f"(repeated, wrong peer or stage, or a same-rank hand-off)")
            producer = Action(action.kind[-1], action.stage, action.microbatch)
            if action.kind.startswith("SEND") and producer not in done:
                raise ScheduleError(f"rank {rank}: {action} comes before {producer}")
            direction = "send" if action.kind.startswith("SEND") else "recv"
            pair = (rank, action.peer) if direction == "send" else (action.peer, rank)
            per_pair.setdefault((*pair, direction), []).append(message(action))
    if needed:
        rank, end = next(iter(needed.values()))
        raise ScheduleError(f"rank {rank} is missing {end}")
    for (sender, receiver, direction), order in per_pair.items():
        if direction == "send" and order != per_pair.get((sender, receiver, "recv")):
            raise ScheduleError(f"ranks {sender} -> {receiver} list their messages in different "
                                f"orders; send/recv pairs by order, so tensors would be swapped")


def _cross_rank_recv(schedule: Schedule, rank: int, action: Action) -> Action | None:
    source = upstream(action, schedule.num_stages)
    if source is None or schedule.rank_of(source.stage) == rank:
        return None
    return Action("RECV_" + action.kind, action.stage, action.microbatch,
                  schedule.rank_of(source.stage))
