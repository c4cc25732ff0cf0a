"""One description of a model, a parallel layout and a run, shared by planner, trainer, server
(the layout, ParallelConfig, has a module of its own: tetrad.spec.layout).

Every config is a frozen dataclass validated on construction: a config that exists can work.
Configs come from presets (tetrad.spec.presets), HF config.json files (tetrad.spec.hf), TOML files,
and CLI flags, always through `from_dict`, which rejects unknown keys by naming the close matches.
No torch here: the planner imports this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tetrad.errors import ConfigError, check_choice, check_positive
from tetrad.spec.layout import ParallelConfig

DTYPES = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("block", "tensor")  # DeepSeek-V3's 128x128 blocks, or one scale per tensor
# auto: a GPU per local rank when there are enough (NCCL), else the CPU (gloo)
DEVICES = ("auto", "cpu", "cuda")


def unknown_key_message(kind: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=3)
    hint = (f" (did you mean {', '.join(close)}?)" if close
            else f" (known: {', '.join(sorted(known))})")
    return f"unknown {kind} {key!r}{hint}"


def from_dict(cls, values: dict[str, Any]):
    """Build a config dataclass from a plain dict, naming unknown keys and their close matches."""
    if not isinstance(values, dict):
        raise ConfigError(f"{cls.__name__} fields must be a table of names and values, not a "
                          f"{type(values).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(unknown_key_message(f"{cls.__name__} field", key, known))
    try:
        return cls(**values)
    except TypeError as error:  # a wrong type that the dataclass itself noticed
        raise ConfigError(f"{cls.__name__}: {error}") from None


def check_field_types(config) -> None:
    """Each field of the dataclass `config` of its declared type: an int that is an int (a bool
    is not one, nor 64.0), a finite real, a str, a bool. A config file's "64", null, true or
    1e400 is then refused by name rather than used."""
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if spec.type == "int" and type(value) is not int:
            raise ConfigError(f"{spec.name} must be an integer, got {value!r}")
        if spec.type == "float" and (type(value) not in (int, float)
                                     or not math.isfinite(value)):
            raise ConfigError(f"{spec.name} must be a finite number, got {value!r}")
        if spec.type in ("str", "bool") and type(value).__name__ != spec.type:
            raise ConfigError(f"{spec.name} must be a {spec.type}, got {value!r}")


# Bounds far above any model (hidden sizes near 2**15, vocabularies near 2**18, 10**7-token
# contexts; DeepNet's 1,000 layers, DeepSeek's 256 experts) that keep the planner's
# loops over layers, heads and experts short.
MAX_MODEL_SIZE = 2**31 - 1
MAX_MODEL_COUNT = 4096
MODEL_COUNTS = ("num_layers", "num_heads", "num_kv_heads", "num_experts", "num_experts_per_token",
                "num_shared_experts", "num_dense_layers", "num_expert_groups",
                "topk_expert_groups")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer. Families differ by fields, not by subclasses:
    Llama = rmsnorm + rope + swiglu + GQA; Qwen2 = Llama + qkv_bias; GPT-2 = layernorm + learned
    positions + gelu + bias + tied embeddings; Mixtral / DeepSeek = num_experts > 0."""

    name: str = "custom"
    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 0  # 0 means num_heads (multi-head attention)
    head_dim: int = 0  # 0 means hidden_size // num_heads
    ffn_hidden_size: int = 1024
    max_seq_len: int = 256
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    position: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    # YaRN context extension (DeepSeek-V3): frequencies interpolated by rope_factor beyond the
    # rope_original_max_seq_len the model was pretrained at, with its attention-scale corrections.
    rope_scaling: str = "none"  # none | yarn
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    mlp: str = "swiglu"  # swiglu | gelu
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on Q/K/V only (Qwen2)
    bias: bool = False  # biases on every linear and norm (GPT-2)
    init_std: float = 0.02
    # Mixture of experts: num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_ffn_hidden_size: int = 0  # 0 means ffn_hidden_size
    num_dense_layers: int = 0  # leading layers that stay dense (DeepSeek's first_k_dense_replace)
    router_aux_loss_coef: float = 0.01
    # Routing: Mixtral scores experts by softmax; DeepSeek-V3 by sigmoid, picks the top
    # topk_expert_groups of num_expert_groups groups first, and balances load without an
    # auxiliary loss by a per-expert bias on the choice (moved by router_bias_update_rate per step).
    router_score: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True  # renormalize the k chosen weights to sum to one
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    topk_expert_groups: int = 1
    router_bias_update_rate: float = 0.0
    # Multi-head latent attention (DeepSeek-V2/V3) when attention == "mla".
    attention: str = "mha"  # mha (covers GQA/MQA through num_kv_heads) | mla
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Block shapes of other families, for the planner (tetrad's runtime refuses them:
    # tetrad.planner.rules.check_runtime_model): attention and MLP side by side on one input,
    # their outputs summed (GPT-J, GPT-NeoX, Falcon); rope on the first rotary_fraction of each
    # head's dims (GPT-NeoX 0.25, Phi-2 0.4); an RMSNorm over each query and key head (Qwen3).
    parallel_block: bool = False
    rotary_fraction: float = 1.0
    qk_norm: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        self._check_ranges()
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_choice("norm", self.norm, ("rmsnorm", "layernorm"))
        check_choice("position", self.position, ("rope", "learned"))
        check_choice("mlp", self.mlp, ("swiglu", "gelu"))
        check_choice("attention", self.attention, ("mha", "mla"))
        check_choice("rope_scaling", self.rope_scaling, ("none", "yarn"))
        check_choice("router_score", self.router_score, ("softmax", "sigmoid"))
        if self.rope_scaling == "yarn" and not (self.rope_factor >= 1
                                                and self.rope_original_max_seq_len > 0):
            raise ConfigError("rope_scaling = 'yarn' needs rope_factor >= 1 and "
                              "rope_original_max_seq_len > 0")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}: change one of them or set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}: "
                f"grouped-query attention needs num_heads to be a multiple of num_kv_heads")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"rope needs an even head_dim, got {self.head_dim}")
        if not 0 < self.rotary_fraction <= 1 or self.rotary_dims % 2:
            raise ConfigError(f"rotary_fraction must be in (0, 1] and rotate an even number of "
                              f"each head's {self.head_dim} dims, got {self.rotary_fraction}")
        if self.num_experts:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_token must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_token}")
            if self.num_dense_layers >= self.num_layers:
                raise ConfigError("num_dense_layers must leave at least one MoE layer")
            if self.moe_ffn_hidden_size == 0:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            self._check_expert_groups()
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim
                                            and self.qk_nope_head_dim and self.v_head_dim):
            raise ConfigError("attention = 'mla' needs kv_lora_rank, qk_nope_head_dim, "
                              "qk_rope_head_dim and v_head_dim")
        if self.attention == "mla" and (self.position != "rope" or self.qk_rope_head_dim % 2):
            raise ConfigError("attention = 'mla' needs position = 'rope' and an even "
                              "qk_rope_head_dim")

    def _check_ranges(self) -> None:
        """Sizes that are positive and below bounds no model comes near (the planner loops over
        layers and experts, so a typo of 10**12 layers would hang it); reals where the formulas
        need them (a zero norm_eps divides by zero)."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                     "max_seq_len", "num_expert_groups", "topk_expert_groups"):
            check_positive(name, getattr(self, name))
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.type == "int" and value < 0:
                raise ConfigError(f"{spec.name} must be >= 0, got {value}")
            bound = MAX_MODEL_COUNT if spec.name in MODEL_COUNTS else MAX_MODEL_SIZE
            if spec.type == "int" and value > bound:
                raise ConfigError(f"{spec.name} {value} is more than {bound:,}: no model comes "
                                  f"near that many (check the value)")
        for name in ("norm_eps", "rope_theta", "routed_scaling_factor"):
            check_positive(name, getattr(self, name))
        for name in ("init_std", "router_aux_loss_coef", "router_bias_update_rate"):
            check_positive(name, getattr(self, name), allow_zero=True)

    def _check_expert_groups(self) -> None:
        groups, kept = self.num_expert_groups, self.topk_expert_groups
        if groups < 1 or self.num_experts % groups:
            raise ConfigError(f"num_expert_groups {groups} must divide num_experts "
                              f"{self.num_experts}")
        if not 0 < kept <= groups:
            raise ConfigError(f"topk_expert_groups must be in 1..num_expert_groups ({groups}), "
                              f"got {kept}")
        if groups > 1 and self.num_experts // groups < 2:
            raise ConfigError("group-limited routing scores a group by its two best experts: "
                              "each of the num_expert_groups needs 2 experts or more")
        if kept * (self.num_experts // groups) < self.num_experts_per_token:
            raise ConfigError(f"topk_expert_groups {kept} of {groups} groups keep fewer experts "
                              f"than num_experts_per_token {self.num_experts_per_token}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rope rotates (HF's int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rotary_fraction)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.num_dense_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return from_dict(ModelConfig, {**dataclasses.asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Field names are the CLI flags with '-' for '_'."""

    model: str = "small"  # preset name, HF folder, config.json or TOML of model fields
    data: str = ""  # "" means the bundled Shakespeare corpus
    tokenizer: str = "byte"  # byte | path to a tokenizer.json
    steps: int = 300
    seed: int = 0
    batch_size: int = 16  # global, in sequences, per optimizer step
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    dtype: str = "fp32"
    fp8_recipe: str = "block"  # FP8_RECIPES: the scaling of --dtype fp8 (tetrad.models.fp8_layers)
    compile: bool = False  # torch.compile each transformer block (tetrad.parallel.compile)
    device: str = "auto"  # DEVICES
    report: str = ""
    hardware: str = ""  # profile or catalog GPU the report's predicted time is for ("": default)
    checkpoint_dir: str = ""
    save_every: int = 0
    keep: int = 0  # step folders to keep (the newest); 0 keeps all
    resume: bool = False
    log_every: int = 10
    sample_tokens: int = 200
    nproc: int = 1
    device_memory_cap: int = 0  # bytes a rank may hold on its device (0: no cap; tetrad.train.stop)
    model_overrides: dict = field(default_factory=dict)  # [model] table of a TOML config
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        self._check_numbers()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "nproc", "log_every"):
            check_positive(name, getattr(self, name))
        for name in ("lr", "grad_clip", "save_every", "keep", "warmup_steps", "weight_decay",
                     "sample_tokens", "device_memory_cap"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        if self.fp8_recipe != "block" and self.dtype != "fp8":
            raise ConfigError(f"--fp8-recipe {self.fp8_recipe} needs --dtype fp8")
        check_choice("device", self.device, DEVICES)
        if self.save_every and not self.checkpoint_dir:
            raise ConfigError("--save-every needs --checkpoint-dir")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size {self.batch_size} is not divisible by "
                              f"grad_accum {self.grad_accum}")
        if isinstance(self.parallel, dict):
            object.__setattr__(self, "parallel", from_dict(ParallelConfig, self.parallel))

    def _check_numbers(self) -> None:
        """Integers that are integers, finite reals, and ranges the generators and AdamW take:
        a NaN learning rate or a float seed from a TOML file would fail mid-run, or not at all."""
        check_field_types(self)
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (ValueError, RecursionError) as error:  # TOMLDecodeError, UnicodeDecodeError, nesting
        raise ConfigError(f"config file {path} is not valid TOML: "
                          f"{parse_problem(error)}") from None


