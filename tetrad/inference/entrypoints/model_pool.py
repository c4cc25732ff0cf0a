"""The model set of a server of many models (`tetrad serve` with no model, or several), as Ollama
keeps them: a request for a model not loaded loads it, within a memory budget; a model stays
loaded for its keep_alive after its last request ends, then unloads.

Loading reads weights and starts ranks: it runs on a thread, so the event loop and the models
already loaded keep serving; requests for a model being loaded wait for that one load. A model's
size is what its engine holds, counted once loaded (served.engine_bytes: weights and KV pools);
before a first load the catalog's estimate stands in for it. To make room, the least recently
used idle models unload first (idle: no request holds it, none waits for it); a model that still
does not fit is refused with a 503: for good when it alone is over the budget, with Retry-After
when the models in use hold the rest.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tetrad.inference.entrypoints.api import ApiError, ServerConfig
from tetrad.inference.entrypoints.model_pool_catalog import ModelCatalog
from tetrad.inference.entrypoints.served import ServedModel, lease, parse_keep_alive

def mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


class ModelPool:
    def __init__(self, catalog: ModelCatalog, config: ServerConfig, budget_bytes: int,
                 keep_alive: float | str,
                 log: Callable[[str], None] | None = None):
        """budget_bytes: what loaded models may hold together (--max-loaded-memory);
        keep_alive: the default of requests that bring none (--keep-alive)."""
        self.catalog, self.config, self.budget_bytes = catalog, config, budget_bytes
        self.keep_alive_s = parse_keep_alive(keep_alive)
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.models: dict[str, ServedModel] = {}
        self.loading: dict[str, asyncio.Future] = {}
        self.waiting: dict[str, int] = {}  # requests waiting for a model's load
        self.counted: dict[str, int] = {}  # sizes counted at earlier loads: the next estimate
        self.reserved = 0  # what loads under way were given room for
        self.under_way = 0  # loads given room and not finished
        # torch.distributed has one default process group per process, which a multi-rank
        # engine owns (ranks/driver.py): one such engine loaded at a time.
        self.max_loaded = 1 if catalog.world_size > 1 else None
        self.unloading_bytes = 0  # models closing: their memory is not free yet
        self.admission = asyncio.Lock()  # one decision on room at a time
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.unloads: set[asyncio.Task] = set()
        self.threads = ThreadPoolExecutor(thread_name_prefix="tetrad-model-load")
        self.built: dict[int, ServedModel] = {}  # every model built and not closed, by id
        self.guard = threading.Lock()  # `built` and `closed`, shared with the load threads
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- the model set's interface (served.py) -------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()

    def loaded(self) -> list[ServedModel]:
        return list(self.models.values())

    def available(self) -> list[str]:
        return self.catalog.names()

    async def acquire(self, name: str | None, keep_alive: float | str | None = None
                      ) -> ServedModel:
        """The loaded model `name`, loading it first when it is not; held by the current request
        until it ends (served.lease). keep_alive: this request's, else the server's default."""
        keep = self.keep_alive_s if keep_alive is None else parse_keep_alive(keep_alive)
        if self.closed:
            raise ApiError(503, "the server is shutting down", "server_error")
        name = self.catalog.resolve(name)
        served = self.models.get(name)
        if served is None:
            self.waiting[name] = self.waiting.get(name, 0) + 1
            try:
                if name not in self.loading:
                    self.loading[name] = asyncio.ensure_future(self._load(name))
                served = await asyncio.shield(self.loading[name])
            finally:
                self.waiting[name] -= 1
                if not self.waiting[name]:
                    del self.waiting[name]
        lease(self, served)  # first: outside a request it raises, and nothing holds the model
        served.pins += 1
        served.keep_alive_s = keep
        served.expires_at = None if keep == math.inf else time.time() + keep
        if (timer := self.timers.pop(name, None)) is not None:
            timer.cancel()
        return served

    def release(self, served: ServedModel) -> None:
        """A request that held `served` ended: its keep_alive starts once none holds it."""
        served.pins -= 1
        served.last_used = time.monotonic()
        if served.pins == 0 and self.models.get(served.name) is served:
            self._keep(served)

    def close(self) -> None:
        """Unload everything, loads under way included (they finish first), and stop the load
        threads."""
        with self.guard:
            self.closed = True
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        self.threads.shutdown(wait=True)
        with self.guard:
            leftover = list(self.built.values())
            self.built.clear()
        self.models.clear()
        for served in leftover:
            shut(served)

    # ---- loading -------------------------------------------------------------------------------

    async def _load(self, name: str) -> ServedModel:
        try:
            exact = name in self.counted
            needed = self.counted[name] if exact else self.catalog.estimate_bytes(name)
            async with self.admission:
                if exact:
                    self._check_alone(name, needed)
                # An estimate is only that: past what idle models free, the count decides.
                if not await self._make_room(needed) and (exact or
                                                          not self._room_for_one_more()):
                    raise self._no_room(name, needed)
                self.reserved += needed
                self.under_way += 1
            try:
                served = await self.loop.run_in_executor(self.threads, self._build, name)
            finally:
                self.reserved -= needed
                self.under_way -= 1
            self.counted[name] = served.size_bytes
            async with self.admission:
                try:
                    self._check_alone(name, served.size_bytes)
                    if not await self._make_room(served.size_bytes):
                        raise self._no_room(name, served.size_bytes)
                except ApiError:
                    await self.loop.run_in_executor(self.threads, self._close_now, served)
                    raise
                served.start()
                served.last_used = time.monotonic()
                self.models[name] = served
            self.log(f"loaded {name}: {mib(served.size_bytes)} (weights and KV cache); "
                     f"{mib(self._used())} of {mib(self.budget_bytes)} in use")
            if not self.waiting.get(name):  # every request for it left while it loaded
                served.keep_alive_s = self.keep_alive_s
                self._keep(served)
            return served
        finally:
            self.loading.pop(name, None)

    def _build(self, name: str) -> ServedModel:
        """On a load thread: the engine, and the model around it (not started)."""
        llm, chat, defaults = self.catalog.load(name)
        try:
            served = ServedModel.build(llm, name, self.config, chat, defaults,
                                       on_fatal=lambda: self._stopped(name))
        except BaseException:
            llm.close()
            raise
        with self.guard:
            if not self.closed:
                self.built[id(served)] = served
                return served
        shut(served)
        raise ApiError(503, "the server is shutting down", "server_error")

    def _check_alone(self, name: str, size: int) -> None:
        if size > self.budget_bytes:
            raise ApiError(503, f"model {name} takes {mib(size)} (weights and KV cache, counted "
                                f"when it loaded): more than the {mib(self.budget_bytes)} loaded "
                                f"models may hold (tetrad serve --max-loaded-memory; a smaller "
                                f"--kv-memory shrinks its KV cache)", "server_error")

    def _no_room(self, name: str, size: int) -> ApiError:
        if self.max_loaded is not None and not self._room_for_one_more():
            return ApiError(503, f"model {name} waits for the loaded model's requests to end: "
                                 f"a server of multi-rank engines (--tp, --pp, --dp) holds one "
                                 f"model at a time (torch.distributed has one process group per "
                                 f"process); retry", "server_error", {"Retry-After": "1"})
        busy = sum(served.size_bytes for served in self.models.values() if not self._idle(served))
        return ApiError(503, f"model {name} takes {mib(size)}; the models in use hold "
                             f"{mib(busy)} of the {mib(self.budget_bytes)} loaded models may "
                             f"hold (tetrad serve --max-loaded-memory): retry when they are "
                             f"done", "server_error", {"Retry-After": "1"})

    # ---- room and unloading --------------------------------------------------------------------

    def _used(self) -> int:
        return (sum(served.size_bytes for served in self.models.values()) + self.reserved
                + self.unloading_bytes)

    def _room_for_one_more(self) -> bool:
        return self.max_loaded is None or len(self.models) + self.under_way < self.max_loaded

    def _idle(self, served: ServedModel) -> bool:
        return served.pins == 0 and not self.waiting.get(served.name)

    async def _make_room(self, size: int) -> bool:
        """Unload the least recently used idle models until `size` more fits; False when the
        models in use leave too little."""
        while self._used() + size > self.budget_bytes or not self._room_for_one_more():
            if self.unloads:  # a model closing frees its memory when it is closed
                await asyncio.wait(set(self.unloads))
                continue
            idle = [served for served in self.models.values() if self._idle(served)]
            if not idle:
                return False
            victim = min(idle, key=lambda served: served.last_used)
            self.log(f"unloading {victim.name} ({mib(victim.size_bytes)}, idle) to make room")
            await self._unload(victim)
        return True

    def _keep(self, served: ServedModel) -> None:
        """An idle model's expiry: after its keep_alive, at once for 0, never for a negative."""
        keep = served.keep_alive_s
        served.expires_at = None if keep == math.inf else time.time() + keep
        if keep != math.inf:
            self.timers[served.name] = self.loop.call_later(keep, self._expire, served)

    def _expire(self, served: ServedModel) -> None:
        self.timers.pop(served.name, None)
        if self._idle(served) and self.models.get(served.name) is served:
            self.log(f"unloading {served.name}: its keep_alive ran out")
            self._unload_soon(served)

    def _stopped(self, name: str) -> None:
        """On the engine thread: the model's engine can no longer step. It unloads; the next
        request for it loads it again."""
        def unload() -> None:
            served = self.models.get(name)
            if served is not None and served.health() is not None:
                self._unload_soon(served)
        self.loop.call_soon_threadsafe(unload)

    def _unload_soon(self, served: ServedModel) -> None:
        task = asyncio.ensure_future(self._unload(served))
        self.unloads.add(task)
        task.add_done_callback(self.unloads.discard)

    async def _unload(self, served: ServedModel) -> None:
        if self.models.get(served.name) is not served:
            return
        del self.models[served.name]
        if (timer := self.timers.pop(served.name, None)) is not None:
            timer.cancel()
        if self.closed:
            return  # close() closes it
        self.unloading_bytes += served.size_bytes
        try:
            await self.loop.run_in_executor(self.threads, self._close_now, served)
        finally:
            self.unloading_bytes -= served.size_bytes

    def _close_now(self, served: ServedModel) -> None:
        """shut() a model the pool built, unless close() did already."""
        with self.guard:
            if self.built.pop(id(served), None) is None:
                return
        shut(served)


def shut(served: ServedModel) -> None:
    """Stop a model's threads and its engine's ranks (blocking)."""
    served.close()
    served.llm.close()
