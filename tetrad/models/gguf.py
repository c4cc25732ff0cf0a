"""The weights of a GGUF model folder (tetrad.store.gguf: model.gguf beside its config.json) as
tetrad parameters.

llama.cpp names a tensor by block (`blk.3.attn_q.weight`) and stores its dims innermost first; the
reader gives each as [rows, columns], which is torch's [out, in]. Q/K/V and gate/up are read apart
and concatenated as tetrad fuses them (tetrad.models.hf's rules). llama.cpp's converter reorders
the rows of a llama Q and K projection within each head, from HF's rotate-half layout to rotating
adjacent pairs; they are put back here, so the weights equal the HF model's (qwen2 files keep
HF's order: llama.cpp rotates their rows as NEOX does).

F32, F16 and BF16 tensors keep their values. A Q4_0 linear (blocks of 32 weights, w = d * (q - 8)
with one fp16 d per block) becomes an Int4Linear of group 32 with scale d and zero 8
(tetrad.models.quant), on one rank computing in bf16 or fp16: its 4-bit values are kept as they
are, and d is rounded to that dtype. Every other quantized tensor is dequantized at load, with one
warning line naming them and why: Q8_0's one scale per 32 values has no int8 kernel (torch's takes
one scale per output row), Q4_K's minimum per 32 values is no int4 zero point where its scale is
0, the embedding is a lookup, and tensor-parallel ranks split plain weights.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tetrad.errors import ConfigError
from tetrad.spec.gguf import FLOAT_TYPES, GGUF_FILE, metadata, open_gguf, tensor_type_name
from tetrad.spec.model import ModelConfig

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block; bytes: an fp16 d, then 16 of nibbles
INT4_DTYPES = (torch.bfloat16, torch.float16)


def is_gguf_folder(folder: Path) -> bool:
    return (folder / GGUF_FILE).is_file()


def tensor_sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """tetrad parameter -> the llama.cpp tensors concatenated (dim 0) to make it."""
    out = {"embed.weight": ("token_embd.weight",), "norm.weight": ("output_norm.weight",)}
    if not config.tie_embeddings:
        out["lm_head.weight"] = ("output.weight",)
    for i in range(config.num_layers):
        t, g = f"layers.{i}.", f"blk.{i}."
        out.update({t + "attn_norm.weight": (g + "attn_norm.weight",),
                    t + "mlp_norm.weight": (g + "ffn_norm.weight",),
                    t + "attn.out.weight": (g + "attn_output.weight",),
                    t + "attn.qkv.weight": tuple(f"{g}attn_{p}.weight" for p in "qkv"),
                    t + "mlp.up.weight": (g + "ffn_gate.weight", g + "ffn_up.weight"),
                    t + "mlp.down.weight": (g + "ffn_down.weight",)})
        if config.qkv_bias:
            out[t + "attn.qkv.bias"] = tuple(f"{g}attn_{p}.bias" for p in "qkv")
    return out


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's permute of a Q or K projection: HF row r of a head is the
    file's row 2r for the head's first half, 2(r - half) + 1 for its second."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _read(tensor) -> torch.Tensor:
    """One GGUF tensor as torch [out, in] (or [n]): float types as stored, others dequantized to
    fp32 by gguf.quants."""
    kind = tensor_type_name(tensor)
    data = np.asarray(tensor.data)
    if kind == "BF16":
        values = torch.from_numpy(data.copy()).view(torch.bfloat16)
    elif kind in FLOAT_TYPES:
        values = torch.from_numpy(data.copy())
    else:
        from gguf.quants import dequantize

        try:
            values = torch.from_numpy(dequantize(data, tensor.tensor_type))
        except NotImplementedError:
            raise ConfigError(f"GGUF tensor {tensor.name} has type {kind}, which tetrad cannot "
                              f"read (F32, F16, BF16 and the types gguf.quants dequantizes, "
                              f"Q8_0, Q4_0 and Q4_K among them)") from None
    return values.reshape([int(d) for d in reversed(tensor.shape)])


def gguf_tensors(config: ModelConfig, folder: Path, kept: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(tetrad name, tensor, where it came from) for every parameter of a model of `config` but
    the weights in `kept` (loaded quantized), after checking the file holds exactly the tensors
    the model needs."""
    file = folder / GGUF_FILE
    reader = open_gguf(file)
    tensors = checked_tensors(reader, config, file)
    permuted = metadata(reader, "general.architecture") == "llama"
    for target, names in tensor_sources(config).items():
        if target in kept:
            continue
        parts = [_read(tensors[name]) for name in names]
        if permuted and target.endswith("attn.qkv.weight"):
            parts[:2] = [part[rope_rows(part.shape[0], heads)] for part, heads
                         in zip(parts[:2], (config.num_heads, config.num_kv_heads))]
        if len({part.dtype for part in parts}) > 1:  # pieces of one parameter in two types
            parts = [part.float() for part in parts]
        yield target, torch.cat(parts), f"{' + '.join(names)} in {file}"


