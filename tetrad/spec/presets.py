"""Named model shapes, and the resolver behind every `--model` argument.

`--model` takes a preset name, an HF-format folder, an HF `config.json`, a tetrad checkpoint (a
step folder or a checkpoint root), or a TOML / JSON file of ModelConfig fields. Trainable presets are small; the published shapes (llama, gpt3, deepseek, ...)
are for the planner and for building tiny look-alikes with `ModelConfig.replace`.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from tetrad.spec.model import ModelConfig, from_dict, load_toml
from tetrad.errors import ConfigError
from tetrad.spec.hf import model_config_from_hf, read_hf_config, resolve_checkpoint

PRESETS: dict[str, ModelConfig] = {
    # Trains a step in milliseconds: for tests.
    "tiny": ModelConfig(name="tiny", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_size=176, max_seq_len=128),
    # The demo default: a few million parameters, byte-level, learns Shakespeare on a laptop CPU.
    "small": ModelConfig(name="small", vocab_size=256, hidden_size=256, num_layers=6, num_heads=8,
                         num_kv_heads=4, ffn_hidden_size=688, max_seq_len=256),
    # A tiny mixture of experts for the expert-parallel tests.
    "tiny-moe": ModelConfig(name="tiny-moe", vocab_size=256, hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, ffn_hidden_size=128, max_seq_len=128,
                            num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                            moe_ffn_hidden_size=64),
}


def register(config: ModelConfig) -> None:
    PRESETS[config.name] = config


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(PRESETS)}"
        raise ConfigError(f"unknown model {name!r} ({hint})")
    return PRESETS[name]


def resolve_model(spec: str, overrides: dict | None = None) -> ModelConfig:
    """Turn a `--model` argument into a ModelConfig, then apply field overrides."""
    path = resolve_checkpoint(spec)
    if (path / "model.json").is_file():  # a tetrad checkpoint: its own ModelConfig fields
        config = from_dict(ModelConfig, read_hf_config(path / "model.json"))
    elif path.is_dir() or (path.is_file() and path.name == "config.json"):
        hf = read_hf_config(path)
        config = (model_config_from_hf(hf, name=path.resolve().parent.name if path.is_file()
                                       else path.resolve().name)
                  if "model_type" in hf else from_dict(ModelConfig, hf))
    elif path.suffix in (".toml", ".json") and path.exists():
        values = load_toml(path) if path.suffix == ".toml" else read_hf_config(path)
        if "model_type" in values:
            config = model_config_from_hf(values, name=path.stem)
        else:
            config = from_dict(ModelConfig, {"name": path.stem, **values})
    elif path.suffix in (".toml", ".json") or "/" in spec:
        raise ConfigError(f"model file or folder {spec} does not exist")
    else:
        config = preset(spec)
    return config.replace(**overrides) if overrides else config


# ---------------------------------------------------------------------------------------------
# Published model shapes, for the planner (and for tiny look-alikes via ModelConfig.replace).
# Each follows the model's HF config.json (or paper, for GPT-3); parameter counts match the
# published totals (tests/test_planner_*.py checks them).
# ---------------------------------------------------------------------------------------------

def _llama(name: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
           vocab: int, max_seq_len: int, rope_theta: float, norm_eps: float = 1e-5,
           **extra) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, ffn_hidden_size=ffn,
                       max_seq_len=max_seq_len, norm_eps=norm_eps, rope_theta=rope_theta, **extra)


_DEEPSEEK_V3 = dict(
    vocab=129280, hidden=7168, layers=61, heads=128, kv_heads=128, ffn=18432,
    max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6, num_experts=256,
    num_experts_per_token=8, num_shared_experts=1, moe_ffn_hidden_size=2048, num_dense_layers=3,
    attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, head_dim=192, router_score="sigmoid",
    num_expert_groups=8, topk_expert_groups=4, routed_scaling_factor=2.5,
    router_aux_loss_coef=0.0, router_bias_update_rate=0.001, rope_scaling="yarn", rope_factor=40.0,
    rope_original_max_seq_len=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)

for _config in [
    # GPT-3 175B (Brown et al. 2020, table 2.1): GPT-2 BPE vocabulary, 2048 context, tied head.
    ModelConfig(name="gpt3-175b", vocab_size=50257, hidden_size=12288, num_layers=96,
                num_heads=96, ffn_hidden_size=49152, max_seq_len=2048, norm="layernorm",
                position="learned", mlp="gelu", bias=True, tie_embeddings=True, init_std=0.006),
    # OPT-13B (Zhang et al. 2022): learned positions (2048 + the 2 offset rows OPT keeps), ReLU
    # MLP -- tetrad has no ReLU, and gelu has the same shapes and FLOPs.
    ModelConfig(name="opt-13b", vocab_size=50272, hidden_size=5120, num_layers=40, num_heads=40,
                ffn_hidden_size=20480, max_seq_len=2050, norm="layernorm", position="learned",
                mlp="gelu", bias=True, tie_embeddings=True),
    _llama("llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    _llama("llama2-13b", 5120, 40, 40, 40, 13824, 32000, 4096, 10000.0),
    _llama("llama2-70b", 8192, 80, 64, 8, 28672, 32000, 4096, 10000.0),
    _llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
    _llama("llama3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, 500000.0),
    _llama("llama3-405b", 16384, 126, 128, 8, 53248, 128256, 131072, 500000.0),  # Llama 3.1
    _llama("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, 1e6, num_experts=8,
           num_experts_per_token=2),
    _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 32768, 1e6, norm_eps=1e-6,
           qkv_bias=True),
    _llama("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, 32768, 1e6, norm_eps=1e-6,
           qkv_bias=True),
    # DeepSeek-V3 and R1 share one architecture (R1 is V3 post-trained); the 14B multi-token-
    # prediction module is not part of the served model and is left out.
    _llama("deepseek-v3", **_DEEPSEEK_V3),
    _llama("deepseek-r1", **_DEEPSEEK_V3),
]:
    register(_config)
