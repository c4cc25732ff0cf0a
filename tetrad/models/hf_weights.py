"""An HF folder's safetensors, tensor by tensor (tetrad.models.hf maps them onto a model)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tetrad.errors import ConfigError, read_json_file
from tetrad.models.fp8 import BLOCK
from tetrad.models.hf_fp8 import SCALE_SUFFIX, read_weight, scale_names

# Floating dtypes a stored tensor is converted from a slice at a time (safetensors' names).
STORED_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                 "BF16": torch.bfloat16}
# Stored bytes per slice: the largest transient copy a conversion at load makes.
CONVERT_SLICE_BYTES = 4 << 20


class HFWeights:
    """An HF folder's tensors (model.safetensors, or the shards its index lists), read one at a
    time through a handle each (a handle's file mapping keeps every page it read resident), so
    that peak memory stays near one copy of the model. DeepSeek's FP8 weights come dequantised
    per `block` (tetrad.models.hf_fp8), weight_scale_inv folded in, or with `keep_fp8` as
    FP8Weight."""

    def __init__(self, folder: Path, device: torch.device | str = "cpu", block: int = BLOCK,
                 keep_fp8: bool = False):
        self.block, self.keep_fp8 = block, keep_fp8
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_file(index, "safetensors index", "save_pretrained")
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                    for name in weight_map.values()):
                raise ConfigError(f"{index} must map tensor names to file names in its folder")
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ConfigError(
                f"{folder} has no model.safetensors (nor model.safetensors.index.json): there are "
                f"no weights to load. Train from random init with `tetrad train --model {folder}`,"
                f" or convert .bin weights with transformers' save_pretrained")
        self.device, self._files = str(device), {}  # tensor name -> its file
        for name in files:
            if not (folder / name).is_file():
                raise ConfigError(f"shard {name} listed in {index} is missing")
            with safe_open(str(folder / name), framework="pt", device=self.device) as handle:
                self._files.update(dict.fromkeys(handle.keys(), str(folder / name)))
        self._keys = set(self._files)

    def names(self) -> set[str]:
        return self._keys - scale_names(self._keys)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name`, a floating one without FP8 block scales in `dtype` if given (else as
        stored)."""
        if dtype is not None and name + SCALE_SUFFIX not in self._keys:
            return self._read(name, dtype)
        return read_weight(self._read, name, self._keys, self.block, self.keep_fp8)

    def _read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor as stored, or a floating one converted to `dtype` a few rows at a time
        into its own tensor: converting it whole would hold the stored copy beside it (a 32 MB
        fp32 embedding read for a bf16 model is 48 MB at once, not 20)."""
        with safe_open(self._files[key], framework="pt", device=self.device) as handle:
            if dtype is None:
                return handle.get_tensor(key)
            stored = handle.get_slice(key)
            shape, stored_dtype = stored.get_shape(), STORED_FLOATS.get(stored.get_dtype())
            if stored_dtype in (None, dtype) or not shape:
                return handle.get_tensor(key)
            converted = torch.empty(shape, dtype=dtype, device=self.device)
            row_bytes = max(1, converted[0].numel() * stored_dtype.itemsize)
            rows = max(1, CONVERT_SLICE_BYTES // row_bytes)
            for start in range(0, shape[0], rows):
                converted[start:start + rows] = stored[start:start + rows]
            return converted

    def first(self) -> torch.Tensor:
        return self.get(next(iter(self._files)))
