"""Checkpoints that are either complete or absent.

Layout of a checkpoint root:
  latest                  the name of the newest complete step folder
  step_00000300/
    model.json            ModelConfig fields
    model.safetensors     parameters under tetrad's names
    training_state.pt     optimizer and loss-scaler state, RNG states
    run.json              step, the resolved TrainConfig
    tokenizer.json        only for BPE tokenizers

A step folder is written under a temporary name and renamed into place once every file is
flushed; `latest` is replaced atomically after that. A run killed mid-save leaves at most a
`.tmp-*` folder, which loading ignores and the next save removes. With `keep` N > 0, a save
deletes all but the N newest step folders once `latest` points at the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tetrad.config import ModelConfig, from_dict
from tetrad.errors import ConfigError
from tetrad.hf_config import resolve_checkpoint

LATEST = "latest"


def step_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_folder(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    temporary.write_text(text)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save_checkpoint(root: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    training_state: dict[str, Any], model_config: ModelConfig,
                    run: dict[str, Any], tokenizer=None, keep: int = 0) -> Path:
    """Write a complete checkpoint of `step` (number of optimizer steps done) and point `latest`
    at it; then, with `keep` > 0, delete all but the `keep` newest step folders."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_folder_name(step)
    staging = root / f".tmp-{final.name}-{os.getpid()}"
    staging.mkdir()
    (staging / "model.json").write_text(json.dumps(model_config.to_dict(), indent=2))
    save_file({name: tensor.contiguous() for name, tensor in model_state.items()},
              staging / "model.safetensors")
    torch.save(training_state, staging / "training_state.pt")
    (staging / "run.json").write_text(json.dumps({"step": step, **run}, indent=2))
    if tokenizer is not None:
        tokenizer.save(staging)
    _fsync_folder(staging)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    _write_atomic(root / LATEST, final.name)
    if keep > 0:
        prune_checkpoints(root, keep)
    return final


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the `keep` newest step folders of `root`, never the one `latest` names."""
    latest = (root / LATEST).read_text().strip()
    folders = sorted(path for path in root.glob("step_*") if path.is_dir())
    for folder in folders[:-keep]:
        if folder.name != latest:
            shutil.rmtree(folder, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path | None:
    """A step folder, from either a step folder or a root holding `latest`; None if the root
    has no checkpoint yet."""
    folder = resolve_checkpoint(path)
    if (folder / "model.json").is_file():
        return folder
    if folder != Path(path):
        raise ConfigError(f"checkpoint {folder} named by {Path(path) / LATEST} is incomplete")
    return None


def read_model_config(folder: Path) -> ModelConfig:
    try:
        return from_dict(ModelConfig, json.loads((folder / "model.json").read_text()))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"checkpoint {folder} is corrupt (model.json: {error})") from None


def load_checkpoint(folder: Path, expected_model: ModelConfig
                    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    """(step, model state, training state) of a checkpoint, after checking it was made for
    this model shape."""
    saved_model = read_model_config(folder)
    differences = [f"{key}: checkpoint {value!r} vs run {getattr(expected_model, key)!r}"
                   for key, value in saved_model.to_dict().items()
                   if key != "name" and getattr(expected_model, key) != value]
    if differences:
        raise ConfigError(f"checkpoint {folder} was made for another model ("
                          f"{'; '.join(differences[:3])}): resume with the same --model")
    try:
        step = int(json.loads((folder / "run.json").read_text())["step"])
        model_state = load_file(folder / "model.safetensors")
        training_state = torch.load(folder / "training_state.pt", weights_only=True)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as error:
        raise ConfigError(f"checkpoint {folder} is corrupt: {error}") from None
    return step, model_state, training_state
