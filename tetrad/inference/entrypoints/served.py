"""What the server holds for each model it serves, and how a request finds its model.

A `ServedModel` bundles one loaded engine with what the HTTP side needs around it: the stepping
thread (AsyncEngine), the front end that tokenizes and renders chat off the event loop, the chat
formatter, the token-text cache and the Modelfile's sampling defaults. The routes never hold an
engine themselves: they ask the server's model set (`acquire(name, keep_alive)`) for the model a
request names, so that a server of one model and a server of many share every route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.api import ApiError, ServerConfig, TokenText
from tetrad.inference.entrypoints.async_engine import AsyncEngine
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.entrypoints.front_end import FrontEnd


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
                   chat, TokenText(llm.tokenizer), defaults, details or {})

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        """Stops the stepping thread and the front end's threads; the engine (its ranks) belongs
        to whoever loaded it."""
        self.engine.shutdown()
        self.front.close()

    def health(self) -> str | None:
        return self.engine.health() or self.front.health()


class OneModel:
    """The model set of a server started with one model: a request names it or no model."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.default_name = served.name

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> ServedModel:
        if name not in (None, self.served.name):
            raise ApiError(404, f"model {name!r} is not served here: use "
                                f"{self.served.name!r}", "not_found_error")
        return self.served

    def loaded(self) -> list[ServedModel]:
        return [self.served]

    def start(self) -> None:
        self.served.start()

    def close(self) -> None:
        self.served.close()
