"""The local model store behind `tetrad create / list / show / rm` and every command that takes a
model by name (torch-free).

A stored model is a model folder under the store's root, `<root>/<namespace>/<name>/<tag>/`
(namespace `library` when the name has none, as in Ollama): the weights,
config and tokenizer files of the folder it was created from, `chat_template.jinja` when the
Modelfile has a TEMPLATE, and `tetrad-model.json` (the Modelfile's settings, where it came from,
when). Names are Ollama's: `name[:tag]` (tag `latest` by default), lowercase letters, digits and
`._-`, with at most one `namespace/` in front.

Creating copies the files, hardlinked where the store and the source share a filesystem: instant
and free of space, and the stored model keeps working when the source (a training run's
checkpoints, say) is deleted. tetrad never rewrites a saved file in place (a checkpoint save writes
a new step folder), so a hardlinked file never changes under the store. Of a checkpoint only what
serving reads is taken: not the optimizer step and RNG states (training_state.pt, run.json), and
of an HF folder only the formats tetrad loads (safetensors, JSON, tokenizer files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrad.errors import ConfigError
from tetrad.hf_config import resolve_checkpoint
from tetrad.modelfile import Modelfile, ModelfileError, render_modelfile
from tetrad.safetensors_subset import tensor_keys, write_subset

STORE_ENV = "TETRAD_HOME"  # the store is $TETRAD_HOME/models
MANIFEST = "tetrad-model.json"
DEFAULT_TAG = "latest"
DEFAULT_NAMESPACE = "library"  # every folder is three deep, so no name's folder holds another's
NAME_PART = r"[a-z0-9][a-z0-9._-]{0,63}"
NAME = re.compile(rf"(?:({NAME_PART})/)?({NAME_PART})(?::({NAME_PART}))?")
# Never taken from a source folder: training state, and weight formats tetrad does not read.
SKIPPED_FILES = {"training_state.pt", "run.json", MANIFEST}
SKIPPED_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf"}


def default_root() -> Path:
    """$TETRAD_HOME/models, else the user's cache folder: $XDG_CACHE_HOME/tetrad/models or
    ~/.cache/tetrad/models."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser() / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tetrad" / "models"


def parse_name(name: str) -> str:
    """`name[:tag]` -> its full form `name:tag`; a ConfigError saying the rule otherwise."""
    match = NAME.fullmatch(name.strip().lower())
    if not match:
        raise ConfigError(f"{name!r} is not a model name: use name[:tag] of lowercase letters, "
                          f"digits, '.', '_' and '-' (e.g. shakespeare:v1), at most 64 each")
    namespace, base, tag = match.groups()
    prefix = f"{namespace}/" if namespace not in (None, DEFAULT_NAMESPACE) else ""
    return f"{prefix}{base}:{tag or DEFAULT_TAG}"


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / "model.json").is_file()


