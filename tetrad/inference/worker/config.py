"""What the serving engine's modules share, below all of them: the engine's settings (ServeConfig's,
tetrad/spec/serving.py, with the checks that need torch), the device they resolve to, and what
the runner needs of a serving rank. engine.py uses runner.py and ranks.py, and ranks.py uses
runner.py; they meet here, so that none of them imports another that imports it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tetrad.errors import ConfigError, check_choice
from tetrad.inference.worker.kv_cache import DTYPE_BYTES, KVPlan, parse_bytes
from tetrad.spec.serving import ServeConfig

from tetrad.inference.worker.attention import BACKENDS as ATTENTION_BACKENDS  # live: names


@dataclass(frozen=True)
class EngineConfig(ServeConfig):
    """ServeConfig's fields and defaults, with the checks that need the torch side: the dtype
    and attention backend names and the memory sizes. Like ServeConfig, all on construction,
    before any weight is read."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("dtype", self.dtype, ("auto", *DTYPE_BYTES))
        check_choice("attention", self.attention, ATTENTION_BACKENDS)
        for size in (self.kv_memory, self.swap_memory):
            if size is not None:
                parse_bytes(size)


def serving_device(device: str, world_size: int) -> torch.device:
    """Where rank 0 of an engine of `world_size` ranks computes: the one place --device is
    resolved. "auto" is the GPU when torch sees one per rank and the CPU when it sees none; rank r
    of a multi-rank engine runs on cuda:r, so there --device names no single GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.startswith("cuda:") and world_size > 1:
        raise ConfigError(f"--device {device} names one GPU, but with {world_size} ranks rank r "
                          f"runs on cuda:r: use --device cuda")
    if device == "cpu" or (device == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0 and world_size == 1:
        raise ConfigError(f"device {device!r} asked for, but torch sees no GPU: use --device cpu")
    if gpus < world_size:
        raise ConfigError(f"{world_size} ranks (tp*pp*dp) needs {world_size} GPUs (one per "
                          f"rank), torch sees {gpus}: lower --tp, --pp or --dp or use --device "
                          f"cpu")
    if world_size == 1:
        return torch.device("cuda" if device == "auto" else device)
    return torch.device("cuda", 0)


class RankShare(Protocol):
    """A serving rank as the runner sees it (rank_share.ServingRanks): it cuts this rank's share of
    the model and agrees with the other ranks on the KV pool; `size` is the tensor-parallel
    degree the pool's kv heads are split by."""

    @property
    def size(self) -> int: ...

    def shard(self, model: nn.Module) -> nn.Module: ...

    def agree(self, plan: KVPlan) -> KVPlan: ...
