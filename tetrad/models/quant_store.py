"""A model stored already quantized (`tetrad create NAME --quantize int8|int4`, Ollama's
`create --quantize`): GPTQ runs once, when the model is stored, instead of at every load.

The folder is the source's HF folder with two changes: model.safetensors holds every tensor but
the blocks' projections (embeddings, norms, the LM head, biases, routers), and QUANTIZED_FILE
holds the projections' quantized values, whole (before any tensor-parallel cut), under tetrad's
module names:

    <projection>.values   int8: [N, K] int8;  int4: [N, K / 2] uint8, levels 0..15 two per byte
                          (even k in the low nibble)
    <projection>.grid     int8: scales [N];   int4: (scale, offset) pairs [K / group, N, 2]

in the dtype the model was calibrated in (the folder's config.json `dtype`), and the method in
the file's metadata. Loading it leaves the projections' 16-bit weights on the meta device until
quantize_model swaps them for layers built from the stored values, one projection at a time
(StoredProjections), so serving an int4 model never holds it in 16 bits, and the served values
are exactly those `--quantization` computes at load."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tetrad.errors import ConfigError
from tetrad.spec.serving import QUANTIZED_FILE

if TYPE_CHECKING:  # the quantizers import triton where it is installed: only a quantized load
    from tetrad.models.quant_calibrate import QuantizedWeight

FORMAT_VERSION = "1"


def save_quantized(whole: dict[str, "QuantizedWeight"], path: Path) -> None:
    """Write `whole` (whole_model_weights' projections, all of one method) to `path`."""
    from safetensors.torch import save_file

    from tetrad.models.quant import _pack_pairs

    methods = {weight.method for weight in whole.values()}
    if len(methods) != 1:
        raise ValueError(f"one quantization method per model, got {sorted(methods)}")
    tensors = {}
    for name, weight in whole.items():
        values = weight.values if weight.method == "int8" else _pack_pairs(weight.values)
        tensors[f"{name}.values"] = values.contiguous()
        tensors[f"{name}.grid"] = weight.grid.contiguous()
    save_file(tensors, str(path), metadata={"method": methods.pop(),
                                            "format_version": FORMAT_VERSION})


def stored_quantization(folder: str | Path) -> str | None:
    """The method a folder's projections are stored quantized in, None when they are not."""
    path = Path(folder) / QUANTIZED_FILE
    if not path.is_file():
        return None
    return _metadata(path)["method"]


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ConfigError(f"{path} is not a readable safetensors file ({error})") from None
    if metadata.get("format_version") != FORMAT_VERSION or metadata.get("method") not in (
            "int8", "int4"):
        raise ConfigError(f"{path} is not a tetrad quantized-weights file of format "
                          f"{FORMAT_VERSION} (metadata {metadata}): store the model again with "
                          f"this tetrad (`tetrad create --quantize`)")
    return metadata


class StoredProjections(Mapping):
    """A folder's stored projections by module name, each read from the file when asked for
    (int4's levels unpacked to a byte each only then): quantize_model builds one layer at a time,
    so the whole model's unpacked values are never in memory at once. `to(device, dtype)`: the
    values on `device` and the grids in `dtype` (the serving dtype) when read."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.path = Path(folder) / QUANTIZED_FILE
        self.method = _metadata(self.path)["method"]
        with safe_open(str(self.path), "pt") as file:
            self.names = sorted({key.rpartition(".")[0] for key in file.keys()})
        self.device, self.dtype = torch.device("cpu"), None

    @classmethod
    def of(cls, folder: str | Path) -> "StoredProjections | None":
        """The folder's stored projections; None when it is not stored quantized."""
        return cls(folder) if (Path(folder) / QUANTIZED_FILE).is_file() else None

    def weight_names(self) -> frozenset[str]:
        """The parameters (`<projection>.weight`) held here, not in 16 bits."""
        return frozenset(f"{name}.weight" for name in self.names)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "StoredProjections":
        self.device, self.dtype = torch.device(device), dtype
        return self

    def __getitem__(self, name: str) -> "QuantizedWeight":
        from safetensors import safe_open

        from tetrad.models.quant import _unpack_pairs
        from tetrad.models.quant_calibrate import QuantizedWeight

        if name not in self.names:
            raise KeyError(name)
        # Copies: a tensor safetensors gives may be a view of its mapping of the whole file,
        # which a layer holding it would keep mapped, every page read so far resident with it.
        with safe_open(str(self.path), "pt") as file:
            values, grid = file.get_tensor(f"{name}.values"), file.get_tensor(f"{name}.grid")
        if self.method == "int4":
            values = _unpack_pairs(values)
        return QuantizedWeight(self.method, values.to(self.device, copy=True),
                               grid.to(self.device, self.dtype or grid.dtype, copy=True))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def quantize_folder(source: Path, target: Path, method: str) -> None:
    """Write `source`'s model (an HF folder) into `target` stored quantized by `method`:
    model.safetensors without the projections, QUANTIZED_FILE, and config.json with the dtype
    the model was calibrated in (the 16-bit one it holds, bf16 for fp32 weights, as
    `--quantization` serves it). The other files (tokenizer, template) are the caller's."""
    import json

    from tetrad.models.hf import checkpoint_dtype, load_pretrained, to_hf_state_dict
    from tetrad.models.quant_model import whole_model_weights
    from tetrad.sharded_tensors import save_tensors
    from tetrad.spec.hf import read_hf_config

    dtype = checkpoint_dtype(source)
    dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    model = load_pretrained(source, "cpu", dtype)
    whole = whole_model_weights(model, method, dtype)
    held = frozenset(f"{name}.weight" for name in whole)
    save_tensors(to_hf_state_dict(model, held), target / "model.safetensors",
                 metadata={"format": "pt"})
    save_quantized(whole, target / QUANTIZED_FILE)
    hf = read_hf_config(source)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    hf.pop("torch_dtype", None)
    (target / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
