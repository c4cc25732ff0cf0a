"""What a request asks for (SamplingParams) and when it is done (the stop policy). Plain Python:
the scheduler, the server and the tests use these without torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tetrad.spec.model import from_dict
from tetrad.errors import ConfigError, TetradError
from tetrad.spec.serving import ServerConfig

MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's limit)
# Stop strings per request, the server's default limit (`--max-stop-strings`), which `tetrad
# create` checks a Modelfile against.
DEFAULT_MAX_STOP_STRINGS = ServerConfig.max_stop_strings
# Temperatures below this sample as greedy (vLLM's rule): dividing logits by 1e-300 overflows to
# inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5


class RequestRejected(TetradError):
    """A request that can never run (too long for the model or the KV pool). The server answers it
    with a 4xx; the message says what to change."""


class RequestFailed(TetradError):
    """A step that ran the request failed (the engine goes on with the others)."""


@dataclass(frozen=True)
class SamplingParams:
    """Field names follow vLLM / the OpenAI API. temperature 0 (or below GREEDY_TEMPERATURE) means
    greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means all tokens
    repetition_penalty: float = 1.0  # HF's: divide positive logits of seen tokens, multiply others
    max_tokens: int | None = None  # None means up to the model's context length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probabilities of each generated token and its top-k rivals
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self) -> None:
        # Requests come from JSON: normalize a lone string and lists, reject wrong types early.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ConfigError(f"{name} must be a list, got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        number, integer = (int, float), (int,)
        checks = [  # (field, allowed types, rule, what the rule says)
            ("temperature", number, lambda v: v >= 0, ">= 0"),
            ("top_p", number, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("top_k", integer, lambda v: v >= 0, ">= 0 (0 means off)"),
            ("repetition_penalty", number, lambda v: v > 0, "> 0 (1 means off)"),
            ("n", integer, lambda v: v >= 1, ">= 1"),
            ("max_tokens", integer, lambda v: v >= 1, ">= 1"),
            ("seed", integer, lambda v: True, ""),
            ("logprobs", integer, lambda v: 0 <= v <= MAX_LOGPROBS, f"in 0..{MAX_LOGPROBS}"),
            ("prompt_logprobs", integer, lambda v: 0 <= v <= MAX_LOGPROBS,
             f"in 0..{MAX_LOGPROBS}"),
        ]
        for name, types, rule, says in checks:
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
                continue
            # Python's JSON reads Infinity and NaN: no rule here may hold for them.
            if isinstance(value, bool) or not isinstance(value, types) or not rule(value) or \
                    (isinstance(value, float) and not math.isfinite(value)):
                kind = "an integer" if types is integer else "a finite number"
                raise ConfigError(f"{name} must be {kind} {says}".rstrip() + f", got {value!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be a non-empty string or a list of them, "
                              f"got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes) -> "SamplingParams":
        return from_dict(SamplingParams, {**dataclasses.asdict(self), **changes})


def check_stop_token(params: SamplingParams, token: int, num_output_tokens: int,
                     eos_token_ids: tuple[int, ...]) -> str | None:
    """Finish reason after sampling `token` (the num_output_tokens-th), judged on ids alone."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length"
    return None


def apply_stop_strings(params: SamplingParams, text: str) -> tuple[str, bool, int]:
    """(visible text, hit a stop string, characters held back). The visible text ends before the
    earliest stop string; without a hit, a tail that is a prefix of some stop string is held back
    so a stream never shows text that a later token turns into a stop string."""
    hits = [index for index in (text.find(stop) for stop in params.stop) if index >= 0]
    if hits:
        return text[:min(hits)], True, 0
    held = 0
    for stop in params.stop:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return text[:len(text) - held], False, held
