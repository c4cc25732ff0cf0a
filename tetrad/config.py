"""One description of a model, a parallel layout and a run, shared by planner, trainer, server.

Every config is a frozen dataclass validated on construction: a config that exists can work.
Configs come from presets (tetrad.presets), HF config.json files (tetrad.hf_config), TOML files,
and CLI flags, always through `from_dict`, which rejects unknown keys by naming the close matches.
No torch here: the planner imports this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tetrad.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def check_positive(name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def unknown_key_message(kind: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=3)
    hint = (f" (did you mean {', '.join(close)}?)" if close
            else f" (known: {', '.join(sorted(known))})")
    return f"unknown {kind} {key!r}{hint}"


def from_dict(cls, values: dict[str, Any]):
    """Build a config dataclass from a plain dict, naming unknown keys and their close matches."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(unknown_key_message(f"{cls.__name__} field", key, known))
    try:
        return cls(**values)
    except TypeError as error:  # a wrong type that the dataclass itself noticed
        raise ConfigError(f"{cls.__name__}: {error}") from None


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
    # Multi-head latent attention (DeepSeek-V2/V3) when attention == "mla".
    attention: str = "mha"  # mha (covers GQA/MQA through num_kv_heads) | mla
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                     "max_seq_len"):
            check_positive(name, getattr(self, name))
        check_choice("norm", self.norm, ("rmsnorm", "layernorm"))
        check_choice("position", self.position, ("rope", "learned"))
        check_choice("mlp", self.mlp, ("swiglu", "gelu"))
        check_choice("attention", self.attention, ("mha", "mla"))
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
        if self.num_experts:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_token must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_token}")
            if self.num_dense_layers >= self.num_layers:
                raise ConfigError("num_dense_layers must leave at least one MoE layer")
            if self.moe_ffn_hidden_size == 0:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim
                                            and self.qk_nope_head_dim and self.v_head_dim):
            raise ConfigError("attention = 'mla' needs kv_lora_rank, qk_nope_head_dim, "
                              "qk_rope_head_dim and v_head_dim")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.num_dense_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return from_dict(ModelConfig, {**dataclasses.asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the 4D layout and the strategy knobs. The world size is dp*pp*cp*tp; expert
    parallelism is folded over dp*cp, so ep does not multiply the world size (as in Megatron).
    strategy "ps" (docs/parameter_server.md) adds `servers` processes beside the dp workers."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    vpp: int = 1
    zero: int = 0
    offload: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # naive | gpipe | 1f1b | interleaved | zb
    microbatches: int = 0  # 0 means pp (the fewest that keeps every stage busy)
    recompute: str = "none"  # none | selective | full
    collectives: str = "backend"  # backend | ring (tetrad's own ring all-reduce on send/recv)
    stage_layers: tuple[int, ...] = ()  # layers per pipeline stage; () balances by cost
    strategy: str = "collective"  # collective | ps (parameter servers)
    servers: int = 0  # ps: server processes after the dp workers
    ps_mode: str = "sync"  # sync | async | ssp
    staleness: int | None = None  # ssp's bound K; None: PSOptions' default

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "cp", "tp", "ep", "vpp"):
            check_positive(name, getattr(self, name))
        check_positive("microbatches", self.microbatches, allow_zero=True)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.offload and self.zero == 0:
            raise ConfigError("--offload needs a ZeRO stage: add --zero 1, 2 or 3")
        check_choice("schedule", self.schedule, ("naive", "gpipe", "1f1b", "interleaved", "zb"))
        if (self.vpp > 1) != (self.schedule == "interleaved"):
            raise ConfigError("virtual stages go with the interleaved schedule: use --schedule "
                              "interleaved with --vpp 2 or more, or --vpp 1 with other schedules")
        check_choice("recompute", self.recompute, ("none", "selective", "full"))
        check_choice("collectives", self.collectives, ("backend", "ring"))
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep {self.ep} must divide dp*cp = {self.dp * self.cp}")
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # TOML gives a list
        if self.microbatches == 0:
            object.__setattr__(self, "microbatches", self.pp)
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ConfigError(f"the interleaved schedule needs microbatches ({self.microbatches}) "
                              f"to be a multiple of pp ({self.pp})")
        self._check_strategy()

    def _check_strategy(self) -> None:
        check_choice("strategy", self.strategy, ("collective", "ps"))
        if self.strategy == "collective":
            for flag, value, default in (("--servers", self.servers, 0),
                                         ("--ps-mode", self.ps_mode, "sync"),
                                         ("--staleness", self.staleness, None)):
                if value != default:
                    raise ConfigError(f"{flag} configures the parameter server: add --strategy ps "
                                      f"or drop {flag}")
            return
        if self.servers < 1:
            raise ConfigError(f"--strategy ps needs --servers 1 or more (the processes that hold "
                              f"the parameters), got {self.servers}")
        # The workers are whole-model data-parallel replicas: nothing else splits the model.
        others = [f"--{name} {getattr(self, name)}" for name in ("tp", "pp", "cp", "ep", "vpp")
                  if getattr(self, name) > 1] + ([f"--zero {self.zero}"] if self.zero else [])
        if self.sequence_parallel:
            others.append("--sequence-parallel")
        if others:
            raise ConfigError(f"--strategy ps is data parallel only (--dp workers + --servers): "
                              f"drop {' '.join(others)}")
        check_choice("ps_mode", self.ps_mode, ("sync", "async", "ssp"))
        if self.staleness is not None:
            if self.ps_mode != "ssp":
                raise ConfigError(f"--staleness bounds --ps-mode ssp only: drop it or use "
                                  f"--ps-mode ssp (got --ps-mode {self.ps_mode})")
            check_positive("staleness", self.staleness, allow_zero=True)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def num_processes(self) -> int:
        """Processes the run needs: the world, plus the parameter servers with --strategy ps."""
        return self.world_size + (self.servers if self.strategy == "ps" else 0)


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
    report: str = ""
    checkpoint_dir: str = ""
    save_every: int = 0
    keep: int = 0  # step folders to keep (the newest); 0 keeps all
    resume: bool = False
    log_every: int = 10
    sample_tokens: int = 200
    nproc: int = 1
    model_overrides: dict = field(default_factory=dict)  # [model] table of a TOML config
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "nproc", "log_every"):
            check_positive(name, getattr(self, name))
        for name in ("lr", "grad_clip", "save_every", "keep", "warmup_steps", "weight_decay",
                     "sample_tokens"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_choice("dtype", self.dtype, DTYPES)
        if self.save_every and not self.checkpoint_dir:
            raise ConfigError("--save-every needs --checkpoint-dir")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size {self.batch_size} is not divisible by "
                              f"grad_accum {self.grad_accum}")
        if isinstance(self.parallel, dict):
            object.__setattr__(self, "parallel", from_dict(ParallelConfig, self.parallel))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def build_train_config(toml_path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """TOML file values, then the flags the user set explicitly (they win). Parallel degrees may
    sit at the top level or in a [parallel] table; model field overrides in a [model] table.
    With --strategy ps and no --dp, the workers are the --nproc processes minus the servers."""
    values: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    parallel = dict(values.pop("parallel", {}))
    model_overrides = values.pop("model") if isinstance(values.get("model"), dict) else {}
    merged = {**values, **overrides}
    for key in [key for key in merged if key in PARALLEL_FIELDS]:
        parallel[key] = merged.pop(key)
    nproc, servers = merged.get("nproc"), parallel.get("servers", 0)
    if (parallel.get("strategy") == "ps" and "dp" not in parallel and isinstance(nproc, int)
            and isinstance(servers, int) and nproc > servers):
        parallel["dp"] = nproc - servers  # every process that is not a server is a worker
    merged["parallel"] = from_dict(ParallelConfig, parallel)
    merged["model_overrides"] = {**model_overrides, **merged.get("model_overrides", {})}
    return from_dict(TrainConfig, merged)
