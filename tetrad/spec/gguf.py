"""GGUF files (llama.cpp's and Ollama's model format) read with the `gguf` package: opening one with
one-line errors, its metadata, and the HF config.json its metadata describes (torch-free; the
package imports numpy, inside these functions only, so `tetrad plan` never loads it).

Only the Llama family the engine runs is described: llama (GQA included; llama.cpp writes Mistral
as llama too) and qwen2. Their llama.cpp metadata keys map onto HF's config fields, so the model
folder a GGUF becomes (tetrad.store.gguf) goes through the same ModelConfig as an HF folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tetrad.errors import ConfigError

GGUF_FILE = "model.gguf"  # the weights of a model folder made from a GGUF file
ARCHITECTURES = ("llama", "qwen2")
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's metadata key (after "<arch>.") -> HF config.json field
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count")
# The float types whose tensors keep their dtype; every other type is quantized.
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over `path` (memory-mapped: nothing is read until used); a file that is
    not GGUF, or is cut short, is one ConfigError."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError("reading GGUF files needs the `gguf` package: pip install "
                          "'tetrad[serve]'") from None
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as error:
        # A short file ends inside the header (the reader indexes past it) or inside the tensor
        # data (numpy cannot map the view).
        raise ConfigError(f"{path} is not a readable GGUF file (truncated or damaged: "
                          f"{str(error)[:120] or type(error).__name__})") from None
    end = max((tensor.data_offset + tensor.n_bytes for tensor in reader.tensors), default=0)
    if end > reader.data.size:
        raise ConfigError(f"{path} is truncated: its tensors need {end} bytes, the file has "
                          f"{reader.data.size}")
    return reader


def metadata(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tensor_type_name(tensor) -> str:
    return tensor.tensor_type.name


def gguf_dtype(reader) -> str:
    """The dtype the model computes in: that of its float weight matrices, bf16 when they are all
    quantized (the int8/int4 kernels take bf16 activations)."""
    types = [tensor_type_name(t) for t in reader.tensors if len(t.shape) == 2]
    floats = [FLOAT_TYPES[name] for name in types if name in FLOAT_TYPES]
    return max(set(floats), key=floats.count) if floats else "bfloat16"


def hf_config_from_gguf(reader, source: str) -> dict[str, Any]:
    """The HF config.json of the model `reader`'s metadata describes; one ConfigError for a model
    tetrad cannot run (another architecture, experts, rope scaling)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported (tetrad reads "
                          f"{', '.join(ARCHITECTURES)} GGUF files)")
    missing = [key for key in REQUIRED_KEYS if f"{arch}.{key}" not in reader.fields]
    if missing:
        raise ConfigError(f"{source} lacks the metadata {arch}.{missing[0]}: not a complete "
                          f"{arch} GGUF file")
    if metadata(reader, f"{arch}.expert_count", 0):
        raise ConfigError(f"{source}: mixture-of-experts GGUF files are not supported (its "
                          f"experts are stacked 3D tensors): use the model's HF folder")
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ConfigError(f"{source}: rope scaling {scaling!r} is not supported (tetrad runs "
                          f"plain rope for {arch})")
    names = {tensor.name for tensor in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConfigError(f"{source} has no token_embd.weight tensor: not a {arch} model file")
    hf: dict[str, Any] = {"model_type": arch, "architectures": [ARCH_CLASSES[arch]],
                          "vocab_size": int(embedding.shape[1]), "hidden_act": "silu",
                          "tie_word_embeddings": "output.weight" not in names,
                          "dtype": gguf_dtype(reader)}
    for key, field in CONFIG_KEYS.items():
        value = metadata(reader, f"{arch}.{key}")
        if isinstance(value, float):  # a float32 in the file: its shortest decimal, 1e-05
            import numpy

            value = float(str(numpy.float32(value)))
        if value is not None:
            hf[field] = value
    if arch == "qwen2":
        hf["use_sliding_window"] = False
    elif "blk.0.attn_q.bias" in names:
        hf["attention_bias"] = True  # which loading refuses, as for an HF llama folder
    for which in ("bos", "eos"):
        token = metadata(reader, f"tokenizer.ggml.{which}_token_id")
        if token is not None:
            hf[f"{which}_token_id"] = token
    return hf