def parse_problem(error: Exception) -> str:
    """What was wrong with a config file's text, in a few words."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text (byte {error.start})"
    return str(error)


def build_train_config(toml_path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """TOML file values, then the flags the user set explicitly (they win). Parallel degrees may
    sit at the top level or in a [parallel] table; model field overrides in a [model] table.
    With --strategy ps and no --dp, the workers are the --nproc processes minus the servers and
    the spares."""
    values: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    parallel = dict(values.pop("parallel", {}))
    model_overrides = values.pop("model") if isinstance(values.get("model"), dict) else {}
    merged = {**values, **overrides}
    for key in [key for key in merged if key in PARALLEL_FIELDS]:
        parallel[key] = merged.pop(key)
    nproc = merged.get("nproc")
    not_workers = parallel.get("servers", 0), parallel.get("ps_spares", 0)
    if (parallel.get("strategy") == "ps" and "dp" not in parallel and isinstance(nproc, int)
            and all(isinstance(n, int) for n in not_workers) and nproc > sum(not_workers)):
        parallel["dp"] = nproc - sum(not_workers)  # every process not a server or spare works
    merged["parallel"] = from_dict(ParallelConfig, parallel)
    merged["model_overrides"] = {**model_overrides, **merged.get("model_overrides", {})}
    return from_dict(TrainConfig, merged)