@dataclass
class StoredModel:
    name: str  # name:tag
    folder: Path
    manifest: dict[str, Any]

    @property
    def system(self) -> str | None:
        return self.manifest.get("system")

    @property
    def parameters(self) -> dict[str, Any]:
        return self.manifest.get("parameters", {})

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The PARAMETERs that are SamplingParams fields (all but the context length)."""
        return {key: tuple(value) if key == "stop" else value
                for key, value in self.parameters.items() if key != "max_model_len"}

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.manifest.get("messages", [])

    @property
    def size(self) -> int:
        return sum(path.stat().st_size for path in self.folder.iterdir() if path.is_file())

    def modelfile(self) -> str:
        template = self.folder / "chat_template.jinja"
        return render_modelfile(
            str(self.folder), self.system,
            template.read_text() if self.manifest.get("template") else None, self.parameters,
            self.messages, self.manifest.get("license", []))


class ModelStore:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def folder(self, name: str) -> Path:
        base, _, tag = parse_name(name).rpartition(":")
        namespace, _, base = base.rpartition("/")
        return self.root / (namespace or DEFAULT_NAMESPACE) / base / tag

    def get(self, name: str) -> StoredModel | None:
        folder = self.folder(name)
        if not (folder / MANIFEST).is_file():
            return None
        return StoredModel(parse_name(name), folder, json.loads((folder / MANIFEST).read_text()))

    def require(self, name: str) -> StoredModel:
        model = self.get(name)
        if model is None:
            raise ConfigError(f"no model named {parse_name(name)} in {self.root}: `tetrad list` "
                              f"shows the stored ones, `tetrad create` adds one")
        return model

    def list(self) -> list[StoredModel]:
        models = []
        for manifest in sorted(self.root.glob(f"*/*/*/{MANIFEST}")):
            folder = manifest.parent
            if any(part.startswith(".") for part in folder.relative_to(self.root).parts):
                continue  # a create in progress
            values = json.loads(manifest.read_text())
            models.append(StoredModel(values["name"], folder, values))
        return sorted(models, key=lambda model: model.name)

    def create(self, name: str, modelfile: Modelfile, modelfile_text: str = "",
               origin: str | None = None) -> StoredModel:
        """Store FROM's model under `name` with the Modelfile's settings (over those of a stored
        FROM), replacing a model of that name. Atomic: a failure leaves the store as it was.
        `origin`: what `tetrad list` shows it came from (default: FROM)."""
        full = parse_name(name)
        source, base = self._source(modelfile)
        settings = {"system": base.system if base else None,
                    "parameters": dict(base.parameters) if base else {},
                    "messages": base.messages if base else [],
                    "license": base.manifest.get("license", []) if base else [],
                    "template": bool(base and base.manifest.get("template"))}
        if modelfile.system is not None:
            settings["system"] = modelfile.system
        settings["parameters"].update(modelfile.parameters)
        settings["messages"] = modelfile.messages or settings["messages"]
        settings["license"] = modelfile.license or settings["license"]
        settings["template"] = settings["template"] or modelfile.template is not None
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            shards = copy_model_pieces(source, staging)
            for path in sorted(source.iterdir()):
                if (path.is_file() and not path.name.startswith(".")
                        and path.name not in SKIPPED_FILES | shards
                        and path.suffix not in SKIPPED_SUFFIXES):
                    link_or_copy(path, staging / path.name)
            if modelfile.template is not None:
                (staging / "chat_template.jinja").write_text(modelfile.template)
            manifest = {"name": full, "from": origin or modelfile.source, "source": str(source),
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **settings,
                        "modelfile": modelfile_text}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            target = self.folder(full)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                retired = self.root / f".tmp-{uuid.uuid4().hex}"
                target.rename(retired)
                shutil.rmtree(retired)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.require(full)

    def _source(self, modelfile: Modelfile) -> tuple[Path, StoredModel | None]:
        """FROM's folder, and the stored model it names (None for a folder)."""
        path = (modelfile.folder / Path(modelfile.source).expanduser())
        if path.exists():
            folder = resolve_checkpoint(path)
            if not is_model_folder(folder):
                raise ModelfileError(f"FROM {modelfile.source}: {folder} is not a model folder "
                                     f"(an HF folder with config.json, or a tetrad checkpoint)")
            return folder, None
        try:
            base = self.get(modelfile.source)
        except ConfigError:
            base = None
        if base is None:
            raise ModelfileError(f"FROM {modelfile.source}: no such folder (relative to the "
                                 f"Modelfile's) and no stored model of that name (tetrad list)")
        return base.folder, base

    def remove(self, name: str) -> None:
        model = self.require(name)
        retired = self.root / f".tmp-{uuid.uuid4().hex}"
        model.folder.rename(retired)
        shutil.rmtree(retired)
        for parent in model.folder.parents:  # the name's now empty folders
            if parent == self.root or any(parent.iterdir()):
                break
            parent.rmdir()


def copy_model_pieces(source: Path, target: Path) -> set[str]:
    """A tetrad checkpoint's parameters without its AdamW moments (two thirds of its bytes, and
    only for resuming): index.json and the shard files, those holding nothing else hardlinked,
    the others rewritten with the parameters only. Returns the names of the files it handled
    (none for an HF folder)."""
    index_file = source / "index.json"
    if not (source / "model.json").is_file() or not index_file.is_file():
        return set()
    index = json.loads(index_file.read_text())
    pieces = [entry for entry in index["pieces"] if entry["kind"] == "model"]
    files = {entry["file"] for entry in index["pieces"]}
    for file in sorted({entry["file"] for entry in pieces}):
        keys = {entry["key"] for entry in pieces if entry["file"] == file}
        if tensor_keys(source / file) == keys:
            link_or_copy(source / file, target / file)
        else:
            write_subset(source / file, target / file, keys)
    (target / "index.json").write_text(json.dumps({**index, "pieces": pieces}))
    return files | {"index.json"}


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or one without hardlinks
        shutil.copy2(source, target)


def resolve_model_argument(argument: str, store: ModelStore | None = None
                           ) -> tuple[str, StoredModel | None]:
    """What a command's model argument names: an existing path as is, else a stored model (its
    folder and its settings)."""
    if Path(argument).expanduser().exists():
        return argument, None
    store = store or ModelStore()
    try:
        stored = store.get(argument)
    except ConfigError:  # not a name either
        raise ConfigError(f"{argument} does not exist: pass a model folder or a stored model's "
                          f"name (tetrad list)") from None
    if stored is None:
        raise ConfigError(f"{argument} is neither a folder nor a model in {store.root} "
                          f"(tetrad list shows them)")
    return str(stored.folder), stored
