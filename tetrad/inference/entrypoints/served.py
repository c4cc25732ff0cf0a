"""What the server holds for each model it serves, and how a request finds its model.

A `ServedModel` bundles one loaded engine with what the HTTP side needs around it: the stepping
thread (AsyncEngine), the front end that tokenizes and renders chat off the event loop, the chat
formatter, the token-text cache and the Modelfile's sampling defaults. The routes never hold an
engine themselves: they ask the server's model set (`acquire(name, keep_alive)`) for the model a
request names, so that a server of one model and a server of many share every route.

A model set that unloads models (model_pool.py) must not unload one a request still uses: the
routes do not release what they acquire, so `Leases`, a middleware around every request, hands
the request's acquired models back once its answer is sent (a stream's last byte included).
`acquire` adds to the request's leases (`lease`); outside a request, `request_scope()` holds them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.api import ApiError, ServerConfig, TokenText
from tetrad.inference.entrypoints.async_engine import AsyncEngine
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.entrypoints.front_end import FrontEnd
from tetrad.models.fp8_weights import weight_bytes

# Ollama's keep_alive: seconds as a number, or a Go duration string ("5m", "1h30m", "-1s").
DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                  "h": 3600.0}


def parse_keep_alive(value: float | int | str) -> float:
    """Seconds to keep a model loaded after its last request, as Ollama reads keep_alive: a
    number of seconds or a duration string; 0 unloads at once, a negative value never
    (math.inf). A value that is neither: a 400 naming it."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration_seconds(value.strip())
    else:
        seconds = math.nan
    if math.isnan(seconds):
        raise ApiError(400, f"keep_alive {value!r} is not a duration: use seconds (300), a "
                            f"duration (\"5m\", \"1h\"), 0 to unload after the request or a "
                            f"negative value to keep the model loaded")
    return math.inf if seconds < 0 else seconds


def _duration_seconds(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    parts = DURATION_PART.findall(body)
    if not parts or "".join(number + unit for number, unit in parts) != body:
        try:
            return sign * float(body)  # Ollama takes a bare number in a string as seconds
        except ValueError:
            return math.nan
    return sign * sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)


def engine_bytes(llm: LLM) -> int:
    """What a loaded engine holds on its devices: weight bytes (models.fp8_weights.weight_bytes:
    parameters and quantized weight buffers) and KV pool, counted on this process's rank. A
    multi-rank engine's other ranks run in processes of their own: its count is this rank's times
    the ranks, exact where the ranks hold alike (tensor and data parallel ranks of a model whose
    dimensions their number divides); a pipeline's first stage, this one, holds the embedding
    besides its layers."""
    pool = llm.runner.kv_cache.pool
    return (weight_bytes(llm.runner.model) + pool.numel() * pool.element_size()) * \
        llm.config.world_size


@dataclass
class ServedModel:
    name: str
    llm: LLM
    engine: AsyncEngine
    front: FrontEnd
    chat: ChatFormatter
    token_text: TokenText
    defaults: dict | None = None  # sampling fields for requests that leave them out
    details: dict = field(default_factory=dict)  # what /api/show and /api/ps describe
    size_bytes: int = 0  # engine_bytes: weights and KV pools, counted at load
    expires_at: float | None = None  # time.time() when idle it unloads; None: never
    keep_alive_s: float = math.inf  # the last request's keep_alive, in seconds
    pins: int = 0  # requests using it now (a model set never unloads a pinned model)
    last_used: float = 0.0  # time.monotonic() of its last release: the LRU order
    started: bool = False

    @classmethod
    def build(cls, llm: LLM, name: str, config: ServerConfig, chat: ChatFormatter | None = None,
              defaults: dict | None = None, on_fatal: Callable[[], None] | None = None,
              details: dict | None = None) -> "ServedModel":
        """`defaults`: a stored model's Modelfile PARAMETERs. Checked against the server's
        limits here, before the model serves anything."""
        default_stops = len((defaults or {}).get("stop", ()))
        if default_stops > config.max_stop_strings:  # else every request without stop passes it
            raise ConfigError(f"the model's Modelfile has {default_stops} stop strings: more "
                              f"than --max-stop-strings {config.max_stop_strings}")
        chat = chat or ChatFormatter()
        return cls(name, llm, AsyncEngine(llm, on_fatal, config.stream_interval),
                   FrontEnd(llm.tokenizer, llm.max_model_len, chat, config.template_timeout),
                   chat, TokenText(llm.tokenizer), defaults, details or {}, engine_bytes(llm))

    def start(self) -> None:
        self.engine.start()
        self.started = True

    def close(self) -> None:
        """Stops the stepping thread and the front end's threads; the engine (its ranks) belongs
        to whoever loaded it."""
        if self.started:
            self.engine.shutdown()
        self.front.close()

    def health(self) -> str | None:
        return self.engine.health() or self.front.health()


class OneModel:
    """The model set of a server started with one model: a request names it or no model."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.default_name = served.name

    async def acquire(self, name: str | None, keep_alive: float | str | None = None
                      ) -> ServedModel:
        """keep_alive is checked (a 400 when it is no duration) and otherwise ignored: the one
        model stays loaded for the server's lifetime."""
        if keep_alive is not None:
            parse_keep_alive(keep_alive)
        if name not in (None, self.served.name):
            raise ApiError(404, f"model {name!r} is not served here: use "
                                f"{self.served.name!r}", "not_found_error")
        return self.served

    def release(self, served: ServedModel) -> None:
        """Nothing to do: the one model is never unloaded."""

    def loaded(self) -> list[ServedModel]:
        return [self.served]

    def available(self) -> list[str]:
        return [self.served.name]

    def start(self) -> None:
        self.served.start()

    def close(self) -> None:
        self.served.close()


_leases: contextvars.ContextVar[list | None] = contextvars.ContextVar("tetrad_leases",
                                                                    default=None)


def lease(models, served: ServedModel) -> None:
    """Record that the current request holds `served` of `models` until it ends; a ValueError
    outside a request scope (a model set that unloads models must know when it is released)."""
    held = _leases.get()
    if held is None:
        raise ValueError("acquire() outside a request: wrap the call in request_scope()")
    held.append((models, served))


@contextlib.asynccontextmanager
async def request_scope() -> AsyncIterator[None]:
    """The models acquired inside are released when it exits."""
    held: list = []
    token = _leases.set(held)
    try:
        yield
    finally:
        _leases.reset(token)
        for models, served in reversed(held):
            models.release(served)


class Leases:
    """ASGI middleware: every HTTP request is a request_scope, which ends after the response's
    last byte (a streamed answer's generator runs inside the app call)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        async with request_scope():
            await self.app(scope, receive, send)
