"""HF safetensors <-> tetrad parameters, and loading a pretrained model from a folder.

One table of rules per HF family serves both directions: a rule names a tetrad parameter and the
HF tensors that, concatenated along dim 0, make it (tetrad fuses Q/K/V and gate/up; HF keeps them
apart). GPT-2 stores its Conv1D weights as [in, out], so its rules transpose.

Mixtral: transformers 5.x fuses the experts in memory (`mlp.experts.gate_up_proj`), but its
`save_pretrained` still writes the per-expert `block_sparse_moe.experts.{e}.w1/w3/w2` names, which
are the names read and written here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tetrad.spec.model import ModelConfig, from_dict
from tetrad.errors import ConfigError, read_json_file
from tetrad.spec.hf import (hf_from_model_config, hf_model_type, model_config_from_hf,
                              read_hf_config, resolve_checkpoint, rope_scaling_parameters,
                              rope_scaling_type)
from tetrad.models.fp8_weights import FP8WeightLinear
from tetrad.models.gguf import is_gguf_folder, load_gguf
from tetrad.models.hf_deepseek import check_deepseek_support, deepseek_rules, is_extra_layer
from tetrad.models.hf_fp8 import (QUANTIZATION_CONFIG, UNQUANTIZED_DTYPE, FP8Weight,
                                  block_size, quantize_state_dict)
from tetrad.models.hf_rules import Rule
from tetrad.models.hf_weights import HFWeights
from tetrad.models.quant_store import StoredProjections
from tetrad.models.rope import make_rotary
from tetrad.models.skeleton import empty_model
from tetrad.models.transformer import Transformer
from tetrad.sharded_tensors import ShardedReader, save_tensors

RUNTIME_TYPES = ("llama", "qwen2", "mistral", "mixtral", "gpt2", "deepseek_v3")
# Buffers some exporters save that carry no learned weights: rotary frequencies, GPT-2's mask.
IGNORED = re.compile(r"rotary_emb\.inv_freq$|\.attn\.(masked_)?bias$")


def rules(config: ModelConfig, model_type: str, prefix: str = "transformer.",
          rope_interleave: bool = True) -> list[Rule]:
    """The mapping for one model. `prefix` is GPT-2's: its base-model checkpoints have none;
    `rope_interleave` DeepSeek's (its rope dims rotate in adjacent pairs)."""
    if model_type == "gpt2":
        return _gpt2_rules(config, prefix)
    if model_type == "deepseek_v3":
        return deepseek_rules(config, rope_interleave)
    return _llama_rules(config)


