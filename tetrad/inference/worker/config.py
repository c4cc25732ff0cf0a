"""What the serving engine's modules share, below all of them: the engine's settings and what the
runner needs of a serving rank. engine.py uses runner.py and ranks.py, and ranks.py uses
runner.py; they meet here, so that none of them imports another that imports it back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tetrad.spec.model import check_choice, check_positive
from tetrad.errors import ConfigError
from tetrad.inference.worker.kv_cache import DTYPE_BYTES, KVPlan

from tetrad.inference.worker.attention import BACKENDS as ATTENTION_BACKENDS  # live: names


@dataclass(frozen=True)
class EngineConfig:
    """Field names are the `tetrad serve / run / generate` flags with '-' for '_'."""

    dtype: str = "auto"  # auto: the checkpoint's dtype (a model object's parameters')
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    block_size: int = 16
    kv_memory: str | int | None = None  # KV pool budget; None: 512 MiB on CPU, free memory on GPU
    swap_memory: str | int = "256MiB"  # CPU pool for --preemption swap
    num_blocks: int = 0  # > 0 overrides kv_memory (tests force preemption with a tiny pool)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 means the model's max_seq_len
    enable_prefix_caching: bool = True
    preemption: str = "recompute"
    attention: str = "auto"
    watermark: float = 0.01
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks (processes; GPUs with --device cuda)
    pp: int = 1  # pipeline stages (each of tp ranks)
    ep: int = 1  # ranks the routed experts are spread over (divides dp, or = tp: layout.py)
    dp: int = 1  # attention data-parallel ranks, each with its own requests and KV pool
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    compile: bool = False  # torch.compile the forward (and FlexAttention)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", *DTYPE_BYTES))
        check_choice("attention", self.attention, ATTENTION_BACKENDS)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tp", "pp", "ep",
                     "dp"):
            check_positive(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len", "watermark"):
            check_positive(name, getattr(self, name), allow_zero=True)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for, but torch sees no GPU: use "
                              f"--device cpu")


class RankShare(Protocol):
    """A serving rank as the runner sees it (rank_share.ServingRanks): it cuts this rank's share of
    the model and agrees with the other ranks on the KV pool; `size` is the tensor-parallel
    degree the pool's kv heads are split by."""

    @property
    def size(self) -> int: ...

    def shard(self, model: nn.Module) -> nn.Module: ...

    def agree(self, plan: KVPlan) -> KVPlan: ...
