"""Checkpoints that are either complete or absent, written in pieces by every rank.

Layout of a checkpoint root:
  latest                  the name of the newest complete step folder
  step_00000300/
    shard_00000.safetensors   each rank's pieces of the parameters and AdamW moments, only
    shard_00003.safetensors   its own (tp shards, ZeRO ranges, stages, experts; no replicas)
    index.json            every piece: its file, the global tensor's shape, where it lies in it
    model.json            ModelConfig fields
    training_state.pt     optimizer step, loss-scaler state, every rank's RNG state
    run.json              step, the resolved TrainConfig, the sha256 of the two files above
    tokenizer.json        only for BPE tokenizers

Every rank writes its shard into one staging folder (the root must be shared by all ranks, as
on a cluster's shared filesystem); once every shard is flushed, rank 0 writes the rest, renames
the folder into place and replaces `latest` atomically. A run killed mid-save leaves at most a
`.tmp-*` folder, which loading ignores and the next save removes. With `keep` N > 0, a save
deletes all but the N newest step folders once `latest` points at the new one. Loading reads
each tensor whole from its pieces, whatever layout wrote them (tetrad.sharded_tensors), so a run
resumes under any other layout.

Loading trusts nothing it reads: `latest` must name an existing step folder, run.json's step must
be its folder's, every file must match its checksum (pieces: index.json; the rest: run.json), and
anything else wrong is one ConfigError naming the file, never a traceback or a silent restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from tetrad.spec.model import ModelConfig, from_dict
from tetrad.errors import ConfigError, TetradError
from tetrad.sharded_tensors import Piece, ShardedReader, write_index, write_pieces

LATEST = "latest"
STEP_FOLDER = re.compile(r"step_(\d{8})")
CHECKSUMMED = ("model.json", "training_state.pt")  # their sha256 sits in run.json


def step_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def file_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename is durable once its folder is flushed)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    temporary.write_text(text)
    _fsync(temporary)
    os.replace(temporary, path)
    _fsync(path.parent)


def save_checkpoint(root: str | Path, step: int, rank: int, pieces: list[Piece],
                    exchange: Callable[[Any], list[Any]], training_state: dict[str, Any],
                    model_config: ModelConfig, run: dict[str, Any], tokenizer=None,
                    keep: int = 0) -> Path | None:
    """Write a complete checkpoint of `step` (number of optimizer steps done): this rank's
    `pieces`, and on rank 0 everything else (its `training_state` stands for every rank's), then
    point `latest` at it; with `keep` > 0, delete all but the `keep` newest step folders.
    Collective: every rank calls it with `exchange` (every rank's value, in rank order). Returns
    the step folder on rank 0, None elsewhere."""
    root = Path(root)
    final = root / step_folder_name(step)
    staging = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # what a killed save left
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        staging.mkdir()
    exchange(None)  # the staging folder exists before any rank writes into it
    if pieces and not staging.is_dir():
        raise TetradError(not_shared(root, rank))
    by_rank = exchange(write_pieces(staging, rank, pieces))  # every shard is on disk
    if rank != 0:
        return None
    present = {path.name for path in staging.iterdir()}
    unseen = [writer for writer, entries in enumerate(by_rank)
              if entries and entries[0]["file"] not in present]
    if unseen:  # written into a folder of the same name on another machine's disk
        raise TetradError(not_shared(root, unseen[0]))
    write_index(staging, [entry for entries in by_rank for entry in entries])
    (staging / "model.json").write_text(json.dumps(model_config.to_dict(), indent=2))
    torch.save(training_state, staging / "training_state.pt")
    checksums = {name: file_digest(staging / name) for name in CHECKSUMMED}
    (staging / "run.json").write_text(json.dumps({"step": step, **run, "sha256": checksums},
                                                 indent=2))
    if tokenizer is not None:
        tokenizer.save(staging)
    for path in staging.iterdir():  # the shards were flushed by their writers
        if not path.name.startswith("shard_"):
            _fsync(path)
    _fsync(staging)
    # Replacing a step folder (a run rewound past it saves it again): the old one moves aside
    # and is deleted last, so `latest` names a missing folder for two renames, not a deletion.
    replaced = root / f".tmp-replaced-{final.name}"
    if final.exists():
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync(root)
    _write_atomic(root / LATEST, final.name)
    shutil.rmtree(replaced, ignore_errors=True)
    if keep > 0:
        prune_checkpoints(root, keep)
    return final


def not_shared(root: Path, rank: int) -> str:
    return (f"rank {rank} cannot write into rank 0's checkpoint folder {root}: every rank must "
            f"see the same --checkpoint-dir (a filesystem shared by all nodes)")


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the `keep` newest step folders of `root`, never the one `latest` names."""
    latest = (root / LATEST).read_text().strip()
    folders = sorted(path for path in root.glob("step_*") if path.is_dir())
    for folder in folders[:-keep]:
        if folder.name != latest:
            shutil.rmtree(folder, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path | None:
    """The step folder to resume from: `path` itself if it is one, else the one its `latest`
    names; None for a folder holding no checkpoint yet. Step folders without a valid `latest`
    are refused rather than overwritten by a run starting again from step 1."""
    path = Path(path)
    if (path / "model.json").is_file():
        return path
    latest = path / LATEST
    if not latest.exists():
        saved = sorted(folder.name for folder in path.glob("step_*"))
        if saved:
            raise ConfigError(f"{path} holds {saved[-1]} but no {LATEST} file: write the name of "
                              f"the step folder to resume from into {latest}")
        return None
    try:
        name = latest.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{latest} is not readable text ({error}): write the name of the step "
                          f"folder to resume from into it") from None
    if not STEP_FOLDER.fullmatch(name):
        raise ConfigError(f"{latest} holds {name[:40]!r}, not a step folder name like "
                          f"{step_folder_name(300)}: write the one to resume from into it")
    folder = path / name
    if not (folder / "model.json").is_file():
        raise ConfigError(f"checkpoint {folder} named by {latest} is missing or incomplete")
    return folder


def read_json(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ConfigError(f"checkpoint {folder} is corrupt ({name}: {error})") from None


def read_model_config(folder: Path) -> ModelConfig:
    values = read_json(folder, "model.json")
    if not isinstance(values, dict):
        raise ConfigError(f"checkpoint {folder} is corrupt (model.json holds a "
                          f"{type(values).__name__}, not an object of ModelConfig fields)")
    return from_dict(ModelConfig, values)


def read_step(folder: Path) -> int:
    """run.json's step, which must be its folder's, after checking the files run.json has
    checksums for."""
    run = read_json(folder, "run.json")
    step = run.get("step") if isinstance(run, dict) else None
    match = STEP_FOLDER.fullmatch(folder.name)
    if type(step) is not int or step < 1 or match and int(match.group(1)) != step:
        raise ConfigError(f"checkpoint {folder} is corrupt (run.json's step is {step!r}, not "
                          f"the step of its folder)")
    checksums = run.get("sha256", {})
    if not isinstance(checksums, dict):
        raise ConfigError(f"checkpoint {folder} is corrupt (run.json's sha256 is {checksums!r})")
    for name in CHECKSUMMED:
        if name in checksums and file_digest(folder / name) != checksums[name]:
            raise ConfigError(f"checkpoint {folder} is corrupt ({name} does not match its "
                              f"checksum in run.json)")
    return step


def read_training_state(folder: Path) -> dict[str, Any]:
    try:
        shared = torch.load(folder / "training_state.pt", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever a damaged file makes the unpickler raise
        raise ConfigError(f"checkpoint {folder} is corrupt (training_state.pt: "
                          f"{str(error).splitlines()[0] if str(error) else type(error).__name__})"
                          ) from None
    rng_size = torch.get_rng_state().numel()
    rngs = shared.get("rng") if isinstance(shared, dict) else None
    if (not isinstance(shared, dict) or not isinstance(shared.get("optimizer"), dict)
            or "step" not in shared["optimizer"] or not isinstance(rngs, list) or not rngs
            or not all(isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8
                       and rng.shape == (rng_size,) for rng in rngs)):
        raise ConfigError(f"checkpoint {folder} is corrupt (training_state.pt lacks the "
                          f"optimizer step or the ranks' generator states)")
    return shared


def load_checkpoint(folder: Path, expected_model: ModelConfig) -> tuple[int, dict[str, Any]]:
    """(step, state) of a checkpoint, after checking it was made for this model shape. The
    state holds whole tensors by name, each read from its pieces only when looked up: "model",
    "optimizer" (step, "exp_avg", "exp_avg_sq"), and "scaler" and "rng" (one per saving rank)."""
    step = read_step(folder)
    saved_model = read_model_config(folder)
    differences = [f"{key}: checkpoint {value!r} vs run {getattr(expected_model, key)!r}"
                   for key, value in saved_model.to_dict().items()
                   if key != "name" and getattr(expected_model, key) != value]
    if differences:
        raise ConfigError(f"checkpoint {folder} was made for another model ("
                          f"{'; '.join(differences[:3])}): resume with the same --model")
    shared = read_training_state(folder)
    reader = ShardedReader(folder)
    optimizer = {"step": shared["optimizer"]["step"], "exp_avg": reader.tensors("exp_avg"),
                 "exp_avg_sq": reader.tensors("exp_avg_sq")} if reader.names("exp_avg") else None
    return step, {"model": reader.tensors("model"), "optimizer": optimizer,
                  "scaler": shared.get("scaler"), "rng": shared["rng"]}
