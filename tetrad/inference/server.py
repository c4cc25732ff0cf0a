"""An OpenAI-compatible HTTP server over the engine: /v1/completions, /v1/chat/completions (both
streaming by server-sent events), /v1/models, /health and Prometheus /metrics.

The engine steps on a thread of its own (AsyncEngine); the event loop only validates requests,
queues them and relays their outputs, so a long step never stalls HTTP. A bad request gets a 400
with OpenAI's error body and the server keeps serving; a client that disconnects has its request
aborted, which frees its KV blocks at the next step. An engine that can no longer step (a
tensor-parallel rank died) fails the requests in flight, answers 503 and calls `on_fatal`
(`tetrad serve` stops the server there).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tetrad.errors import TetradError
from tetrad.inference.chat import ChatFormatter
from tetrad.inference.engine import LLM
from tetrad.inference.output import RequestOutput
from tetrad.inference.params import SamplingParams


class EngineStopped(TetradError):
    """The engine can no longer step: requests get a 503."""


class RequestStream:
    """The outputs of one request, as the engine thread produces them. Stopping the iteration
    early (a closed or cancelled consumer) aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self.queue = engine, request_id, queue
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self.queue.get()
                if isinstance(output, BaseException):
                    raise output
                self.finished = output.finished
                yield output
        finally:
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, llm: LLM, on_fatal: Callable[[], None] | None = None):
        self.llm, self.on_fatal = llm, on_fatal
        self.failure: BaseException | None = None  # set when the engine can no longer step
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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

    def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; raises (TetradError) at once when it could never run."""
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        request_id = f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.llm.add_request(prompt, params, request_id)
        except BaseException:
            with self._lock:
                del self._streams[request_id]
            raise
        self._wake.set()
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.llm.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            if not self.llm.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as error:  # a bug, not a bad request: fail the requests in flight
                traceback.print_exc()
                if self.llm.failure is not None:  # a tensor-parallel rank is gone: no more steps
                    self.failure = error
                self._fail_all(error)
                if self.failure is None:
                    continue
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            for output in outputs:
                with self._lock:
                    entry = (self._streams.pop(output.request_id, None) if output.finished
                             else self._streams.get(output.request_id))
                if entry is not None:
                    loop, queue = entry
                    # The engine keeps updating its output object: hand over a snapshot.
                    loop.call_soon_threadsafe(queue.put_nowait, copy.deepcopy(output))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, (loop, queue) in streams.items():
            self.llm.abort(request_id)
            failure = RuntimeError(f"engine step failed: {error}")
            loop.call_soon_threadsafe(queue.put_nowait, failure)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, ...)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None

    def sampling_params(self, extra_stop: tuple[str, ...] = (),
                        defaults: dict | None = None) -> SamplingParams:
        """The request's sampling; `defaults` (a stored model's Modelfile PARAMETERs, as
        SamplingParams fields) stand in for the fields the request leaves out."""
        unset = {key: value for key, value in (defaults or {}).items()
                 if key not in self.model_fields_set}
        if self.presence_penalty or self.frequency_penalty:
            raise TetradError("presence_penalty and frequency_penalty are not supported: use "
                              "repetition_penalty")
        if self.logprobs:
            raise TetradError("logprobs are not supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values = dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            repetition_penalty=self.repetition_penalty, max_tokens=self.max_tokens,
            stop=tuple(stop), seed=self.seed, n=self.n, ignore_eos=self.ignore_eos)
        values.update(unset)
        return SamplingParams(**{**values, "stop": tuple(values["stop"]) + extra_stop})


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions


class ChatRequest(SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None  # the newer name of max_tokens


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None}}, status_code=status)


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests as they come; closing it aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as error:
            await queue.put((index, error))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output = await queue.get()
            if output is None:
                remaining -= 1
            elif isinstance(output, Exception):
                raise output
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(request: Request, streams: list[RequestStream]) -> list | None:
    """The finished output of every stream, or None when the client went away first (its
    requests are then aborted)."""
    async def collect() -> list:
        finals = [None] * len(streams)
        async for index, output in merged(streams):
            finals[index] = output
        return finals

    task = asyncio.create_task(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def build_app(llm: LLM, model_name: str, chat: ChatFormatter | None = None,
              on_fatal: Callable[[], None] | None = None,
              defaults: dict | None = None) -> FastAPI:
    engine = AsyncEngine(llm, on_fatal)
    chat = chat or ChatFormatter()

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="tetrad", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                             f"{e['msg']}" for e in error.errors())
        return error_response(400, problems)

    @app.exception_handler(TetradError)
    async def rejected(_request, error: TetradError):
        if isinstance(error, EngineStopped):
            return error_response(503, str(error), "server_error")
        return error_response(400, str(error))

    def submit_all(prompts: list, params: SamplingParams) -> list[RequestStream]:
        streams = []
        try:
            for prompt in prompts:
                streams.append(engine.submit(prompt, params))
        except BaseException:
            for stream in streams:
                engine.abort(stream.request_id)
            raise
        return streams

    def check_model(name: str | None) -> JSONResponse | None:
        if name not in (None, model_name):
            return error_response(404, f"model {name!r} is not served here: use {model_name!r}",
                                  "not_found_error")
        return None

    def usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return error_response(503, f"the engine stopped: {engine.failure}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tetrad",
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(llm.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (response := check_model(body.model)) is not None:
            return response
        prompt = body.prompt
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        prompts = prompt if batch else [prompt]
        params = body.sampling_params(defaults=defaults)
        streams = submit_all(prompts, params)
        common = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                  "created": int(time.time()), "model": model_name}
        if body.stream:
            async def chunks():
                async for index, output in merged(streams):
                    for c in output.outputs:
                        if c.delta_text or c.finish_reason:
                            yield {**common, "choices": [{
                                "index": index * params.n + c.index, "text": c.delta_text,
                                "logprobs": None, "finish_reason": c.finish_reason}]}
            return sse(chunks())
        finals = await final_outputs(request, streams)
        if finals is None:
            return error_response(499, "client closed the request")
        choices = [{"index": i * params.n + c.index, "text": c.text, "logprobs": None,
                    "finish_reason": c.finish_reason}
                   for i, final in enumerate(finals) for c in final.outputs]
        return {**common, "choices": choices, "usage": usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if (response := check_model(body.model)) is not None:
            return response
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        params = body.sampling_params(chat.stop, defaults)
        streams = submit_all([chat.render(body.messages)], params)
        common = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": model_name}
        if body.stream:
            async def chunks():
                for index in range(params.n):  # the role comes first, as OpenAI sends it
                    yield {**common, "object": "chat.completion.chunk", "choices": [{
                        "index": index, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}]}
                async for _, output in merged(streams):
                    for c in output.outputs:
                        if c.delta_text or c.finish_reason:
                            delta = {"content": c.delta_text} if c.delta_text else {}
                            yield {**common, "object": "chat.completion.chunk", "choices": [{
                                "index": c.index, "delta": delta,
                                "finish_reason": c.finish_reason}]}
            return sse(chunks())
        finals = await final_outputs(request, streams)
        if finals is None:
            return error_response(499, "client closed the request")
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason} for c in finals[0].outputs]
        return {**common, "object": "chat.completion", "choices": choices,
                "usage": usage(finals)}

    return app
