"""The one description of a served model's layout, of the serving engine's settings and of the
server's limits, shared by the engine (tetrad.inference), the planner (`tetrad plan serve`) and
the command line, whose help shows these defaults. No torch here: the settings only the torch side can check (dtype and
attention backend names, memory sizes, the device) are EngineConfig's
(tetrad/inference/worker/config.py), which extends ServeConfig.

What a layout must satisfy on its own is checked on construction; against a model, the planner's
rules are tetrad.planner.serving.check_serve_layout and the engine's, which combinations it runs,
tetrad.inference.ranks.layout.check_servable."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tetrad.errors import ConfigError, check_choice, check_positive

PREEMPTION_MODES = ("recompute", "swap")
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, the planner's int8 / int4 serving
# A model stored quantized (`tetrad create --quantize`): its projections' file, beside
# model.safetensors (tetrad.models.quant_store).
QUANTIZED_FILE = "tetrad-quantized.safetensors"
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8")  # auto: the model's; fp8 is E4M3 storage
DEFAULT_CPU_KV_MEMORY = 512 * 2**20  # --kv-memory on a CPU (on a GPU: the memory left free)


@dataclass(frozen=True)
class ServeLayout:
    """Processes = tp * pp * dp; ep does not multiply them (experts are spread over ranks that
    exist already: a tp group, or groups of dp ranks)."""

    tp: int = 1  # tensor-parallel ranks (processes; GPUs with --device cuda)
    pp: int = 1  # pipeline stages (each of tp ranks)
    dp: int = 1  # attention data-parallel ranks, each with its own requests and KV pool
    ep: int = 1  # ranks the routed experts are spread over

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            check_positive(name, value)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict[str, int]:
        """The degrees alone (a ServeConfig's other settings left out)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}

    def describe(self) -> str:
        return " ".join(f"{name}{value}" for name, value in self.to_dict().items()
                        if value > 1) or "one process"


@dataclass(frozen=True)
class ServeConfig(ServeLayout):
    """Field names are the `tetrad serve / run / generate` flags with '-' for '_'; every default
    is declared here once (the scheduler and the command-line help read them from here)."""

    dtype: str = "auto"  # auto: the checkpoint's dtype (a model object's parameters')
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    block_size: int = 16
    kv_memory: str | int | None = None  # KV pool budget; None: DEFAULT_CPU_KV_MEMORY or the GPU's
    swap_memory: str | int = "256MiB"  # CPU pool for --preemption swap
    num_blocks: int = 0  # > 0 overrides kv_memory (tests force preemption with a tiny pool)
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (the token budget)
    max_model_len: int = 0  # 0 means the model's max_seq_len
    enable_prefix_caching: bool = True
    preemption: str = "recompute"  # recompute | swap, when KV blocks run out
    attention: str = "auto"
    watermark: float = 0.01
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    compile: bool = False  # torch.compile the forward (and FlexAttention)
    quantization: str = "none"  # none | int8 | int4: the blocks' projections, at load
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bf16 | fp16 | fp8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization != "none" and self.dtype == "fp32":
            raise ConfigError(f"--quantization {self.quantization} computes in 16 bits: use "
                              f"--dtype bf16 or fp16 (or auto: bf16 for an fp32 checkpoint)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_positive(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len", "watermark"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_choice("preemption", self.preemption, PREEMPTION_MODES)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class ServerConfig:
    """`tetrad serve`'s access and limits. Field names are its flags with '-' for '_'."""

    api_key: str | None = None  # clients send "Authorization: Bearer KEY" to /v1 and /tokenize
    max_request_bytes: int = 16 * 2**20  # request body
    max_sequences_per_request: int = 256  # prompts x n
    max_stop_strings: int = 16  # per request; `tetrad create` checks a Modelfile against it
    max_waiting_requests: int = 1024  # requests queued and not started: more get a 503
    request_timeout: float = 600.0  # seconds; a request still running then is stopped (408)
    enable_docs: bool = False  # /docs, /redoc and /openapi.json
    stream_interval: int = 1  # engine steps between a stream's events (AsyncEngine)
    template_timeout: float = 5.0  # seconds a chat template may render (front_end.py)

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_sequences_per_request", "max_waiting_requests",
                     "request_timeout", "stream_interval", "template_timeout"):
            check_positive(name, getattr(self, name))
        check_positive("max_stop_strings", self.max_stop_strings, allow_zero=True)
        for name in ("request_timeout", "template_timeout"):  # nan passes check_positive
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number of seconds, got "
                                  f"{getattr(self, name)}")
