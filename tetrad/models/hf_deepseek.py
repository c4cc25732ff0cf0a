"""HF `deepseek_v3` checkpoints -> tetrad parameters (transformers' DeepseekV3ForCausalLM layout).

MLA's projections keep their own parameters (no fusing), except that each rope section of q_b_proj
(or q_proj) and kv_a_proj_with_mqa is read with its rows reordered: DeepSeek rotates adjacent
pairs of dimensions (rope_interleave), tetrad the first half against the second, and reading the
even rows first then the odd rows turns one into the other without changing any attention score.
Experts are stored per expert (experts.{e}.gate_proj/up_proj/down_proj); the router's
e_score_correction_bias is the aux-loss-free balancing bias. Tensors of the
num_nextn_predict_layers layers after the last (DeepSeek-V3's multi-token-prediction module) are
not used, as in transformers.
"""

from __future__ import annotations

import re
from typing import Any

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.models.hf_rules import Rule

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def deinterleave_rows(offset: int, width: int) -> list[int]:
    """Row order that reads `width` interleaved rope rows starting at `offset` as half-split."""
    return ([offset + i for i in range(0, width, 2)] + [offset + i for i in range(1, width, 2)])


def _rope_rows(total: int, period: int, rope_offset: int, rope_dim: int, interleaved: bool
               ) -> tuple[int, ...]:
    """The rows of a [total] projection made of blocks of `period` rows whose rope part starts at
    `rope_offset` in each block, read in half-split order; () when already half-split."""
    if not interleaved:
        return ()
    order = []
    for start in range(0, total, period):
        order += list(range(start, start + rope_offset))
        order += deinterleave_rows(start + rope_offset, rope_dim)
    return tuple(order)


def deepseek_rules(config: ModelConfig, rope_interleave: bool) -> list[Rule]:
    out = [Rule("embed.weight", ("model.embed_tokens.weight",)),
           Rule("norm.weight", ("model.norm.weight",))]
    if not config.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    q_rows = _rope_rows(config.num_heads * qk_dim, qk_dim, config.qk_nope_head_dim,
                        config.qk_rope_head_dim, rope_interleave)
    kv_rows = _rope_rows(config.kv_lora_rank + config.qk_rope_head_dim,
                         config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank,
                         config.qk_rope_head_dim, rope_interleave)
    for i in range(config.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        out += [Rule(t + "attn_norm.weight", (h + "input_layernorm.weight",)),
                Rule(t + "mlp_norm.weight", (h + "post_attention_layernorm.weight",)),
                Rule(t + "attn.kv_down.weight", (attn + "kv_a_proj_with_mqa.weight",),
                     rows=kv_rows),
                Rule(t + "attn.kv_norm.weight", (attn + "kv_a_layernorm.weight",)),
                Rule(t + "attn.kv_up.weight", (attn + "kv_b_proj.weight",)),
                Rule(t + "attn.out.weight", (attn + "o_proj.weight",))]
        if config.q_lora_rank:
            out += [Rule(t + "attn.q_down.weight", (attn + "q_a_proj.weight",)),
                    Rule(t + "attn.q_norm.weight", (attn + "q_a_layernorm.weight",)),
                    Rule(t + "attn.q_up.weight", (attn + "q_b_proj.weight",), rows=q_rows)]
        else:
            out.append(Rule(t + "attn.q.weight", (attn + "q_proj.weight",), rows=q_rows))
        if config.is_moe_layer(i):
            moe = h + "mlp."
            out += [Rule(t + "mlp.router.gate.weight", (moe + "gate.weight",)),
                    Rule(t + "mlp.router.bias", (moe + "gate.e_score_correction_bias",))]
            out += _mlp_rules(t + "mlp.shared.", moe + "shared_experts.",
                              config.moe_ffn_hidden_size * config.num_shared_experts)
            for e in range(config.num_experts):
                out += _mlp_rules(f"{t}mlp.experts.{e}.", f"{moe}experts.{e}.",
                                  config.moe_ffn_hidden_size)
        else:
            out += _mlp_rules(t + "mlp.", h + "mlp.", config.ffn_hidden_size)
    return out


def _mlp_rules(ours: str, theirs: str, ffn: int) -> list[Rule]:
    return [Rule(ours + "up.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
                 (ffn, ffn)),
            Rule(ours + "down.weight", (theirs + "down_proj.weight",))]


def is_extra_layer(name: str, config: ModelConfig, hf: dict[str, Any]) -> bool:
    """A tensor of one of the num_nextn_predict_layers layers that follow the model's last
    (DeepSeek-V3's multi-token prediction module)."""
    match = _LAYER.match(name)
    extra = hf.get("num_nextn_predict_layers", 0) if hf.get("model_type") == "deepseek_v3" else 0
    return (match is not None
            and config.num_layers <= int(match.group(1)) < config.num_layers + extra)


def check_deepseek_support(hf: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Refuse deepseek_v3 settings whose numerics tetrad's layers do not reproduce."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope scaling {rope_type!r} is not supported for deepseek_v3 "
                          f"(tetrad implements plain rope and yarn)")
    if rope_type == "yarn" and (scaling.get("attention_factor") is not None
                                or scaling.get("truncate", True) is False):
        raise ConfigError("yarn with an explicit attention_factor or truncate = false is not "
                          "supported (DeepSeek-V3 uses neither)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if hf.get("attention_bias"):
        raise ConfigError("deepseek_v3 attention_bias is not supported: tetrad's MLA "
                          "projections have no biases (DeepSeek-V3's have none)")
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise ConfigError("deepseek_v3 with num_key_value_heads != num_attention_heads is not "
                          "supported (MLA has one key and value per head)")
