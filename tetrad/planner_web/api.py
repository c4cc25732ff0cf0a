"""The page's JSON API. A request names `tetrad plan` options by their flags' names; they become
the very command line the terminal takes (the page shows it), run through the CLI's own parser,
checks and search (the `plan` callable the CLI hands in), and come back as the plan JSON of
tetrad.planner.report, what `tetrad plan --json` prints, with details.py's drawings beside it."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GPUS, GiB, Cluster
from tetrad.hardware.profile import CLUSTER_PRESETS
from tetrad.planner.report import serving_json, training_json
from tetrad.planner.search import SearchResult
from tetrad.planner.serving import ServeWorkload
from tetrad.planner.training import TrainWorkload
from tetrad.planner_web.details import training_details
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import PRESETS

# The options a page may set (the terminal's --json and --png are not among them), in the order
# the command line shows them; true stands for a flag alone (--compile, --offload).
OPTIONS = ("model", "gpu", "num_gpus", "gpus_per_node", "nic_gbps", "tp", "pp", "dp", "cp", "ep",
           "vpp", "zero", "offload", "recompute", "recompute_ops", "schedule", "micro_batch",
           "global_batch", "seq_len", "dtype", "tokens", "stack", "compile",
           "node_limited_dispatch", "kv_dtype", "prompt_len", "output_len", "context_len", "batch",
           "gpu_memory_utilization", "price_per_gpu_hour", "gpu_power", "rank_by", "top")
MAX_UPLOAD_BYTES = 1 << 20  # an HF config.json is a few KB
CACHED_PLANS = 16  # a page's clicks on a ranking's rows ask for the same search again


@dataclass(frozen=True)
class Planned:
    """One `tetrad plan` search, as the CLI ran it."""

    mode: str
    config: ModelConfig
    cluster: Cluster
    workload: TrainWorkload | ServeWorkload
    global_batch: int | None
    result: SearchResult
    tokens: float = 0.0

    def plan_json(self) -> dict:
        if self.mode == "train":
            return training_json(self.config, self.cluster, self.workload, self.global_batch,
                                 self.result, self.tokens)
        return serving_json(self.config, self.cluster, self.workload, self.result)


def request_argv(request: dict, model_path: str | None = None) -> list[str]:
    """The `tetrad plan` arguments of a page's request: {"mode", "options": {flag name: value,
    null, "" or false for searched or the default}}; `model_path` stands for an uploaded
    model."""
    mode = request.get("mode")
    if mode not in ("train", "serve"):
        raise ConfigError(f"mode must be train or serve, got {mode!r}")
    options = request.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError("options must be an object of flag names and values")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
    if model_path is not None:
        options = {**options, "model": model_path}
    argv = [mode]
    for name in OPTIONS:
        value = options.get(name)
        if value is True:
            argv.append(f"--{name.replace('_', '-')}")
        elif not (value is None or value is False or value == ""):  # 0 is a value (refused)
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


class Uploads:
    """Uploaded config.json files, each kept as <folder>/<digest>/<name>/config.json so that
    the planner names the model after the folder, as it does a downloaded one."""

    def __init__(self, folder: Path):
        self.folder = folder

    def save(self, name: str, text: str) -> str:
        if len(text.encode()) > MAX_UPLOAD_BYTES:
            raise ConfigError(f"an uploaded config.json is at most {MAX_UPLOAD_BYTES:,} bytes")
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"the uploaded file is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ConfigError("the uploaded config.json must hold one JSON object")
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "uploaded"
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        path = self.folder / digest / safe / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)


class PlanPage:
    """The API behind the page: `options()` for its menus, `plan(request)` for a plan."""

    def __init__(self, plan: Callable[[list[str]], Planned], choices: dict, uploads: Uploads):
        self._plan = plan
        self._choices = choices
        self._uploads = uploads
        self._cache: OrderedDict[tuple[str, ...], Planned] = OrderedDict()

    def options(self) -> dict:
        gpus = [{"name": name, "memory_gib": round(gpu.memory_bytes / GiB),
                 "price_per_hour": gpu.price_per_hour or None} for name, gpu in GPUS.items()]
        return {"models": list(PRESETS), "gpus": gpus, "servers": list(CLUSTER_PRESETS),
                "choices": self._choices}

    def plan(self, request: dict) -> dict:
        upload = request.get("upload")
        model_path = (self._uploads.save(str(upload.get("name", "")), str(upload.get("text", "")))
                      if isinstance(upload, dict) else None)
        argv = request_argv(request, model_path)
        planned = self._planned(tuple(argv))
        out = {"command": "tetrad plan " + shlex.join(argv), "plan": planned.plan_json()}
        if planned.mode == "train":
            index = request.get("detail", 0)
            if not isinstance(index, int) or not 0 <= index < len(planned.result.ranked):
                raise ConfigError(f"detail must be a row of the ranking (0 to "
                                  f"{len(planned.result.ranked) - 1}), got {index!r}")
            out["detail"] = {"row": index, **training_details(
                planned.config, planned.cluster, planned.result.ranked[index].layout,
                planned.workload)}
        return out

    def _planned(self, argv: tuple[str, ...]) -> Planned:
        if argv in self._cache:
            self._cache.move_to_end(argv)
            return self._cache[argv]
        planned = self._cache[argv] = self._plan(list(argv))
        if len(self._cache) > CACHED_PLANS:
            self._cache.popitem(last=False)
        return planned
