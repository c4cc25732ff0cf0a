"""The Ollama API as the server speaks it: request bodies, the fields of Ollama's that tetrad
refuses (each named, with what to do instead), the timing fields of a finished answer, and how a
model is described (/api/tags, /api/show, /api/ps)."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from tetrad.errors import ConfigError, TetradError
from tetrad.inference.core.output import RequestOutput
from tetrad.inference.entrypoints.api import check_text
from tetrad.spec.hf import hf_model_type
from tetrad.spec.model import ModelConfig

OLLAMA_TYPES = ConfigDict(extra="ignore", strict=True)


class ModelRequest(BaseModel):
    """/api/show, /api/delete, /api/pull: a model's name (Ollama's older clients send `name`)."""

    model_config = OLLAMA_TYPES
    model: str | None = None
    name: str | None = None
    stream: bool = True  # /api/pull's progress lines
    insecure: bool = False

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise ConfigError("model is required: send {\"model\": NAME}")
        return name


class Completion(BaseModel):
    """What /api/generate and /api/chat share."""

    model_config = OLLAMA_TYPES
    model: str
    stream: bool = True  # Ollama streams unless told not to
    options: dict | None = None
    format: str | dict | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("options")
    @classmethod
    def _options_text(cls, value):
        return check_text(value, "options")

    def refuse_unsupported(self, extra: dict[str, str] | None = None) -> None:
        """A TetradError naming the first field set that tetrad cannot follow."""
        refused = {
            "format": "format (JSON or a schema) is not supported: tetrad does not constrain "
                      "decoding, so it cannot promise JSON; ask for JSON in the prompt",
            "think": "think is not supported: tetrad's models have no thinking mode",
            "logprobs": "logprobs are not supported on the Ollama API: use /v1/completions "
                        "or /v1/chat/completions with logprobs",
            "top_logprobs": "top_logprobs are not supported on the Ollama API: use "
                            "/v1/chat/completions with logprobs and top_logprobs",
            **(extra or {})}
        for field, message in refused.items():
            if getattr(self, field) not in (None, False, "", [], {}):
                raise TetradError(message)


class GenerateRequest(Completion):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None  # the ids a previous answer's `context` gave back
    suffix: str | None = None
    template: str | None = None
    images: list | None = None

    @field_validator("prompt", "system")
    @classmethod
    def _prompt_text(cls, value):
        return check_text(value, "prompt")

    def check(self) -> None:
        self.refuse_unsupported({
            "suffix": "suffix (fill in the middle) is not supported",
            "template": "template per request is not supported: store the model with a TEMPLATE "
                        "(tetrad create NAME -f Modelfile) or send raw: true with the whole "
                        "prompt",
            "images": "images are not supported: tetrad serves text models"})
        if self.raw and self.system:
            raise TetradError("system has no place in a raw prompt: put it into the prompt")


class ChatRequest(Completion):
    messages: list[dict] = []
    tools: list | None = None

    @field_validator("messages")
    @classmethod
    def _message_text(cls, value):
        return check_text(value, "messages")

    def check(self) -> None:
        self.refuse_unsupported({"tools": "tools are not supported: tetrad's chat has no tool "
                                          "calling"})
        if any(message.get("images") for message in self.messages if isinstance(message, dict)):
            raise TetradError("images are not supported: tetrad serves text models")


class EmbedRequest(BaseModel):
    model_config = OLLAMA_TYPES
    model: str
    input: str | list[str] = []
    prompt: str | None = None  # the legacy /api/embeddings
    truncate: bool = True
    dimensions: int | None = None
    options: dict | None = None
    keep_alive: float | str | None = None

    @field_validator("input", "prompt")
    @classmethod
    def _input_text(cls, value):
        return check_text(value, "input")


def timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes created_at and expires_at."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def done_fields(output: RequestOutput, started: float, load_seconds: float) -> dict:
    """The final chunk's fields: why it ended, and Ollama's durations in ns. Prompt evaluation
    runs from the request's arrival in the engine to its first token (waiting in the queue
    included), evaluation from there to its last; total from the HTTP request's start (model
    load and tokenizing included)."""
    first = output.first_token_time or output.finish_time
    finish = output.finish_time or first
    return {"done": True, "done_reason": output.outputs[0].finish_reason,
            "total_duration": nanoseconds(time.perf_counter() - started),
            "load_duration": nanoseconds(load_seconds),
            "prompt_eval_count": len(output.prompt_token_ids),
            "prompt_eval_duration": nanoseconds(first - output.arrival_time),
            "eval_count": len(output.outputs[0].token_ids),
            "eval_duration": nanoseconds(finish - first)}


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 8.0B, 135.1M, 12.5K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def family(config: ModelConfig) -> str:
    """The HF model_type the config exports as (llama, qwen2, ...), else the config's name."""
    try:
        return hf_model_type(config)
    except ConfigError:
        return config.name


def level(served, manifest: dict | None) -> str | None:
    """What /api/show's quantization_level names: the served model's quantization, else its
    dtype; a model not loaded, what the store says it was quantized to (None: unknown)."""
    if served is not None:
        config = served.llm.config
        return config.dtype if config.quantization == "none" else config.quantization
    return manifest.get("quantization") if manifest else None


def details(config: ModelConfig, dtype: str | None, weights_format: str) -> dict:
    from tetrad.planner.model_stats import count_parameters

    return {"parent_model": "", "format": weights_format, "family": family(config),
            "families": [family(config)], "parameter_size": parameter_size(
                count_parameters(config)),
            "quantization_level": (dtype or "").upper()}


def model_info(config: ModelConfig) -> dict:
    """GGUF's metadata keys, as /api/show's model_info lists them."""
    from tetrad.planner.model_stats import count_parameters

    arch = family(config)
    return {"general.architecture": arch, "general.parameter_count": count_parameters(config),
            f"{arch}.context_length": config.max_seq_len,
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_layers,
            f"{arch}.feed_forward_length": config.ffn_hidden_size,
            f"{arch}.attention.head_count": config.num_heads,
            f"{arch}.attention.head_count_kv": config.num_kv_heads or config.num_heads,
            f"{arch}.vocab_size": config.vocab_size}


def folder_format(folder: Path) -> str:
    return "gguf" if any(folder.glob("*.gguf")) else "safetensors"


def digest(manifest: dict | None, folder: Path) -> str:
    """sha256 of a stored model's manifest (its source, settings and creation time: a model
    stored again under its name gets another digest); of its folder's path for a folder served
    as it is."""
    data = json.dumps(manifest, sort_keys=True) if manifest else str(folder.resolve())
    return hashlib.sha256(data.encode()).hexdigest()


def created_at(manifest: dict | None, folder: Path) -> str:
    """When `tetrad create` stored the model (its manifest's time), else the folder's mtime."""
    if manifest:
        stored = datetime.strptime(manifest["created"], "%Y-%m-%dT%H:%M:%S%z")
        return timestamp(stored.timestamp())
    return timestamp(folder.stat().st_mtime)


def parameters_text(modelfile: str) -> str:
    """/api/show's `parameters`: the Modelfile's PARAMETER lines without the keyword."""
    return "\n".join(line[len("PARAMETER "):] for line in modelfile.splitlines()
                     if line.startswith("PARAMETER "))
