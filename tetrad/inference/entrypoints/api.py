"""The OpenAI API as the server speaks it: request bodies (strictly typed, as OpenAI checks them:
`"max_tokens": "10"` is an error, not 10), the server's limits, error bodies, and log-probabilities
in the shapes of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

from tetrad.errors import TetradError
from tetrad.inference.core.output import TokenLogprob
from tetrad.inference.core.params import SamplingParams
from tetrad.spec.serving import ServerConfig  # the limits requests are held to


class ApiError(TetradError):
    """A request the server refuses, with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers


def error_json(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_json(message, kind), status_code=status, headers=headers)


def check_text(value, where: str):
    """Strings from JSON may hold lone UTF-16 surrogates ("\\ud800"), which no tokenizer can
    encode: refuse them here with a 400 rather than fail deep inside."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"{where} holds a character that is not valid UTF-8 "
                             f"({value[error.start]!a} at {error.start}): send text "
                             f"without lone surrogates") from None
    elif isinstance(value, dict):
        for item in value.values():
            check_text(item, where)
    elif isinstance(value, list) and set(map(type, value)) - {int}:  # ids hold no text (a C loop)
        for item in value:
            check_text(item, where)
    return value


class SamplingFields(BaseModel):
    # Strict: a number in a string is a type error, as in OpenAI's API. Unknown fields (user,
    # ...) are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

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
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value):
        return check_text(value, "stop")

    def stop_strings(self, limits: ServerConfig) -> tuple[str, ...]:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > limits.max_stop_strings:
            raise ApiError(400, f"{len(stop)} stop strings: at most {limits.max_stop_strings} "
                                f"are allowed (tetrad serve --max-stop-strings)")
        return stop

    def sampling_params(self, limits: ServerConfig, extra_stop: tuple[str, ...] = (),
                        defaults: dict | None = None, **fields) -> SamplingParams:
        """The engine's parameters: the body's; `defaults` (a stored model's Modelfile
        PARAMETERs, as SamplingParams fields) for the fields the body leaves out; then `fields`
        (logprobs, ...), which the server derives."""
        if self.presence_penalty or self.frequency_penalty:
            raise TetradError("presence_penalty and frequency_penalty are not supported: use "
                              "repetition_penalty")
        if self.logit_bias:  # refused rather than ignored: the answer would not follow it
            raise TetradError("logit_bias is not supported")
        values = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "repetition_penalty": self.repetition_penalty, "max_tokens": self.max_tokens,
                  "stop": self.stop_strings(limits), "seed": self.seed, "n": self.n,
                  "ignore_eos": self.ignore_eos}
        values.update({key: value for key, value in (defaults or {}).items()
                       if key not in self.model_fields_set})
        values.update(fields)
        return SamplingParams(**{**values, "stop": tuple(values["stop"]) + extra_stop})


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top log-probabilities per token (0: only the chosen token's)
    echo: bool = False  # the prompt before the completion (with its log-probabilities)

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value):
        return check_text(value, "prompt")


class ChatRequest(SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("messages")
    @classmethod
    def _message_text(cls, value):
        return check_text(value, "messages")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # tetrad's tokenizers add none either way

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value):
        return check_text(value, "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class TokenText:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(scores: list[TokenLogprob | None], token_ids: list[int], text: TokenText,
                        offset: int) -> tuple[dict, int]:
    """The legacy completions shape {tokens, token_logprobs, top_logprobs, text_offset}, from
    character `offset` on; and the offset after the last token. None scores (the first prompt
    token) give null entries, as OpenAI's echo does."""
    shape = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, scored in zip(token_ids, scores):
        token = text(token_id)
        shape["tokens"].append(token)
        shape["text_offset"].append(offset)
        offset += len(token)
        shape["token_logprobs"].append(None if scored is None else scored.logprob)
        shape["top_logprobs"].append(None if scored is None else {
            text(rival): logprob for rival, logprob in scored.top})
    return shape, offset


def chat_logprobs(scores: list[TokenLogprob], text: TokenText) -> dict:
    """The chat shape {content: [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(s.token_id, s.logprob),
                         "top_logprobs": [entry(rival, logprob) for rival, logprob in s.top]}
                        for s in scores]}