def _llama_rules(config: ModelConfig) -> list[Rule]:
    out = [Rule("embed.weight", ("model.embed_tokens.weight",)),
           Rule("norm.weight", ("model.norm.weight",))]
    if not config.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    qkv_sizes = (config.q_size, config.kv_size, config.kv_size)
    for i in range(config.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        out += [Rule(t + "attn_norm.weight", (h + "input_layernorm.weight",)),
                Rule(t + "mlp_norm.weight", (h + "post_attention_layernorm.weight",)),
                Rule(t + "attn.out.weight", (h + "self_attn.o_proj.weight",))]
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            out.append(Rule(f"{t}attn.qkv.{kind}",
                            tuple(f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"), qkv_sizes))
        if config.is_moe_layer(i):
            moe, ffn = h + "block_sparse_moe.", config.moe_ffn_hidden_size
            out.append(Rule(t + "mlp.router.gate.weight", (moe + "gate.weight",)))
            for e in range(config.num_experts):
                expert = f"{moe}experts.{e}."
                out += [Rule(f"{t}mlp.experts.{e}.up.weight",
                             (expert + "w1.weight", expert + "w3.weight"), (ffn, ffn)),
                        Rule(f"{t}mlp.experts.{e}.down.weight", (expert + "w2.weight",))]
        else:
            ffn = config.ffn_hidden_size
            out += [Rule(t + "mlp.up.weight",
                         (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), (ffn, ffn)),
                    Rule(t + "mlp.down.weight", (h + "mlp.down_proj.weight",))]
    return out


def _gpt2_rules(config: ModelConfig, prefix: str) -> list[Rule]:
    out = [Rule("embed.weight", (prefix + "wte.weight",)),
           Rule("pos_embed.weight", (prefix + "wpe.weight",)),
           Rule("norm.weight", (prefix + "ln_f.weight",)),
           Rule("norm.bias", (prefix + "ln_f.bias",))]
    if not config.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    pairs = (("attn_norm", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
             ("attn.out", "attn.c_proj", True), ("mlp_norm", "ln_2", False),
             ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True))
    for i in range(config.num_layers):
        for ours, theirs, conv1d in pairs:
            for kind in ("weight", "bias"):
                out.append(Rule(f"layers.{i}.{ours}.{kind}", (f"{prefix}h.{i}.{theirs}.{kind}",),
                                transpose=conv1d and kind == "weight"))
    return out


def check_runtime_support(hf: dict[str, Any]) -> None:
    """Reject HF configs whose numerics the tetrad layers do not reproduce (the planner may still
    read them through tetrad.spec.hf)."""
    model_type = hf.get("model_type")
    if model_type not in RUNTIME_TYPES:
        raise ConfigError(f"cannot load HF model_type {model_type!r} weights "
                          f"(supported: {', '.join(RUNTIME_TYPES)})")
    rope_type = rope_scaling_type(hf)
    if model_type == "deepseek_v3":
        check_deepseek_support(hf, rope_scaling_parameters(hf))
        return
    if rope_type != "default":
        raise ConfigError(f"rope scaling {rope_type!r} is not supported for {model_type}: "
                          f"tetrad implements plain rope (and yarn for deepseek_v3)")
    if model_type == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation {hf['activation_function']!r} is not supported "
                              f"(tetrad uses the tanh GELU, gelu_new)")
        if hf.get("scale_attn_by_inverse_layer_idx"):
            raise ConfigError("GPT-2 scale_attn_by_inverse_layer_idx is not supported")
        return
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ConfigError("llama attention_bias / mlp_bias are not supported: tetrad has biases "
                          "on Q/K/V only (qwen2) or on every linear (gpt2)")


def has_hf_weights(folder: str | Path) -> bool:
    folder = Path(folder)
    return ((folder / "model.safetensors").is_file()
            or (folder / "model.safetensors.index.json").is_file())


def _hf_tensors(config: ModelConfig, folder: Path, device: torch.device | str = "cpu",
                keep_fp8: bool = False, dtype: torch.dtype | None = None,
                held: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor | FP8Weight, str]]:
    """(tetrad name, tensor on `device` in `dtype` (None: as stored), where it came from) for
    every parameter of a model of `config` but those `held` quantized (quant_store), one at a
    time, after checking that the folder's tensors are exactly the ones the model needs. With
    `keep_fp8` a weight whose pieces are all FP8 comes as one FP8Weight; FP8 pieces otherwise
    come dequantised (fp32)."""
    hf = read_hf_config(folder)
    check_runtime_support(hf)
    weights = HFWeights(folder, device, block_size(hf), keep_fp8)
    names = weights.names()
    prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    model_rules = [rule for rule in rules(config, hf["model_type"], prefix,
                                          hf.get("rope_interleave", True))
                   if rule.tetrad not in held]
    missing = [name for rule in model_rules for name in rule.hf if name not in names]
    if missing:
        raise ConfigError(f"{folder} lacks {len(missing)} tensors the model needs (e.g. "
                          f"{', '.join(missing[:3])}): the weights do not match the model config "
                          f"(number of layers or experts, tied embeddings?)")
    used = {name for rule in model_rules for name in rule.hf}
    # Some exporters save lm_head next to the embedding it is tied to: a harmless duplicate.
    if config.tie_embeddings:
        used.add("lm_head.weight")
    unused = sorted(name for name in names - used
                    if not (IGNORED.search(name) or is_extra_layer(name, config, hf)))
    if unused:
        raise ConfigError(f"{folder} has {len(unused)} tensors the model does not use (e.g. "
                          f"{', '.join(unused[:3])}): the weights do not match the model config")
    for rule in model_rules:
        parts = [weights.get(name, dtype) for name in rule.hf]
        if not rule.transpose and all(isinstance(p, FP8Weight) for p in parts):
            yield rule.tetrad, FP8Weight.concatenated(parts, rule.rows), f"{rule.hf} in {folder}"
            continue
        parts = [p.dequantized() if isinstance(p, FP8Weight) else p for p in parts]
        tensor = torch.cat([p.t() if rule.transpose else p for p in parts])
        if rule.rows:
            tensor = tensor[list(rule.rows)]
        yield rule.tetrad, tensor, f"{' + '.join(rule.hf)} in {folder}"


def load_hf_weights(model: Transformer, folder: str | Path) -> None:
    """Copy the HF weights in `folder` into `model`, whose config must match their shapes."""
    params = model.state_dict()
    with torch.no_grad():
        for name, tensor, source in _hf_tensors(model.config, Path(folder)):
            _check_shape(params[name], tensor, name, source)
            params[name].copy_(tensor)


def _check_shape(param: torch.Tensor, tensor: torch.Tensor, name: str, source: str) -> None:
    if param.shape != tensor.shape:
        raise ConfigError(f"{name}: the model expects shape {tuple(param.shape)} but {source} "
                          f"gives {tuple(tensor.shape)}: the weights do not match the model config")


def to_hf_state_dict(model: Transformer, held: frozenset[str] = frozenset()
                     ) -> dict[str, torch.Tensor]:
    """tetrad parameters -> HF tensors (contiguous copies, as safetensors wants), but for the
    parameters `held` quantized (quant_store)."""
    config = model.config
    params = model.state_dict()
    out = {}
    # DeepSeek's rope rows are written as tetrad holds them (its config says rope_interleave
    # false), so the rules read them in place.
    for rule in rules(config, hf_model_type(config), rope_interleave=False):
        if rule.tetrad in held:
            continue
        tensor = params[rule.tetrad].detach()
        pieces = tensor.split(list(rule.sizes)) if rule.sizes else (tensor,)
        for name, piece in zip(rule.hf, pieces, strict=True):
            piece = piece.t() if rule.transpose else piece
            out[name] = piece.clone(memory_format=torch.contiguous_format)
    return out


def save_hf(model: Transformer, folder: str | Path, eos_id: int | None = None,
            dtype: str = "auto") -> None:
    """Write config.json and model.safetensors that transformers' from_pretrained loads.
    `eos_id` is the tokenizer's end-of-text id, which HF generation stops at. `dtype`: "auto"
    (as the model holds them), "fp32", "bf16", or "fp8" (DeepSeek-V3's block-scaled layout,
    tetrad.models.hf_fp8)."""
    folder = Path(folder)
    hf = hf_from_model_config(model.config)  # raises first when the model has no HF form
    tensors = to_hf_state_dict(model)
    if dtype == "fp8":
        if hf["model_type"] == "gpt2":
            raise ConfigError("--dtype fp8 export needs [out, in] linear weights: GPT-2's "
                              "Conv1D layout has no FP8 checkpoint form (export fp32 or bf16)")
        tensors = quantize_state_dict(tensors)
        hf["quantization_config"] = dict(QUANTIZATION_CONFIG)
    elif dtype != "auto":
        cast = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        tensors = {name: tensor.to(cast) for name, tensor in tensors.items()}
    stored = "bfloat16" if dtype == "fp8" else str(next(iter(tensors.values())).dtype)
    folder.mkdir(parents=True, exist_ok=True)
    # Explicit token ids, else transformers fills in its per-family defaults (GPT-2's 50256),
    # which name tokens of a different vocabulary.
    hf.update(bos_token_id=None, eos_token_id=eos_id, dtype=stored.removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_tensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _checkpoint_tensors(names: set[str], folder: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """A tetrad checkpoint's parameters (tetrad names, saved in pieces by any layout), one at a
    time, as _hf_tensors gives an HF folder's, after checking they are exactly `names`."""
    stored = ShardedReader(folder).tensors("model")
    missing, unused = sorted(names - set(stored)), sorted(set(stored) - names)
    if missing or unused:
        raise ConfigError(f"checkpoint {folder} does not match its model.json: missing "
                          f"{missing[:3]}, unused {unused[:3]}")
    for name in stored:
        yield name, stored[name], str(folder)


def _parameter_names(config: ModelConfig) -> set[str]:
    return {name for name, _ in empty_model(config).named_parameters()}


def _materialize(model: Transformer,
                 tensors: Iterator[tuple[str, torch.Tensor | FP8Weight, str]],
                 device: torch.device, dtype: torch.dtype | None,
                 held: frozenset[str] = frozenset()
                 ) -> None:
    """Give a model built on the meta device its parameters, each read once and put straight on
    `device` in `dtype` (None: as stored): no random init, no full-precision copy. An FP8Weight
    replaces its linear with an FP8WeightLinear computing in `dtype`. The parameters `held`
    quantized elsewhere stay on the meta device, in `dtype`, until quantize_model replaces
    them: no memory ever holds them in 16 bits."""
    params = dict(model.named_parameters())
    for name in held:
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name).register_parameter(leaf, nn.Parameter(
            params[name].to(dtype), requires_grad=False))
    loaded = set(held)
    for name, tensor, source in tensors:
        if name not in params:
            raise ConfigError(f"{source} has a tensor {name} the model does not use: the "
                              f"weights do not match the model config")
        _check_shape(params[name], tensor, name, source)
        module_name, _, leaf = name.rpartition(".")
        if isinstance(tensor, FP8Weight):
            _keep_fp8(model, module_name, tensor, device, dtype)
            loaded.add(name)
            continue
        value = tensor.to(device=device, dtype=dtype or tensor.dtype)
        # requires_grad as built: the routing bias of sigmoid routing has no gradient.
        model.get_submodule(module_name).register_parameter(
            leaf, nn.Parameter(value, requires_grad=params[name].requires_grad))
        loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} parameters the model needs (e.g. "
                          f"{', '.join(missing[:3])}): the weights do not match the model config")
    if model.rotary is not None:  # the one buffer: rotary frequencies, computed, kept in fp32
        with torch.device(device):
            model.rotary = make_rotary(model.config)


def _keep_fp8(model: Transformer, module_name: str, weight: FP8Weight, device: torch.device,
              dtype: torch.dtype | None) -> None:
    linear = model.get_submodule(module_name)
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise ConfigError(f"{module_name} is not a linear layer without bias: its FP8 weight "
                          f"cannot stay in FP8")
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child,
            FP8WeightLinear(weight.values.to(device), weight.scales.to(device),
                            dtype or UNQUANTIZED_DTYPE, weight.block))


def _dtype_from_name(name: str, source: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{source} names dtype {name!r}, which is not a torch dtype")
    return dtype


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype the weights are stored in: an HF config.json's `dtype` (`torch_dtype` in older
    files), else the first stored tensor's, as vLLM's --dtype auto reads it."""
    folder = resolve_checkpoint(path)
    if (folder / "model.json").is_file():
        reader = ShardedReader(folder)
        return reader.whole("model", reader.names("model")[0]).dtype
    hf = read_hf_config(folder)
    name = hf.get("dtype") or hf.get("torch_dtype")
    if name:
        return _dtype_from_name(name, str(folder / "config.json"))
    return HFWeights(folder).first().dtype


def pretrained_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the model load_pretrained(path) loads, read without its weights."""
    folder = resolve_checkpoint(path)
    if not folder.is_dir():
        raise ConfigError(f"{path} is not a folder: pass an HF model folder or a tetrad "
                          f"checkpoint folder")
    if (folder / "model.json").is_file():
        values = read_json_file(folder / "model.json", "tetrad model description",
                                "tetrad train --checkpoint-dir")
        return from_dict(ModelConfig, values)
    if (folder / "config.json").is_file():
        return model_config_from_hf(read_hf_config(folder), name=folder.resolve().name)
    raise ConfigError(f"{folder} has neither config.json (an HF model) nor model.json "
                      f"(a tetrad checkpoint)")


def load_pretrained(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None, keep_fp8: bool = False) -> Transformer:
    """A tetrad Transformer in eval mode from an HF folder (config.json + safetensors), a tetrad
    checkpoint step folder (model.json + its shards), or a checkpoint root whose `latest`
    file names its newest step folder. The model is built on the meta device and each weight
    goes straight from the file to `device` in `dtype` (None: the stored dtype). `keep_fp8`: an
    FP8 checkpoint's projections stay in FP8 (FP8WeightLinear, for inference: no parameters to
    train, export or shard) instead of being dequantised at load."""
    folder = resolve_checkpoint(path)
    config = pretrained_config(folder)
    device = torch.device(device)
    if (folder / "model.json").is_file():
        tensors = _checkpoint_tensors(_parameter_names(config), folder)
    elif is_gguf_folder(folder):
        return load_gguf(folder, config, device, dtype or checkpoint_dtype(folder), keep_fp8)
    else:
        hf = read_hf_config(folder)
        if dtype is None and hf.get("quantization_config"):
            dtype = checkpoint_dtype(folder)  # FP8 weights come dequantised: in the model's dtype
        stored = StoredProjections.of(folder)
        if stored is not None:  # the projections come as whole_model_weights' values, on use
            dtype, held = dtype or checkpoint_dtype(folder), stored.weight_names()
            model = empty_model(config)
            _materialize(model, _hf_tensors(config, folder, device, keep_fp8, dtype, held),
                         device, dtype, held)
            model.stored_quantized = stored  # load_runner puts it on the device, in the dtype
            return model.eval()
        # safetensors reads straight into device memory.
        tensors = _hf_tensors(config, folder, device, keep_fp8, dtype)
    model = empty_model(config)
    _materialize(model, tensors, device, dtype)
    return model.eval()
