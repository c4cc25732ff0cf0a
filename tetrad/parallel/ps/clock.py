"""The scheduler's book: which workers are alive, each one's clock, the bounded-staleness gate,
and the staleness every push was applied with. Plain Python: the server calls it, the tests
drive it directly.

A worker's clock is the number of its pushes applied in this run (the step it is on). Two
staleness measures are recorded per push:

  gap     how many steps the pushing worker is ahead of the slowest live worker (clock minus the
          minimum live clock). This is what --ps-mode ssp bounds: a worker whose next step would
          put it more than K ahead is held (its parameters are not sent back) until the slowest
          catches up or is dropped, so no push is ever applied with a gap above K.
  lag     how many updates (from any worker) the server applied between the worker's last pull
          and this push: the staleness of the gradient in the sense of asynchronous SGD analyses
          (Ho et al., "More effective distributed ML via a stale synchronous parallel parameter
          server", 2013). In sync mode it is 0.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable


class Scheduler:
    def __init__(self, workers: Iterable[int], mode: str, staleness: int | None):
        self.mode, self.bound = mode, staleness
        self.clocks = {worker: 0 for worker in workers}
        self.dead: list[int] = []
        self.held: list[int] = []  # workers whose next step waits for the slowest (ssp)
        self.holds = 0
        self.version = 0  # updates applied
        self.pulled = dict.fromkeys(self.clocks, 0)  # version each worker last pulled
        self.gaps: Counter[int] = Counter()
        self.lags: Counter[int] = Counter()

    @property
    def live(self) -> list[int]:
        return [worker for worker in self.clocks if worker not in self.dead]

    def slowest(self) -> int:
        return min(self.clocks[worker] for worker in self.live)

    def push(self, worker: int, clock: int) -> int:
        """A push from `worker` for step `clock` arrived; returns its gap."""
        assert clock == self.clocks[worker], (worker, clock, self.clocks[worker])
        gap = clock - self.slowest()
        self.gaps[gap] += 1
        self.lags[self.version - self.pulled[worker]] += 1
        return gap

    def applied(self, workers: Iterable[int]) -> None:
        """One update made of these workers' pushes was applied (sync: all of them at once)."""
        self.version += 1
        for worker in workers:
            self.clocks[worker] += 1

    def may_start(self, worker: int) -> bool:
        """Whether `worker` may start its next step now; if not it is held (ssp)."""
        if self.mode != "ssp" or self.clocks[worker] - self.slowest() <= self.bound:
            self.pulled[worker] = self.version
            return True
        self.held.append(worker)
        self.holds += 1
        return False

    def release(self) -> list[int]:
        """Held workers that may start now, after the slowest advanced or was dropped."""
        ready = [worker for worker in self.held
                 if self.clocks[worker] - self.slowest() <= self.bound]
        self.held = [worker for worker in self.held if worker not in ready]
        for worker in ready:
            self.pulled[worker] = self.version
        return ready

    def admit(self, worker: int, clock: int) -> None:
        """A spare joins at `clock` (the slot's next step), with the parameters of now."""
        self.clocks[worker] = clock
        self.pulled[worker] = self.version

    def drop(self, worker: int) -> None:
        if worker not in self.dead:
            self.dead.append(worker)
        if worker in self.held:
            self.held.remove(worker)

    def summary(self) -> dict:
        pushes = sum(self.gaps.values())

        def stats(counts: Counter) -> dict:
            mean = sum(k * n for k, n in counts.items()) / pushes if pushes else 0.0
            return {"max": max(counts, default=0), "mean": mean,
                    "histogram": {str(k): counts[k] for k in sorted(counts)}}

        return {"mode": self.mode, "staleness_bound": self.bound,
                "num_workers": len(self.clocks), "dead_workers": sorted(self.dead),
                "num_dead_workers": len(self.dead), "updates_applied": self.version,
                "pushes": pushes, "clocks": {str(w): c for w, c in self.clocks.items()},
                "staleness": stats(self.gaps), "update_lag": stats(self.lags),
                "gate_holds": self.holds}
