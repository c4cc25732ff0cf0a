"""The Ollama API next to /v1 on the same server, for Ollama's clients (its `ollama` Python
package, editors and chat front ends that talk to port 11434): /api/generate and /api/chat
(newline-delimited JSON streams, or one object with `stream: false`), /api/embed and the legacy
/api/embeddings, /api/tags, /api/show, /api/ps, /api/version, /api/pull (of a model the local
store holds: there is no network), /api/delete, and GET / as the probe clients send first.

Requests take the routes /v1 takes: the model set's acquire (load on request, keep_alive), the
same engine thread, http.py's merged / final_outputs / unless_gone (deadline, a client that
leaves aborts its request). Errors on /api/* are Ollama's {"error": "..."}: the app's own
handlers answer (the same statuses and messages as /v1), and OllamaErrors reshapes their JSON.
docs/serving.md ("Ollama API") says which fields are followed and which refused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pydantic import BaseModel, ValidationError

from tetrad.errors import ConfigError, TetradError
from tetrad.inference.core.output import RequestOutput
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.entrypoints.api import ApiError, SamplingFields, ServerConfig
from tetrad.inference.entrypoints.http import error_body, final_outputs, merged, unless_gone
from tetrad.inference.entrypoints.ollama_api import (ChatRequest, EmbedRequest, GenerateRequest,
                                                     ModelRequest, created_at, details, digest,
                                                     done_fields, folder_format, level,
                                                     model_info, nanoseconds, parameters_text,
                                                     timestamp)
from tetrad.inference.entrypoints.ollama_embed import embed_texts
from tetrad.inference.entrypoints.ollama_options import sampling_options
from tetrad.inference.entrypoints.served import ServedModel, parse_keep_alive
from tetrad.spec.presets import resolve_model

NDJSON = "application/x-ndjson"
VERSION_PACKAGE = "tetrad"


def ndjson(item: dict) -> bytes:
    return (json.dumps(item) + "\n").encode()


def generated_text(text: str) -> dict:
    return {"response": text}


def assistant_message(text: str) -> dict:
    return {"message": {"role": "assistant", "content": text}}


async def read_body(request: Request, kind: type[BaseModel]):
    """The body as `kind`, read as JSON whatever its Content-Type says: Ollama's clients and its
    documented `curl -d` examples send none, or a form's."""
    try:
        return kind.model_validate_json(await request.body() or b"{}")
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def add_ollama_api(app: FastAPI, models, config: ServerConfig) -> None:
    """The /api/* routes and GET / on `app`, over the model set `models`. /api/show, /api/pull
    and /api/delete read the local model store it serves from: a pool's (its catalog's), or the
    `store` a model set is given; a one-model server has none and knows its model alone."""
    router = APIRouter()
    store = getattr(models, "store", None) or getattr(getattr(models, "catalog", None), "store",
                                                      None)

    async def acquire(name: str, keep_alive) -> tuple[ServedModel, float]:
        """The model, and the seconds it took to get it (loading included)."""
        started = time.perf_counter()
        served = await models.acquire(name, keep_alive)
        return served, time.perf_counter() - started

    async def begin(request: Request, kind: type[GenerateRequest | ChatRequest]) -> tuple:
        """(body, its model, when the request started, the seconds getting the model took)."""
        started = time.perf_counter()
        body = await read_body(request, kind)
        body.check()
        served, load_seconds = await acquire(body.model, body.keep_alive)
        return body, served, started, load_seconds

    def sampling(served: ServedModel, options: dict | None, extra_stop: tuple[str, ...]
                 ) -> tuple[SamplingParams, int | None]:
        fields, num_ctx = sampling_options(options, served.llm.max_model_len)
        body = SamplingFields.model_construct(**fields)  # checked by sampling_options
        return body.sampling_params(config, extra_stop, served.defaults), num_ctx

    async def answer(request: Request, served: ServedModel, ids: list[int], params,
                     num_ctx: int | None, stream: bool, piece: Callable[[str], dict],
                     last: Callable[[RequestOutput], dict], started: float,
                     load_seconds: float) -> Response:
        """Runs the request; `piece(text)` is a chunk's body, `last(output)` the final chunk's
        fields beyond the timings."""
        if num_ctx is not None:
            if len(ids) >= num_ctx:
                raise ApiError(400, f"the prompt is {len(ids)} tokens: options.num_ctx "
                                    f"{num_ctx} leaves no room to answer")
            room = num_ctx - len(ids)
            params = params.replace(max_tokens=min(params.max_tokens or room, room))
        engine = served.engine
        if engine.failure is None and served.llm.num_waiting() >= config.max_waiting_requests:
            raise ApiError(503, f"the server is busy: {config.max_waiting_requests} requests "
                                f"are waiting; retry later", "server_error", {"Retry-After": "1"})
        streams = [engine.submit(ids, params, every_step=stream)]
        head = {"model": served.name}

        def final(output: RequestOutput, text: str) -> dict:
            return {**head, "created_at": timestamp(), **piece(text), **last(output),
                    **done_fields(output, started, load_seconds)}

        if not stream:
            output = (await final_outputs(request, streams, config.request_timeout))[0]
            return JSONResponse(final(output, output.outputs[0].text))

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for _, output in merged(streams, config.request_timeout):
                    if delta := output.outputs[0].delta_text:
                        yield ndjson({**head, "created_at": timestamp(), **piece(delta),
                                      "done": False})
                    if output.finished:
                        yield ndjson(final(output, ""))
            except TetradError as error:  # after the stream began: a last {"error"} line
                yield ndjson({"error": error_body(error)["error"]["message"]})
        return StreamingResponse(lines(), media_type=NDJSON)

    def loaded_answer(served: ServedModel, keep_alive, piece) -> JSONResponse:
        """Ollama's answer to a request with nothing to say: the model is loaded (or, with
        keep_alive 0, unloaded once this request ends)."""
        reason = "unload" if keep_alive is not None and parse_keep_alive(keep_alive) == 0 \
            else "load"
        return JSONResponse({"model": served.name, "created_at": timestamp(), **piece(""),
                             "done": True, "done_reason": reason})

    @router.post("/api/generate")
    async def generate(request: Request):
        body, served, started, load_seconds = await begin(request, GenerateRequest)
        piece = generated_text
        if not body.prompt and not body.context:
            return loaded_answer(served, body.keep_alive, piece)
        extra_stop: tuple[str, ...] = ()
        prompt = body.prompt or ""
        if not body.raw:  # Ollama applies the model's template: tetrad's chat rendering
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": prompt}]
            prompt = await unless_gone(request, served.front.render(messages))
            extra_stop = served.chat.stop
        params, num_ctx = sampling(served, body.options, extra_stop)
        ids = list(body.context or []) + (await served.front.tokenize([prompt]))[0]
        return await answer(request, served, ids, params, num_ctx, body.stream, piece,
                            lambda output: {"context": output.prompt_token_ids +
                                            output.outputs[0].token_ids},
                            started, load_seconds)

    @router.post("/api/chat")
    async def chat(request: Request):
        body, served, started, load_seconds = await begin(request, ChatRequest)
        piece = assistant_message
        if not body.messages:
            return loaded_answer(served, body.keep_alive, piece)
        params, num_ctx = sampling(served, body.options, served.chat.stop)
        prompt = await unless_gone(request, served.front.render(body.messages))
        ids = (await served.front.tokenize([prompt]))[0]
        return await answer(request, served, ids, params, num_ctx, body.stream, piece,
                            lambda output: {}, started, load_seconds)

    async def embeddings_of(body: EmbedRequest, texts: list[str]) -> tuple[dict, list]:
        started = time.perf_counter()
        served, load_seconds = await acquire(body.model, body.keep_alive)
        sampling_options(body.options, served.llm.max_model_len)  # refuses unknown options
        context, limit = served.llm.max_model_len, served.front.max_prompt_bytes
        if body.truncate and limit is not None:  # no longer than the bytes a context can hold
            texts = [text.encode()[:limit].decode(errors="ignore") for text in texts]
        ids = await served.front.tokenize(texts)
        for index, prompt in enumerate(ids):
            if not prompt:
                raise ApiError(400, f"input {index} is empty: there is nothing to embed")
            if len(prompt) > context and not body.truncate:
                raise ApiError(400, f"input {index} is {len(prompt)} tokens, more than the "
                                    f"context of {context}: send truncate: true to cut it")
        ids = [prompt[:context] for prompt in ids]
        vectors = await served.engine.call(lambda: embed_texts(served.llm, ids, body.dimensions))
        return {"model": served.name,
                "total_duration": nanoseconds(time.perf_counter() - started),
                "load_duration": nanoseconds(load_seconds),
                "prompt_eval_count": sum(map(len, ids))}, vectors

    @router.post("/api/embed")
    async def embed(request: Request):
        body = await read_body(request, EmbedRequest)
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts:
            raise ApiError(400, "input is required: a string or a list of strings")
        fields, vectors = await embeddings_of(body, texts)
        return {**fields, "embeddings": vectors}

    @router.post("/api/embeddings")
    async def embeddings(request: Request):
        body = await read_body(request, EmbedRequest)
        if body.prompt is None:
            raise ApiError(400, "prompt is required: the text to embed")
        _, vectors = await embeddings_of(body, [body.prompt])
        return {"embedding": vectors[0]}

    def stored_model(name: str):
        """The store's model of that name, or None (also for a name the store cannot hold)."""
        try:
            return store.get(name) if store is not None else None
        except ConfigError:
            return None

    def describe(name: str) -> dict | None:
        """What tags/show/ps say of a model, loaded or stored (None when neither); reads files."""
        stored = stored_model(name)
        names = {name, stored.name} if stored else {name}
        served = next((s for s in models.loaded() if s.name in names), None)
        if served is not None and stored is not None and stored.name != served.name:
            stored = None  # a folder served under a name the store also holds
        if served is None and stored is None:
            return None
        folder = stored.folder if stored else served.llm.path
        model_config = served.llm.model_config if served else resolve_model(str(folder))
        manifest = stored.manifest if stored else None
        full = stored.name if stored else name
        template = served.chat.source if served else (
            (folder / "chat_template.jinja").read_text() if manifest["template"] else None)
        return {"served": served, "stored": stored, "config": model_config, "folder": folder,
                "template": template,
                "entry": {"name": full, "model": full,
                          "modified_at": created_at(manifest, folder),
                          "size": stored.size if stored else served.size_bytes,
                          "digest": digest(manifest, folder),
                          "details": details(model_config, level(served, manifest),
                                             folder_format(folder))}}

    @router.get("/api/tags")
    async def tags():
        names = models.available()
        described = await asyncio.to_thread(lambda: [describe(name) for name in names])
        return {"models": [d["entry"] for d in described if d is not None]}

    @router.post("/api/show")
    async def show(request: Request):
        body = await read_body(request, ModelRequest)
        name = body.model_name()
        found = await asyncio.to_thread(describe, name)
        if found is None:
            raise ApiError(404, f"model {name[:200]!r} not found", "not_found_error")
        stored = found["stored"]
        modelfile = stored.modelfile() if stored else f"FROM {found['folder']}\n"
        return {"modelfile": modelfile, "parameters": parameters_text(modelfile),
                "template": found["template"] or "",
                "license": "\n".join(stored.manifest["license"]) if stored else "",
                "system": stored.system if stored else None,
                "details": found["entry"]["details"], "model_info": model_info(found["config"]),
                "capabilities": ["completion", "embedding"],
                "modified_at": found["entry"]["modified_at"]}

    @router.get("/api/ps")
    async def ps():
        entries = []
        for served in models.loaded():
            found = await asyncio.to_thread(describe, served.name)
            on_gpu = next(served.llm.model.parameters()).device.type == "cuda"
            entries.append({**found["entry"], "name": served.name, "model": served.name,
                            "size": served.size_bytes,
                            "size_vram": served.size_bytes if on_gpu else 0,
                            "expires_at": None if served.expires_at is None else
                            timestamp(served.expires_at),
                            "context_length": served.llm.max_model_len})
        return {"models": entries}

    @router.get("/api/version")
    async def version():
        from importlib.metadata import version as package_version

        return {"version": package_version(VERSION_PACKAGE)}

    @router.post("/api/pull")
    async def pull(request: Request):
        body = await read_body(request, ModelRequest)
        name = body.model_name()
        present = any(s.name == name for s in models.loaded()) or \
            await asyncio.to_thread(stored_model, name) is not None
        if not present:
            where = f"the local store ({store.root})" if store is not None else "this server"
            raise ApiError(404, f"model {name[:200]!r} is not in {where}: tetrad pulls nothing "
                                f"over the network; `tetrad create` adds a model",
                           "not_found_error")
        line = {"status": "success"}
        if body.stream:
            return StreamingResponse(iter([ndjson(line)]), media_type=NDJSON)
        return line

    @router.delete("/api/delete")
    async def delete(request: Request):
        body = await read_body(request, ModelRequest)
        name = body.model_name()
        if store is None:
            raise ApiError(400, "this server has no model store to delete from")
        stored = await asyncio.to_thread(stored_model, name)
        if stored is None:
            raise ApiError(404, f"model {name[:200]!r} not found", "not_found_error")
        if any(s.name == stored.name for s in models.loaded()):
            raise ApiError(409, f"model {stored.name} is loaded: unload it first (a request "
                                f"with keep_alive 0, as `ollama stop` sends) and delete again")
        await asyncio.to_thread(store.remove, stored.name)
        return Response(status_code=200)

    @router.api_route("/", methods=["GET", "HEAD"])
    async def probe():
        return PlainTextResponse("tetrad is running (Ollama API at /api, OpenAI API at /v1)")

    @router.api_route("/api/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "HEAD"])
    async def unknown(rest: str):
        raise ApiError(404, f"/api/{rest[:100]} is not part of tetrad's Ollama API",
                       "not_found_error")

    app.include_router(router)
    app.add_middleware(OllamaErrors)


class OllamaErrors:
    """ASGI middleware: an error answer on /api/* (OpenAI's {"error": {"message": ...}}, from
    the app's handlers or the Guard) becomes Ollama's {"error": "..."}, status and headers
    kept. Other answers pass untouched, a stream included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            return await self.app(scope, receive, send)
        start: dict | None = None
        body = b""

        async def reshaping(message):
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            try:
                shaped = json.dumps({"error": json.loads(body)["error"]["message"]}).encode()
            except (ValueError, KeyError, TypeError):
                shaped = body  # not OpenAI's error JSON: as it was
            headers = [(key, value) for key, value in start["headers"]
                       if key.lower() != b"content-length"]
            await send({**start, "headers": [*headers,
                                             (b"content-length", str(len(shaped)).encode())]})
            await send({"type": "http.response.body", "body": shaped})

        await self.app(scope, receive, reshaping)
