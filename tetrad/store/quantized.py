"""`tetrad create --quantize`: which sources can be stored quantized, and the stored folder's
weights replaced by the quantized ones (torch-free: the quantizer itself, which needs torch, is
passed in; tetrad.models.quant_store.quantize_folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tetrad.errors import ConfigError
from tetrad.spec.gguf import GGUF_FILE
from tetrad.spec.serving import QUANTIZATIONS, QUANTIZED_FILE
from tetrad.store.gguf import is_gguf_file


def check_quantizable_source(source: Path, method: str) -> None:
    """`tetrad create --quantize` reads 16-bit (or fp32) weights of an HF folder."""
    if method not in QUANTIZATIONS or method == "none":
        raise ConfigError(f"--quantize {method}: use int8 or int4")
    if is_gguf_file(source):
        raise ConfigError(f"--quantize {method}: {source.name} is a GGUF file, whose weights "
                          f"are stored as the file has them (Q8_0 / Q4_0 already quantized): "
                          f"create it without --quantize")
    if (source / QUANTIZED_FILE).is_file():
        raise ConfigError(f"--quantize {method}: {source} is stored quantized already; "
                          f"quantize from its 16-bit weights")
    if not (source / "config.json").is_file() or (source / GGUF_FILE).is_file():
        raise ConfigError(f"--quantize {method}: {source} is not an HF model folder (config.json "
                          f"and safetensors); export a tetrad checkpoint first (tetrad export)")


def store_quantized(staging: Path, source: Path, method: str,
                    quantize_folder: Callable[[Path, Path, str], None]) -> None:
    """In a folder assembled from `source`, the linked weights and config.json replaced by
    `quantize_folder`'s quantized ones."""
    for linked in (*staging.glob("*.safetensors*"), staging / "config.json"):
        linked.unlink()  # links to the source's: replaced, not written through
    quantize_folder(source, staging, method)
