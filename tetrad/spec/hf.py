"""HF `config.json` <-> ModelConfig, without torch (the planner reads HF configs too).

Supported model types: llama, qwen2, mistral, mixtral, gpt2, deepseek_v3 (loaded, trained and
served: tetrad.models.hf.RUNTIME_TYPES), and for the planner also deepseek_v2 (MLA and softmax
routing), gpt_bigcode (GPT-2 with multi-query attention: StarCoder, SantaCoder), gemma (its
gated GELU MLP has SwiGLU's three matrices, so shapes, FLOPs and bytes are exact), qwen3
(QK-norm) and gpt_neox (parallel blocks, partial rotary); their weights are not loaded:
tetrad.models.hf.check_runtime_support refuses them). Also where a checkpoint path leads (`resolve_checkpoint`),
so that torch-free readers (tokenizer, planner) and the model loader agree on it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tetrad.spec.model import ModelConfig, parse_problem
from tetrad.errors import ConfigError

LLAMA_LIKE = ("llama", "qwen2", "mistral", "mixtral", "deepseek_v3", "deepseek_v2", "gemma",
              "qwen3", "gpt_neox")
GPT2_LIKE = ("gpt2", "gpt_bigcode")
SUPPORTED = LLAMA_LIKE + GPT2_LIKE
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


# The HF keys the conversion reads, by the type it reads them as (null stands for "unset" in
# HF configs): checked before any arithmetic, so that "64", 64.5, true or a list is refused by
# name instead of multiplied, compared or silently read as 1.
HF_INTEGERS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
               "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "max_position_embeddings", "sliding_window",
               "num_local_experts", "num_experts_per_tok", "n_routed_experts",
               "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "n_group", "topk_group", "original_max_position_embeddings")
HF_STRINGS = ("topk_method", "scoring_func")
HF_REALS = ("layer_norm_epsilon", "rms_norm_eps", "initializer_range", "rope_theta",
            "router_aux_loss_coef", "routed_scaling_factor", "factor", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim", "aux_loss_alpha")
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "norm_topk_prob",
            "multi_query", "use_parallel_residual")
HF_TABLES = ("rope_scaling", "rope_parameters")


def check_hf_types(hf: dict[str, Any], name: str) -> None:
    """Each key the conversion reads is null or of its type (module tables above), and the
    rope scaling tables' keys too; num_key_value_heads, when set, is at least 1."""
    for table in HF_TABLES:
        if not isinstance(hf.get(table) or {}, dict):
            raise ConfigError(f"HF config {name!r}: {table} must be a JSON object or null, got "
                              f"{hf[table]!r}")
    values = {**hf, **rope_scaling_parameters(hf)}
    for key, value in values.items():
        if value is None:
            continue
        if key in HF_INTEGERS and type(value) is not int:
            wrong = "an integer"
        elif key in HF_REALS and (type(value) not in (int, float) or not math.isfinite(value)):
            wrong = "a finite number"
        elif key in HF_BOOLS and type(value) is not bool:
            wrong = "true or false"
        elif key in HF_STRINGS and type(value) is not str:
            wrong = "a string"
        else:
            continue
        raise ConfigError(f"HF config {name!r}: {key} must be {wrong}, got {value!r}")
    if hf.get("num_key_value_heads") is not None and hf["num_key_value_heads"] < 1:
        raise ConfigError(f"HF config {name!r}: num_key_value_heads must be at least 1 (null "
                          f"means one per attention head), got {hf['num_key_value_heads']}")


