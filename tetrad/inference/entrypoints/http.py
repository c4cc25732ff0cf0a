"""HTTP plumbing of the server: the guard in front of every route (API key, body size), server-sent
events, and waiting on several request streams with a deadline and a client that may leave."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Coroutine
from json.encoder import encode_basestring_ascii as json_string  # json.dumps of a str, in C

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from tetrad.errors import TetradError
from tetrad.inference.entrypoints.api import ApiError, ServerConfig, error_json, error_response
from tetrad.inference.entrypoints.async_engine import RequestError, RequestStream

PROTECTED = ("/v1", "/tokenize", "/detokenize", "/api/")  # what --api-key guards (vLLM: /v1)


class Guard:
    """ASGI middleware: a request to a protected path must bring the API key ("Authorization:
    Bearer KEY", else 401); a body larger than max_request_bytes gets a 413 before any route
    reads it (the body is read here, up to the limit, and replayed to the app)."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith(PROTECTED) and not \
                hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await error_response(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                "authentication_error")(scope, receive, send)
        limit = self.config.max_request_bytes
        too_large = error_response(413, f"the request body exceeds {limit} bytes (tetrad serve "
                                        f"--max-request-bytes)")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            return await error_response(400, "Content-Length is not a number")(scope, receive,
                                                                                send)
        if int(declared) > limit:
            return await too_large(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def error_body(error: TetradError) -> dict:
    if isinstance(error, ApiError):
        return error_json(str(error), error.kind)
    return error_json(str(error), "server_error" if isinstance(error, RequestError)
                      else "invalid_request_error")


class ChunkEvents:
    """The server-sent events of one streamed answer, each the bytes json.dumps gives for
    {**common, "choices": [choice]}. The fields every chunk repeats (id, object, created, model)
    are serialized once, here. A choice of new text alone (no log-probabilities), the chunk of
    nearly every token of every stream, is written from a template around its JSON-quoted text:
    the event loop builds these under the GIL that the engine thread needs between its torch
    ops, and json.dumps of the whole chunk took 11 us where the template takes 0.5 us."""

    def __init__(self, common: dict, chat: bool):
        whole = json.dumps({**common, "choices": None})
        self.head = "data: " + whole[:-len("null}")] + "["
        self.chat = chat  # chat chunks carry {"delta": {"content": text}}, not {"text": text}

    def event(self, choice: dict) -> bytes:
        return f"{self.head}{json.dumps(choice)}]}}\n\n".encode()

    def text_event(self, index: int, text: str, finish_reason: str | None) -> bytes:
        if not self.chat:
            field = f'"text": {json_string(text)}'
        else:
            field = f'"delta": {{"content": {json_string(text)}}}' if text else '"delta": {}'
        reason = "null" if finish_reason is None else json_string(finish_reason)
        return (f'{self.head}{{"index": {index}, {field}, "logprobs": null, '
                f'"finish_reason": {reason}}}]}}\n\n').encode()


def sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A stream of events; a failure after the stream began (the request failed in the engine, or
    ran out of time) becomes a last {"error": ...} event before [DONE], as vLLM sends it."""
    async def framed():
        try:
            async for event in events:
                yield event
        except TetradError as error:
            yield f"data: {json.dumps(error_body(error))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return StreamingResponse(framed(), media_type="text/event-stream")


async def merged(streams: list[RequestStream], timeout_s: float
                 ) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from several requests as they come, until all finish or
    `timeout_s` passes (ApiError 408); closing it aborts the requests still running.

    The deadline is one timer per request that puts the 408 into the request's collector, not a
    timeout around every wait: that cost a timer and its cancellation per server-sent event."""
    loop = asyncio.get_running_loop()
    timers = [loop.call_later(timeout_s, stream.collector.put, ApiError(
        408, f"the request ran longer than {timeout_s:g} s and was stopped (tetrad serve "
             f"--request-timeout)", "timeout_error")) for stream in streams]
    single = len(streams) == 1  # read without a pump task
    source = aiter(streams[0]) if single else _interleaved(streams)
    try:
        async for item in source:
            yield (0, item) if single else item
    finally:
        for timer in timers:
            timer.cancel()
        await source.aclose()


async def _interleaved(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
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


async def final_outputs(request: Request, streams: list[RequestStream], timeout_s: float
                        ) -> list:
    """The finished output of every stream; a 499 when the client went away first (closing
    merged() aborts the requests still running)."""
    async def collect() -> list:
        finals = [None] * len(streams)
        async for index, output in merged(streams, timeout_s):
            finals[index] = output
        return finals

    return await unless_gone(request, collect())


async def unless_gone(request: Request, work: Coroutine):
    """work's result; when the client leaves first, work is cancelled (its cleanup stops what it
    started) and ApiError 499 raised. The disconnect is awaited, not polled: polling woke the
    event loop 4 times a second per request, each wake-up taking the GIL from the engine
    thread."""
    task = asyncio.create_task(work)
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    if task.cancelled():
        raise ApiError(499, "client closed the request")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read before: the server's
    next message is the disconnect), or when its connection can no longer be read."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - an unreadable connection is a gone client
        return
