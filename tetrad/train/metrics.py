"""Measurements of a run and the run report (the JSON contract in DESIGN.md, schema 1)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPORT_SCHEMA = 1
COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")


class ActivationMeter:
    """Counts the bytes autograd keeps alive for backward (the activations), by hooking every
    tensor saved during forward. Parameters are excluded (they are counted as params), and a
    storage saved by several operations is counted once. Works on any device, CPU included."""

    def __init__(self, model: nn.Module):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.peak_bytes = 0
        self._storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameter_storages:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def measure(self):
        """Context manager around one microbatch's forward."""
        self._storages = {}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def finish_microbatch(self) -> int:
        held = sum(self._storages.values())
        self.peak_bytes = max(self.peak_bytes, held)
        self._storages = {}
        return held


def empty_comm_bytes() -> dict[str, int]:
    return {kind: 0 for kind in COMM_KINDS}


def rank_entry(rank: int, coords: dict[str, int], bytes_held: dict[str, int],
               activations_peak: int, comm_bytes: dict[str, int] | None,
               idle_fraction: float = 0.0) -> dict[str, Any]:
    return {"rank": rank, "coords": coords,
            "bytes": {**bytes_held, "activations_peak": activations_peak},
            "comm_bytes": {**empty_comm_bytes(), **(comm_bytes or {})},
            "idle_fraction": idle_fraction}


def build_report(config: dict[str, Any], steps: list[dict[str, Any]], ranks: list[dict[str, Any]],
                 predicted: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"schema": REPORT_SCHEMA, "config": config, "steps": steps, "ranks": ranks,
            "predicted": predicted, **extra}


def write_json_atomic(path: str | Path, value: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    temporary.write_text(json.dumps(value, indent=2))
    os.replace(temporary, path)