def model_config_from_hf(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """A ModelConfig from an HF config dict; a missing required key or a value of the wrong
    type is a ConfigError naming it."""
    check_hf_types(hf, name)
    try:
        return _model_config_from_hf(hf, name)
    except KeyError as missing:
        raise ConfigError(f"HF config {name!r} (model_type {hf.get('model_type')!r}) lacks the "
                          f"required key {missing}") from None


def _model_config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(f"HF model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED)})")
    if model_type in GPT2_LIKE:
        hidden = hf["n_embd"]
        # gpt_bigcode's multi_query (its default) is one key and value head for all queries.
        multi_query = model_type == "gpt_bigcode" and hf.get("multi_query", True)
        return ModelConfig(
            name=name, vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["n_layer"],
            num_heads=hf["n_head"], num_kv_heads=1 if multi_query else 0,
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            max_seq_len=hf["n_positions"], norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5), position="learned", mlp="gelu",
            tie_embeddings=hf.get("tie_word_embeddings", True), bias=True,
            init_std=hf.get("initializer_range", 0.02))
    fields: dict[str, Any] = dict(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0, ffn_hidden_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), position="rope",
        rope_theta=_rope_theta(hf), mlp="swiglu",
        tie_embeddings=hf.get("tie_word_embeddings", model_type == "gemma"),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        init_std=hf.get("initializer_range", 0.02))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window and window < fields["max_seq_len"]:
        # Within the window sliding attention is plain causal attention: capping the length keeps
        # the model exact, and longer inputs are refused instead of silently attending too far.
        fields["max_seq_len"] = window
    if model_type == "mixtral":
        fields.update(num_experts=hf["num_local_experts"],
                      num_experts_per_token=hf["num_experts_per_tok"],
                      router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.01))
    if model_type in DEEPSEEK:
        fields.update(
            num_experts=hf["n_routed_experts"], num_experts_per_token=hf["num_experts_per_tok"],
            num_shared_experts=hf.get("n_shared_experts", 0),
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            num_dense_layers=hf.get("first_k_dense_replace", 0), attention="mla",
            q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            router_score="sigmoid",  # as transformers, whatever the config's scoring_func
            norm_topk_prob=hf.get("norm_topk_prob", True),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_expert_groups=hf.get("n_group") or 1, topk_expert_groups=hf.get("topk_group") or 1,
            # DeepSeek-V3 balances its experts by the routing bias, not by an auxiliary loss
            # (its paper's update speed, 0.001 per step, for training from this config).
            router_aux_loss_coef=0.0, router_bias_update_rate=0.001)
    if model_type == "deepseek_v2":
        # DeepSeek-V2 scores experts by softmax and balances them by an auxiliary loss
        # (aux_loss_alpha); its groups (topk_method group_limited_greedy) limit each token's
        # devices, otherwise routing is over all experts.
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        fields.update(router_score="softmax", norm_topk_prob=hf.get("norm_topk_prob", False),
                      num_expert_groups=(hf.get("n_group") or 1) if grouped else 1,
                      topk_expert_groups=(hf.get("topk_group") or 1) if grouped else 1,
                      router_aux_loss_coef=float(hf.get("aux_loss_alpha", 0.001)),
                      router_bias_update_rate=0.0)
    fields["rotary_fraction"] = float(hf.get("partial_rotary_factor") or 1.0)
    if model_type == "qwen3":
        fields["qk_norm"] = True
    if model_type == "gpt_neox":
        # GPT-NeoX: layernorm, a 4h GELU MLP and biases everywhere, rope on rotary_pct of each
        # head, attention and MLP side by side (use_parallel_residual, its default).
        fields.update(norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5), mlp="gelu",
                      bias=True, qkv_bias=False, rotary_fraction=float(hf.get("rotary_pct", 1.0)),
                      parallel_block=hf.get("use_parallel_residual", True))
    fields.update(_rope_scaling(hf, fields["max_seq_len"]))
    return ModelConfig(**fields)


def rope_scaling_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling entry of an HF config: `rope_scaling` (transformers 4) or
    `rope_parameters` (5), with its type under `rope_type` or `type`; {} when there is none."""
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def rope_scaling_type(hf: dict[str, Any]) -> str:
    scaling = rope_scaling_parameters(hf)
    return scaling.get("rope_type", scaling.get("type", "default"))


def _rope_scaling(hf: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    """YaRN's ModelConfig fields (other scalings are refused when weights are loaded)."""
    if rope_scaling_type(hf) != "yarn":
        return {}
    scaling = rope_scaling_parameters(hf)
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ConfigError("yarn rope scaling needs original_max_position_embeddings in the "
                          "config's rope_scaling (the length the model was pretrained at)")
    return dict(rope_scaling="yarn", rope_factor=float(scaling.get("factor") or
                                                       max_seq_len / original),
                rope_original_max_seq_len=original,
                yarn_beta_fast=float(scaling.get("beta_fast") or 32),
                yarn_beta_slow=float(scaling.get("beta_slow") or 1),
                yarn_mscale=float(scaling.get("mscale") or 0),
                yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0))


def _rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    parameters = hf.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", 10000.0))


