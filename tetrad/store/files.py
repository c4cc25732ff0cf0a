"""The files of a stored model: what the store takes from a checkpoint or a model folder, and how
it writes its own (torch-free)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from tetrad.errors import ConfigError, read_json_file
from tetrad.store.safetensors_subset import tensor_keys, write_subset

MANIFEST = "tetrad-model.json"
# Never taken from a source folder: training state, and weight formats tetrad does not read.
SKIPPED_FILES = {"training_state.pt", "run.json", MANIFEST}
SKIPPED_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf"}


def assemble(folder: Path, source: Path, template: str | None, manifest: dict) -> None:
    """A stored model in the empty `folder`: what serving reads of `source`, the TEMPLATE as
    chat_template.jinja (replacing the source's), and the manifest."""
    shards = copy_model_pieces(source, folder)
    for path in sorted(source.iterdir()):
        if (path.is_file() and not path.name.startswith(".")
                and path.name not in SKIPPED_FILES | shards
                and path.suffix not in SKIPPED_SUFFIXES):
            link_or_copy(path, folder / path.name)
    write_settings(folder, template, manifest)


def write_settings(folder: Path, template: str | None, manifest: dict) -> None:
    """The Modelfile's TEMPLATE as chat_template.jinja (replacing the source's) and the
    manifest."""
    if template is not None:
        write_fresh(folder / "chat_template.jinja", template)
    write_fresh(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def copy_model_pieces(source: Path, target: Path) -> set[str]:
    """A tetrad checkpoint's parameters without its AdamW moments (two thirds of its bytes, and
    only for resuming): index.json and the shard files, those holding nothing else hardlinked,
    the others rewritten with the parameters only. Returns the names of the files it handled
    (none for an HF folder)."""
    index_file = source / "index.json"
    if not (source / "model.json").is_file() or not index_file.is_file():
        return set()
    index = read_json_file(index_file, "checkpoint index", "tetrad train --checkpoint-dir")
    entries = index.get("pieces") if isinstance(index, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(entry, dict) and {"file", "kind", "key"} <= entry.keys()
            and isinstance(entry["file"], str) for entry in entries):
        raise ConfigError(f"{index_file} is not a checkpoint index (a list of pieces, each with "
                          f"its file, kind and key)")
    pieces = [entry for entry in entries if entry["kind"] == "model"]
    files = {entry["file"] for entry in entries}
    for file in sorted(files):
        # Only the shards beside the index: a name with a folder in it could read, and write,
        # outside both the checkpoint and the store.
        if Path(file).name != file or file.startswith(".") or not (source / file).is_file():
            raise ConfigError(f"{index_file} names {file[:80]!r}, which is not a file in "
                              f"{source}")
    for file in sorted({entry["file"] for entry in pieces}):
        keys = {entry["key"] for entry in pieces if entry["file"] == file}
        if tensor_keys(source / file) == keys:
            link_or_copy(source / file, target / file)
        else:
            write_subset(source / file, target / file, keys)
    write_fresh(target / "index.json", json.dumps({**index, "pieces": pieces}))
    return files | {"index.json"}


def link_or_copy(source: Path, target: Path) -> None:
    """`target` as the file `source` is, or points to (an HF cache's snapshot is links): a
    hardlink, so never open it for writing (write_fresh replaces it instead)."""
    try:
        os.link(source.resolve(), target)  # the file, never a link to it
    except OSError:  # another filesystem, or one without hardlinks
        shutil.copy2(source, target)


def write_fresh(path: Path, text: str) -> None:
    """`text` as a new file at `path`, never written through a file already there: the store's
    files are hardlinks shared with their source folder and with every model stored from it."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
