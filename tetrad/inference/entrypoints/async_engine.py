"""The engine on a thread of its own, for the event loop of the server.

The thread steps the engine while it has work and hands each request's output of a step to that
request's OutputCollector, as a view (RequestOutput.view) that shares the engine's lists instead of
copying them. A collector holds at most one output: a step's output that arrives before the
consumer took the previous one is merged into it, so a slow client costs one output's memory,
however many steps it misses. With a stream interval above 1 (`tetrad serve --stream-interval`)
the engine thread itself holds a streamed request's steps back and merges them (Subscriber), so
the event loop wakes for it every that many steps. Anything that reads the engine's state (the
/metrics numbers) runs on the same thread between two steps (`call`), never beside a step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tetrad.errors import TetradError, check_positive
from tetrad.inference.engine import LLM
from tetrad.inference.core.output import RequestOutput
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.core.tracker import iter_queue

UNHEALTHY_AFTER_FAILED_STEPS = 3  # one failing request is not a sick engine; steps in a row are


class EngineStopped(TetradError):
    """The engine can no longer step: requests get a 503."""


class RequestError(TetradError):
    """The engine failed the request (a step that ran it raised): a 500."""


class OutputCollector:
    """The next output of one request for its consumer; used on the event loop's thread only."""

    def __init__(self):
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            item = self.pending.then(item)
        elif isinstance(self.pending, BaseException):
            item = self.pending  # a failure is the last word
        self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        self.ready.clear()
        item, self.pending = self.pending, None
        return item


class RequestStream:
    """The outputs of one request as the engine thread produces them. Stopping the iteration
    early (a closed or cancelled consumer) aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, collector: OutputCollector):
        self.engine, self.request_id, self.collector = engine, request_id, collector
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self.collector.get()
                if isinstance(output, BaseException):
                    raise output
                if output.error is not None:
                    raise RequestError(f"the request failed in the engine: {output.error}")
                self.finished = output.finished
                yield output
        finally:
            if not self.finished:
                self.engine.abort(self.request_id)


@dataclass
class Subscriber:
    """Where one request's outputs go. A streamed request's output goes at its first token, then
    every `stream_interval` steps (what the steps between produced, merged: RequestOutput.then),
    and at its end."""

    loop: asyncio.AbstractEventLoop
    collector: OutputCollector
    every_step: bool  # streamed: its steps' outputs, not only the finished one
    held: RequestOutput | None = None  # steps' outputs not handed over yet
    held_steps: int = 0
    started: bool = False  # its first output was handed over

    def take(self, output: RequestOutput, interval: int) -> RequestOutput | None:
        """The output to hand to the event loop after this step, if any."""
        if not (output.finished or self.every_step):
            return None
        view = output.view() if self.held is None else self.held.then(output.view())
        self.held_steps += 1
        if output.finished or not self.started or self.held_steps >= interval:
            self.held, self.held_steps, self.started = None, 0, True
            return view
        self.held = view
        return None


class AsyncEngine:
    def __init__(self, llm: LLM, on_fatal: Callable[[], None] | None = None,
                 stream_interval: int = 1):
        """stream_interval: a streamed request's output goes to its event loop every this many
        steps (its first token and its end at once), as vLLM's --stream-interval: fewer, larger
        server-sent events, less of the event loop's work beside the engine thread."""
        check_positive("stream_interval", stream_interval)
        self.llm, self.on_fatal, self.stream_interval = llm, on_fatal, stream_interval
        self.failure: BaseException | None = None  # set when the engine can no longer step
        self.failed_steps_in_a_row = 0
        self.last_error: str | None = None
        self._streams: dict[str, Subscriber] = {}  # by request id
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tetrad-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def health(self) -> str | None:
        """Why the engine cannot serve, or None when it can."""
        if self.failure is not None:
            return f"the engine stopped: {self.failure}"
        if not self._thread.is_alive():
            return "the engine thread is not running"
        if self.failed_steps_in_a_row >= UNHEALTHY_AFTER_FAILED_STEPS:
            return (f"the last {self.failed_steps_in_a_row} engine steps failed: "
                    f"{self.last_error}")
        return None

    def submit(self, prompt_ids: list[int], params: SamplingParams, every_step: bool = True
               ) -> RequestStream:
        """Queue a request; raises (TetradError) at once when it could never run. Without
        every_step the stream yields the finished output only (an answer that is not streamed:
        the steps before cost the event loop nothing)."""
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        collector = OutputCollector()
        request_id = f"req-{uuid.uuid4().hex}"
        with self._lock:  # before the engine can see the request and produce its output
            self._streams[request_id] = Subscriber(asyncio.get_running_loop(), collector,
                                                   every_step)
        try:
            self.llm.add_request(prompt_ids, params, request_id)
        except BaseException:
            with self._lock:
                del self._streams[request_id]
            raise
        self._wake.set()
        return RequestStream(self, request_id, collector)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.llm.abort(request_id)
        self._wake.set()

    async def call(self, function: Callable[[], Any]) -> Any:
        """function() on the engine thread between two steps (at once if the thread is gone)."""
        if not self._thread.is_alive():
            return function()
        future = asyncio.get_running_loop().create_future()
        self._calls.put((function, asyncio.get_running_loop(), future))
        self._wake.set()
        return await future

    def _run_calls(self) -> None:
        for function, loop, future in iter_queue(self._calls):
            try:
                result, error = function(), None
            except Exception as failure:
                result, error = None, failure
            loop.call_soon_threadsafe(settle, future, result, error)

    def _run(self) -> None:
        while not self._stopping:
            self._run_calls()
            if not self.llm.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as error:  # a fatal engine failure, or a bug outside the model step
                traceback.print_exc()
                self._count_step(error)
                if self.llm.failure is not None:  # a tensor-parallel rank is gone: no more steps
                    self.failure = error
                self._fail_all(error)
                if self.failure is None:
                    continue
                if self.on_fatal is not None:
                    self.on_fatal()
                self._run_calls()
                return
            self._count_step(next((o.error for o in outputs if o.error is not None), None))
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            with self._lock:
                for output in outputs:
                    subscriber = (self._streams.pop(output.request_id, None) if output.finished
                                  else self._streams.get(output.request_id))
                    taken = (subscriber.take(output, self.stream_interval)
                             if subscriber is not None else None)
                    if taken is not None:
                        deliveries.setdefault(subscriber.loop, []).append(
                            (subscriber.collector, taken))
            for loop, items in deliveries.items():  # one wake-up of the event loop per step
                loop.call_soon_threadsafe(_deliver, items)

    def _count_step(self, error: BaseException | str | None) -> None:
        if error is None:
            self.failed_steps_in_a_row = 0
        else:
            self.failed_steps_in_a_row += 1
            self.last_error = str(error)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, subscriber in streams.items():
            self.llm.abort(request_id)
            subscriber.loop.call_soon_threadsafe(
                subscriber.collector.put, RequestError(f"engine step failed: {error}"))


def _deliver(items: list[tuple[OutputCollector, RequestOutput]]) -> None:
    for collector, output in items:
        collector.put(output)


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