def checked_tensors(reader, config: ModelConfig, file: Path) -> dict:
    """The file's tensors by name, which must be exactly those a model of `config` needs."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    needed = {name for names in tensor_sources(config).values() for name in names}
    missing, unused = sorted(needed - tensors.keys()), sorted(tensors.keys() - needed)
    if missing or unused:
        raise ConfigError(f"{file} does not match its config.json: missing {missing[:3]}, "
                          f"unused {unused[:3]} (tetrad reads dense llama/qwen2 files)")
    return tensors


def q4_0_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 tensor's values (uint8 0..15, [rows, cols]) and block scales d (fp32,
    [rows, cols / 32]): block b of a row holds d, then 16 bytes whose low nibbles are its weights
    0..15 and high nibbles 16..31."""
    data = torch.from_numpy(np.asarray(tensor.data).copy())
    rows = data.shape[0]
    blocks = data.view(rows, -1, Q4_0_BYTES)
    scales = blocks[..., :2].contiguous().view(torch.float16).view(rows, -1).float()
    nibbles = blocks[..., 2:]
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(rows, -1)
    return values, scales


def load_gguf(folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
              single_rank: bool):
    """The model of a GGUF folder, on `device` in `dtype`: Q4_0 linears as Int4Linear (on a
    single rank computing in bf16/fp16), the rest as parameters, dequantized where quantized."""
    from tetrad.models.hf import _materialize
    from tetrad.models.transformer import Transformer

    file = folder / GGUF_FILE
    reader = open_gguf(file)
    tensors = checked_tensors(reader, config, file)
    with torch.device("meta"):
        model = Transformer(config)
    kept = set()
    if single_rank and dtype in INT4_DTYPES:
        for target, names in tensor_sources(config).items():
            if (target != "embed.weight" and target.endswith(".weight")
                    and all(tensor_type_name(tensors[name]) == "Q4_0" for name in names)):
                _keep_q4_0(model, target, [tensors[name] for name in names], config, device,
                           dtype, permuted=metadata(reader, "general.architecture") == "llama")
                kept.add(target)
    _warn_dequantized(file, tensors, config, kept, single_rank, dtype)
    _materialize(model, gguf_tensors(config, folder, frozenset(kept)), device, dtype)
    return model.eval()


def _keep_q4_0(model, target: str, parts: list, config: ModelConfig, device: torch.device,
               dtype: torch.dtype, permuted: bool) -> None:
    from tetrad.models.quant import Int4Linear

    blocks = [q4_0_blocks(part) for part in parts]
    if permuted and target.endswith("attn.qkv.weight"):
        blocks[:2] = [(values[rows], scales[rows]) for (values, scales), rows in zip(
            blocks[:2], (rope_rows(blocks[0][0].shape[0], config.num_heads),
                         rope_rows(blocks[1][0].shape[0], config.num_kv_heads)))]
    values = torch.cat([values for values, _ in blocks]).to(device)
    scales = torch.cat([scales for _, scales in blocks]).to(device)
    module_name = target.removesuffix(".weight")
    linear = model.get_submodule(module_name)
    # The bias, if any, is a parameter _materialize fills in like any other.
    bias = None if linear.bias is None else torch.empty_like(linear.bias)
    quantized = Int4Linear.from_quantized(values, scales, torch.full_like(scales, 8.0),
                                          Q4_0_BLOCK, bias=bias, dtype=dtype)
    parent, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent), child, quantized)


def _warn_dequantized(file: Path, tensors: dict, config: ModelConfig, kept: set[str],
                      single_rank: bool, dtype: torch.dtype) -> None:
    """One line: which quantized tensors are dequantized at load, and why."""
    counts: Counter = Counter()
    for target, names in tensor_sources(config).items():
        if target not in kept:
            counts.update(tensor_type_name(tensors[name]) for name in names
                          if tensor_type_name(tensors[name]) not in FLOAT_TYPES)
    if not counts:
        return
    reasons = []
    if not single_rank:
        reasons.append("quantized layers are kept by a single-rank engine only: tensor "
                       "parallelism splits plain weights")
    elif dtype not in INT4_DTYPES:
        reasons.append(f"the int4 kernels compute in bf16/fp16, not {str(dtype)[6:]}")
    if counts.keys() - {"Q4_0"}:
        reasons.append("only Q4_0 has an int4 layout here (Q8_0's scale per 32 values is no "
                       "int8 kernel's)")
    if counts["Q4_0"] and not reasons:
        reasons.append("the embedding is a lookup, not a matmul")
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
    print(f"warning: {file}: {kinds} tensors dequantized to {str(dtype)[6:]} at load "
          f"({'; '.join(reasons)})", file=sys.stderr)
