"""Ollama's request `options` -> the engine's sampling fields (torch- and HTTP-free).

Ollama's names map onto SamplingParams as its Modelfile PARAMETERs do (tetrad/store/modelfile.py):
num_predict is max_tokens (-1: up to the context), repeat_penalty is repetition_penalty (HF's
rule), stop is the stop strings. num_ctx cannot reload the model with another context, as Ollama
does: it is held to the context the server loaded and caps prompt plus answer at that many tokens.
Every other option Ollama knows (mirostat, num_thread, ...) is refused by name, as is a name it
does not know, with the close match when there is one: an option silently ignored would give an
answer that does not follow it.
"""

from __future__ import annotations

import difflib
import math

from tetrad.errors import ConfigError
from tetrad.inference.core.params import SamplingParams

# Ollama's name -> (SamplingParams field, the JSON types it takes). num_ctx is handled apart.
SAMPLING_OPTIONS: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_k": ("top_k", (int,)),
    "top_p": ("top_p", (int, float)),
    "repeat_penalty": ("repetition_penalty", (int, float)),
    "seed": ("seed", (int,)),
    "num_predict": ("max_tokens", (int,)),
    "stop": ("stop", (list, str)),
}
NUM_CTX = "num_ctx"
SUPPORTED = (*SAMPLING_OPTIONS, NUM_CTX)
# The rest of Ollama's options (its api/types.go Options and Runner): known, not followed.
UNSUPPORTED = ("num_keep", "typical_p", "repeat_last_n", "presence_penalty", "frequency_penalty",
               "penalize_newline", "min_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta",
               "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
               "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread")


def sampling_options(options: dict | None, max_model_len: int) -> tuple[dict, int | None]:
    """(SamplingParams fields the options set, num_ctx or None); a ConfigError naming the first
    option that is unknown, not supported, or of a wrong value."""
    fields, num_ctx = {}, None
    for name, value in (options or {}).items():
        if name == NUM_CTX:
            num_ctx = _num_ctx(value, max_model_len)
            continue
        if name not in SAMPLING_OPTIONS:
            raise ConfigError(_refusal(name))
        field, types = SAMPLING_OPTIONS[name]
        if value is None:  # JSON null: the option left out
            continue
        if isinstance(value, bool) or not isinstance(value, types) or (
                isinstance(value, float) and not math.isfinite(value)):
            kinds = {(int,): "an integer", (int, float): "a number",
                     (list, str): "a string or a list of strings"}[types]
            raise ConfigError(f"options.{name} must be {kinds}, got {str(value)[:64]}")
        if name == "num_predict" and value < 0:  # Ollama's -1 (and -2): up to the context
            value = None
        elif name == "num_predict" and value == 0:
            raise ConfigError("options.num_predict 0 asks for no tokens: use 1 or more, or -1 "
                              "(up to the context)")
        try:
            SamplingParams(**{field: value})
        except ConfigError as error:
            raise ConfigError(f"options.{name}: {error}") from None
        fields[field] = value
    return fields, num_ctx


def _num_ctx(value, max_model_len: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"options.num_ctx must be an integer of 1 or more, got "
                          f"{str(value)[:64]}")
    if value > max_model_len:
        raise ConfigError(f"options.num_ctx {value} exceeds the context this server loaded the "
                          f"model with ({max_model_len} tokens): the context is set at load "
                          f"(tetrad serve --max-model-len, or PARAMETER num_ctx)")
    return value


def _refusal(name: str) -> str:
    supported = ", ".join(SUPPORTED)
    if name in UNSUPPORTED:
        return f"options.{name} is not supported by tetrad: it follows {supported}"
    close = difflib.get_close_matches(name, (*SUPPORTED, *UNSUPPORTED), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown option {str(name)[:64]!r}{hint}: tetrad follows {supported}"
