"""The run report (the JSON contract in DESIGN.md, schema 1)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from tetrad.spec.runtime_rules import COLLECTIVE_KINDS

REPORT_SCHEMA = 1


def zero_per_comm_kind() -> dict[str, int]:
    return {kind: 0 for kind in COLLECTIVE_KINDS}


def rank_entry(rank: int, coords: dict[str, int], bytes_held: dict[str, int],
               activations_peak: int, comm_bytes: dict[str, int] | None,
               idle_fraction: float = 0.0, step_times: list[float] | None = None,
               cuda_memory: dict[str, int] | None = None,
               comm_exposed: tuple[float, dict[str, float]] | None = None) -> dict[str, Any]:
    """One rank's measurements; `step_time_s` is the median of its step times after the
    first (which pays for warm-up), or of the one step there is. `cuda_memory` (on a GPU):
    the CUDA allocator's `allocated_peak` and `reserved_peak` bytes over the run, None on CPU.
    `comm_exposed` (the byte counter's exposed_per_step: seconds per step spent waiting on
    communication, in all and by kind) becomes "comm_exposed_s" and "comm_exposed_by_kind_s"
    (0 and {} without collectives)."""
    timed = (step_times or [])[1:] or step_times
    median = statistics.median(timed) if timed else None
    exposed, exposed_by_kind = comm_exposed or (0.0, {})
    return {"rank": rank, "coords": coords,
            "bytes": {**bytes_held, "activations_peak": activations_peak},
            "comm_bytes": {**zero_per_comm_kind(), **(comm_bytes or {})},
            "comm_exposed_s": exposed, "comm_exposed_by_kind_s": exposed_by_kind,
            "idle_fraction": idle_fraction, "step_time_s": median, "cuda_memory": cuda_memory}


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