def hf_model_type(config: ModelConfig) -> str:
    """The HF model type a tetrad config is written back as."""
    if config.attention == "mla":
        return "deepseek_v3"
    if config.is_moe:
        return "mixtral"
    if config.position == "learned":
        return "gpt2"
    return "qwen2" if config.qkv_bias else "llama"


def hf_from_model_config(config: ModelConfig) -> dict[str, Any]:
    model_type = hf_model_type(config)
    if model_type == "gpt2":
        if not (config.norm == "layernorm" and config.mlp == "gelu" and config.bias):
            raise ConfigError("a learned-position model exports as gpt2, which needs "
                              "layernorm, gelu and bias = true")
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": config.vocab_size, "n_embd": config.hidden_size,
                "n_layer": config.num_layers, "n_head": config.num_heads,
                "n_inner": config.ffn_hidden_size, "n_positions": config.max_seq_len,
                "layer_norm_epsilon": config.norm_eps, "activation_function": "gelu_new",
                "tie_word_embeddings": config.tie_embeddings,
                "initializer_range": config.init_std,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if model_type == "deepseek_v3":
        return _deepseek_hf(config)
    if config.norm != "rmsnorm" or config.mlp != "swiglu" or config.bias:
        raise ConfigError(f"a rope model exports as {model_type}, which needs rmsnorm, swiglu "
                          f"and bias = false")
    if model_type == "mixtral" and (config.num_shared_experts or config.num_dense_layers
                                    or config.qkv_bias
                                    or config.moe_ffn_hidden_size != config.ffn_hidden_size):
        raise ConfigError("an MoE model exports as mixtral, which needs num_shared_experts = 0, "
                          "num_dense_layers = 0, qkv_bias = false and moe_ffn_hidden_size = "
                          "ffn_hidden_size")
    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "mixtral": "MixtralForCausalLM"}
    hf: dict[str, Any] = {
        "model_type": model_type, "architectures": [architectures[model_type]],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.ffn_hidden_size,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings, "initializer_range": config.init_std,
    }
    if model_type == "mixtral":
        hf.update(num_local_experts=config.num_experts,
                  num_experts_per_tok=config.num_experts_per_token,
                  router_aux_loss_coef=config.router_aux_loss_coef)
    return hf


def _deepseek_hf(config: ModelConfig) -> dict[str, Any]:
    """An MLA model as transformers' DeepseekV3 config, its rope rows as tetrad holds them
    (half-split: rope_interleave false), so no weight is reordered on the way out."""
    if config.router_score != "sigmoid" or not config.is_moe or config.bias or config.qkv_bias:
        raise ConfigError("an MLA model exports as deepseek_v3, which needs MoE layers with "
                          "router_score = 'sigmoid' and no biases")
    hf: dict[str, Any] = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_heads, "n_shared_experts": config.num_shared_experts,
        "n_routed_experts": config.num_experts, "num_experts_per_tok":
        config.num_experts_per_token, "first_k_dense_replace": config.num_dense_layers,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.norm_topk_prob, "n_group": config.num_expert_groups,
        "topk_group": config.topk_expert_groups, "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank or None, "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim, "v_head_dim": config.v_head_dim,
        "rope_interleave": False, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings, "initializer_range": config.init_std,
        "num_nextn_predict_layers": 0, "attention_bias": False,
    }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=config.rope_factor,
                    original_max_position_embeddings=config.rope_original_max_seq_len,
                    beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow,
                    mscale=config.yarn_mscale, mscale_all_dim=config.yarn_mscale_all_dim)
    hf.update(rope_theta=config.rope_theta, rope_scaling=rope, rope_parameters=rope)
    return hf


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        values = json.loads(file.read_text())
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, 4,300-digit numbers
        raise ConfigError(f"{file} is not valid JSON: {parse_problem(error)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{file} must hold one JSON object of model fields, "
                          f"not a {type(values).__name__}")
    return values


def resolve_checkpoint(path: str | Path) -> Path:
    """A tetrad checkpoint root (a folder whose `latest` file names its newest step folder) ->
    that step folder; any other path is returned as is."""
    path = Path(path)
    latest = path / "latest"
    if not latest.is_file():
        return path
    try:
        name = latest.read_text().strip()
    except UnicodeDecodeError:
        name = ""
    step = path / name
    if name in ("", "..") or Path(name).name != name or not step.is_dir():
        raise ConfigError(f"{latest} names {name!r}, which is not a folder in {path}: "
                          f"point at a step folder instead")
    return step
