"""Named model shapes, and the resolver behind every `--model` argument.

`--model` takes a preset name, an HF-format folder, an HF `config.json`, or a TOML / JSON file of
ModelConfig fields. Trainable presets are small; the published shapes (llama, gpt3, deepseek, ...)
are for the planner and for building tiny look-alikes with `ModelConfig.replace`.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from tetrad.config import ModelConfig, from_dict, load_toml
from tetrad.errors import ConfigError
from tetrad.hf_config import model_config_from_hf, read_hf_config

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
    path = Path(spec)
    if path.is_dir() or (path.is_file() and path.name == "config.json"):
        hf = read_hf_config(path)
        config = (model_config_from_hf(hf, name=path.resolve().parent.name if path.is_file()
                                       else path.resolve().name)
                  if "model_type" in hf else from_dict(ModelConfig, hf))
    elif path.suffix in (".toml", ".json") and path.exists():
        values = load_toml(path) if path.suffix == ".toml" else json.loads(path.read_text())
        if "model_type" in values:
            config = model_config_from_hf(values, name=path.stem)
        else:
            config = from_dict(ModelConfig, {"name": path.stem, **values})
    elif path.suffix in (".toml", ".json") or "/" in spec:
        raise ConfigError(f"model file or folder {spec} does not exist")
    else:
        config = preset(spec)
    return config.replace(**overrides) if overrides else config
