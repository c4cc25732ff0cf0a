"""An OpenAI-compatible HTTP server over the engine: /v1/completions and /v1/chat/completions (both
streaming by server-sent events, with log-probabilities and echo), /v1/models, vLLM's /tokenize,
/detokenize and /tokenizer_info, /health and Prometheus /metrics.

The engine steps on a thread of its own (async_engine.py); the event loop only validates requests,
queues them and relays their outputs; prompts too long for the context are refused from their
byte length, larger ones are tokenized and chat templates rendered on threads, within a time limit
(front_end.py), so a long step, a long prompt or a slow template never stalls HTTP. Every error is
OpenAI's error JSON: a bad request a 400, a missing API key a 401, a too large body a 413, a full
queue a 503 with Retry-After, a request over its time a 408; a client that disconnects has its
request aborted, which frees its KV blocks at the next step, and its chat template stopped. A
step that fails fails the requests it ran (500) and no others; an engine that can no longer step
(a tensor-parallel rank died) fails the requests in flight, answers 503, turns /health to 503 and
calls `on_fatal` (`tetrad serve` stops the server there); so does a stalled front end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException

from tetrad.errors import TetradError
from tetrad.inference.entrypoints.api import (ApiError, ChatRequest, CompletionRequest,
                                              DetokenizeRequest, ServerConfig, TokenizeRequest,
                                              chat_logprobs, completion_logprobs, error_response)
from tetrad.inference.entrypoints.async_engine import EngineStopped, RequestError
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.served import Leases, OneModel, ServedModel
from tetrad.inference.entrypoints.http import ChunkEvents, Guard, final_outputs, merged, sse, unless_gone
from tetrad.inference.entrypoints.ollama import add_ollama_api
from tetrad.inference.core.output import RequestOutput


def build_app(llm: LLM, model_name: str, chat: ChatFormatter | None = None,
              on_fatal: Callable[[], None] | None = None, defaults: dict | None = None,
              config: ServerConfig | None = None) -> FastAPI:
    """A server of one model. `defaults`: sampling fields for requests that leave them out (a
    stored model's Modelfile PARAMETERs); `config`: the API key and the limits."""
    config = config or ServerConfig()
    served = ServedModel.build(llm, model_name, config, chat, defaults, on_fatal)
    return build_server(OneModel(served), config)


def build_server(models, config: ServerConfig) -> FastAPI:
    """The routes over a model set (served.py's OneModel, or a pool of many): each request asks
    it for the model it names with `await models.acquire(name, keep_alive)`, which it holds
    until its answer is sent (served.py's Leases)."""

    @asynccontextmanager
    async def lifespan(_app):
        models.start()
        yield
        models.close()

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None,
                                          "openapi_url": None}
    app = FastAPI(title="tetrad", lifespan=lifespan, **docs)
    app.state.models = models
    app.add_middleware(Guard, config=config)
    app.add_middleware(Leases)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                             f"{e['msg']}" for e in error.errors())
        return error_response(400, problems)

    @app.exception_handler(TetradError)
    async def rejected(_request, error: TetradError):
        if isinstance(error, ApiError):
            return error_response(error.status, str(error), error.kind, error.headers)
        if isinstance(error, EngineStopped):
            return error_response(503, str(error), "server_error")
        if isinstance(error, RequestError):
            return error_response(500, str(error), "server_error")
        return error_response(400, str(error))

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), kind, error.headers)

    @app.exception_handler(Exception)
    async def crashed(_request, error: Exception):
        return error_response(500, f"internal error: {type(error).__name__}: {error}",
                              "server_error")

    def submit_all(served: ServedModel, prompts: list[list[int]], params, stream: bool) -> list:
        if len(prompts) * params.n > config.max_sequences_per_request:
            raise ApiError(400, f"{len(prompts)} prompts x n = {params.n} asks for "
                                f"{len(prompts) * params.n} sequences: at most "
                                f"{config.max_sequences_per_request} per request (tetrad serve "
                                f"--max-sequences-per-request)")
        engine = served.engine
        if engine.failure is None and served.llm.num_waiting() >= config.max_waiting_requests:
            raise ApiError(503, f"the server is busy: {config.max_waiting_requests} requests "
                                f"are waiting; retry later", "server_error", {"Retry-After": "1"})
        streams = []
        try:
            for prompt in prompts:
                streams.append(engine.submit(prompt, params, every_step=stream))
        except BaseException:
            for stream in streams:
                engine.abort(stream.request_id)
            raise
        return streams

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @app.get("/health")
    async def health():
        for served in models.loaded():
            if (problem := served.health()) is not None:
                return error_response(503, problem, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        """Every model a request may name, loaded or not (the context length of loaded ones)."""
        lengths = {served.name: served.llm.max_model_len for served in models.loaded()}
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "tetrad",
             **({"max_model_len": lengths[name]} if name in lengths else {})}
            for name in models.available()]}

    @app.get("/metrics")
    async def metrics(model: str | None = None):
        served = await models.acquire(model)
        text = await served.engine.call(served.llm.metrics_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        served = await models.acquire(body.model)
        tokens = (await served.front.tokenize([body.prompt]))[0]
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": served.llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        served = await models.acquire(body.model)
        llm = served.llm
        if len(body.tokens) > llm.max_model_len:
            raise ApiError(400, f"{len(body.tokens)} tokens: at most the model's context length "
                                f"({llm.max_model_len})")
        vocab = llm.model_config.vocab_size
        if not all(0 <= token < vocab for token in body.tokens):
            raise ApiError(400, f"tokens must be in 0..{vocab - 1} (the model's vocab)")
        return {"prompt": await served.front.detokenize(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None):
        served = await models.acquire(model)
        llm = served.llm
        return {"tokenizer_class": type(llm.tokenizer).__name__,
                "eos_token": getattr(llm.tokenizer, "eos_token", None), "bos_token": None,
                "pad_token": None, "chat_template": served.chat.source,
                "model_max_length": llm.max_model_len}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served = await models.acquire(body.model)
        front, token_text = served.front, served.token_text
        prompt = body.prompt
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        prompts = prompt if batch else [prompt]
        # OpenAI's echo with max_tokens 0 scores the prompt alone: the engine samples one token
        # (the prompt's last position gives logits anyway), which the answer leaves out.
        prompt_only = body.echo and body.max_tokens == 0
        scored = body.logprobs is not None
        params = body.sampling_params(
            config, defaults=served.defaults, logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and scored else None,
            **({"max_tokens": 1} if prompt_only else {}))
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = await front.tokenize(prompts)
        if body.echo or scored:  # the prompt's text: echoed, and where text offsets start
            texts = [text if text is not None else await front.detokenize(prompt_ids)
                     for text, prompt_ids in zip(texts, ids)]
        streams = submit_all(served, ids, params, body.stream)
        common = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                  "created": int(time.time()), "model": served.name}

        def choice(index: int, output: RequestOutput, completion, first: bool, offset: int
                   ) -> tuple[dict, int]:
            """One choice (a whole one, or a stream's next piece): the echoed prompt first,
            then the completion's text, and their log-probabilities."""
            text, token_ids, scores = "", [], []
            if first and body.echo:
                text, token_ids = texts[index], output.prompt_token_ids
                scores = output.prompt_logprobs or []
            if not prompt_only:
                whole = output.finished and not body.stream
                text += completion.text if whole else completion.delta_text
                token_ids = token_ids + (completion.token_ids if whole
                                         else completion.delta_token_ids)
                scores = scores + ((completion.logprobs if whole
                                    else completion.delta_logprobs) or [])
            logprobs = None
            if scored:
                logprobs, offset = completion_logprobs(scores, token_ids, token_text, offset)
            reason = "length" if prompt_only and completion.finish_reason else \
                completion.finish_reason
            return {"index": index * params.n + completion.index, "text": text,
                    "logprobs": logprobs, "finish_reason": reason}, offset

        def start_offset(index: int) -> int:
            return 0 if body.echo or not scored else len(texts[index])

        if body.stream:
            text_only = not scored and not body.echo  # most streams: chunks of new text

            async def chunks():
                events = ChunkEvents(common, chat=False)
                offsets: dict[tuple[int, int], int] = {}
                async for index, output in merged(streams, config.request_timeout):
                    for completion in output.outputs:
                        if text_only:
                            if completion.delta_text or completion.finish_reason:
                                yield events.text_event(index * params.n + completion.index,
                                                        completion.delta_text,
                                                        completion.finish_reason)
                            continue
                        key = (index, completion.index)
                        first = key not in offsets
                        piece, offsets[key] = choice(index, output, completion, first,
                                                     offsets.get(key, start_offset(index)))
                        if piece["text"] or piece["finish_reason"] or (
                                scored and piece["logprobs"]["tokens"]):
                            yield events.event(piece)
            return sse(chunks())
        finals = await final_outputs(request, streams, config.request_timeout)
        choices = [choice(i, final, completion, True, start_offset(i))[0]
                   for i, final in enumerate(finals) for completion in final.outputs]
        generated = 0 if prompt_only else sum(len(c.token_ids) for f in finals
                                              for c in f.outputs)
        return {**common, "choices": choices,
                "usage": usage(sum(len(f.prompt_token_ids) for f in finals), generated)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        served = await models.acquire(body.model)
        front, chat = served.front, served.chat
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")
        params = body.sampling_params(
            config, chat.stop, served.defaults,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        prompt = await unless_gone(request, front.render(body.messages))
        ids = await front.tokenize([prompt])
        streams = submit_all(served, ids, params, body.stream)
        common = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": served.name}

        def logprobs_of(scores) -> dict | None:
            return chat_logprobs(scores, served.token_text) if body.logprobs else None

        if body.stream:
            async def chunks():
                events = ChunkEvents({**common, "object": "chat.completion.chunk"}, chat=True)
                for index in range(params.n):  # the role comes first, as OpenAI sends it
                    yield events.event({"index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None})
                async for _, output in merged(streams, config.request_timeout):
                    for c in output.outputs:
                        if body.logprobs and (c.delta_text or c.finish_reason or
                                              c.delta_logprobs):
                            delta = {"content": c.delta_text} if c.delta_text else {}
                            yield events.event({"index": c.index, "delta": delta,
                                                "logprobs": logprobs_of(c.delta_logprobs),
                                                "finish_reason": c.finish_reason})
                        elif c.delta_text or c.finish_reason:
                            yield events.text_event(c.index, c.delta_text, c.finish_reason)
            return sse(chunks())
        final = (await final_outputs(request, streams, config.request_timeout))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs_of(c.logprobs), "finish_reason": c.finish_reason}
                   for c in final.outputs]
        return {**common, "object": "chat.completion", "choices": choices,
                "usage": usage(len(final.prompt_token_ids),
                               sum(len(c.token_ids) for c in final.outputs))}

    add_ollama_api(app, models, config)  # /api/* and GET /, beside /v1
    return app
