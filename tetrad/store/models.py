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
checkpoints, say) is deleted. A hardlink shares its bytes with the source and with every model
stored from it, so the store never opens one for writing: what it writes (a TEMPLATE, its
manifest) is a new file renamed into place (store_files.write_fresh). Of a checkpoint only what
serving reads is taken: not the optimizer step and RNG states (training_state.pt, run.json), and
of an HF folder only the formats tetrad loads (safetensors, JSON, tokenizer files).

A name changes hands (create, rm) under an exclusive lock on `<root>/.lock` and is read under a
shared one, so concurrent creates of one name each store a whole model and the last one wins.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tetrad.errors import ConfigError
from tetrad.spec.hf import resolve_checkpoint
from tetrad.store.modelfile import (ROLES, Modelfile, ModelfileError, check_parameters,
                              render_modelfile)
from tetrad.spec.presets import resolve_model
from tetrad.store.files import MANIFEST, assemble, write_settings
from tetrad.store.gguf import gguf_folder, is_gguf_file, unpack_gguf
from tetrad.store.quantized import check_quantizable_source, store_quantized

STORE_ENV = "TETRAD_HOME"  # the store is $TETRAD_HOME/models
MANIFEST_FIELDS = {"name": str, "from": str, "source": str, "created": str,
                   "system": (str, type(None)), "parameters": dict, "messages": list,
                   "license": list, "template": bool, "modelfile": str}
LOCK = ".lock"
DEFAULT_TAG = "latest"
DEFAULT_NAMESPACE = "library"  # every folder is three deep, so no name's folder holds another's
NAME_PART = r"[a-z0-9][a-z0-9._-]{0,63}"
NAME = re.compile(rf"(?:({NAME_PART})/)?({NAME_PART})(?::({NAME_PART}))?")


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
        raise ConfigError(f"{name[:80]!r} is not a model name: use name[:tag] of lowercase "
                          f"letters, digits, '.', '_' and '-' (e.g. shakespeare:v1), at most 64 "
                          f"each")
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
    size: int  # bytes of its files, as read with the manifest (a later create may replace them)

    @property
    def system(self) -> str | None:
        return self.manifest["system"]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.manifest["parameters"]

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The PARAMETERs that are SamplingParams fields (all but the context length)."""
        return {key: tuple(value) if key == "stop" else value
                for key, value in self.parameters.items() if key != "max_model_len"}

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.manifest["messages"]

    def modelfile(self) -> str:
        template = None
        if self.manifest["template"]:
            path = self.folder / "chat_template.jinja"
            try:
                template = path.read_text()
            except (OSError, UnicodeDecodeError) as error:
                raise ConfigError(f"stored model {self.name} is broken ({path}: {error}): "
                                  f"`tetrad rm {self.name}` removes it") from None
        return render_modelfile(str(self.folder), self.system, template, self.parameters,
                                self.messages, self.manifest["license"])


class ModelStore:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def folder(self, name: str) -> Path:
        base, _, tag = parse_name(name).rpartition(":")
        namespace, _, base = base.rpartition("/")
        return self.root / (namespace or DEFAULT_NAMESPACE) / base / tag

    def get(self, name: str) -> StoredModel | None:
        """The model stored as `name`, None when there is none; a ConfigError saying what is wrong
        with a broken one."""
        folder = self.folder(name)
        with self._lock(exclusive=False):
            if not os.path.lexists(folder):
                return None
            return self._load(folder)

    def require(self, name: str) -> StoredModel:
        model = self.get(name)
        if model is None:
            raise self._missing(name)
        return model

    def list(self) -> list[StoredModel]:
        return self.scan()[0]

    def scan(self) -> tuple[list[StoredModel], list[str]]:
        """The healthy models, sorted by name, and what is wrong with each broken one."""
        models, broken = [], []
        with self._lock(exclusive=False):
            for folder in sorted(self.root.glob("*/*/*")):
                if any(part.startswith(".") for part in folder.relative_to(self.root).parts):
                    continue  # a create in progress, the lock
                if folder.is_dir() or folder.is_symlink():
                    try:
                        models.append(self._load(folder))
                    except ConfigError as error:
                        broken.append(str(error))
        return sorted(models, key=lambda model: model.name), broken

    def create(self, name: str, modelfile: Modelfile, origin: str | None = None,
               quantize: str | None = None,
               quantize_folder: Callable[[Path, Path, str], None] | None = None) -> StoredModel:
        """Store FROM's model under `name` with the Modelfile's settings (over those of a stored
        FROM), replacing a model of that name. Atomic: a failure leaves the store as it was.
        `origin`: what `tetrad list` shows it came from (default: FROM). `quantize`: int8 or
        int4, the projections stored quantized by `quantize_folder(source, target, method)`
        (tetrad.models.quant_store's, which needs torch: the store itself does not)."""
        full = parse_name(name)
        source, base = self._source(modelfile)
        if quantize is not None:
            check_quantizable_source(source, quantize)
            if quantize_folder is None:
                raise ValueError("quantize needs quantize_folder")
        settings = {"system": base.system if base else None,
                    "parameters": dict(base.parameters) if base else {},
                    "messages": base.messages if base else [],
                    "license": base.manifest["license"] if base else [],
                    "template": bool(base and base.manifest["template"])}
        if modelfile.system is not None:
            settings["system"] = modelfile.system
        settings["parameters"].update(modelfile.parameters)
        settings["messages"] = modelfile.messages or settings["messages"]
        settings["license"] = modelfile.license or settings["license"]
        settings["template"] = settings["template"] or modelfile.template is not None
        gguf = is_gguf_file(source)
        if not gguf:  # a GGUF file's context is in its metadata: checked once unpacked
            check_context(settings["parameters"], source, modelfile.where)
        manifest = {"name": full, "from": origin or modelfile.source, "source": str(source),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **settings,
                    "modelfile": modelfile.text}
        if quantize is not None or (base and base.manifest.get("quantization")):
            manifest["quantization"] = quantize or base.manifest["quantization"]
        staging = retired = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = self.root / f".tmp-{uuid.uuid4().hex}"
            staging.mkdir()
            if gguf:
                unpack_gguf(source, staging)
                check_context(settings["parameters"], staging, modelfile.where)
                write_settings(staging, modelfile.template, manifest)
            else:
                assemble(staging, source, modelfile.template, manifest)
                if quantize is not None:
                    store_quantized(staging, source, quantize, quantize_folder)
            target = self.folder(full)
            with self._lock():
                target.parent.mkdir(parents=True, exist_ok=True)
                retired = self._retire(target)
                try:
                    staging.rename(target)
                except OSError:
                    if retired is not None:  # the model it replaces, back in place
                        retired.rename(target)
                        retired = None
                    raise
                return self._load(target)
        except OSError as error:  # a full disk, a store that is not a writable folder
            raise ConfigError(f"storing {full} in {self.root} failed ({error})") from None
        finally:
            for folder in (staging, retired):
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)

    def _source(self, modelfile: Modelfile) -> tuple[Path, StoredModel | None]:
        """FROM's folder, and the stored model it names (None for a folder)."""
        path = (modelfile.folder / Path(modelfile.source).expanduser())
        if is_gguf_file(path):
            return path, None
        if path.exists():
            folder = resolve_checkpoint(path)
            if not is_model_folder(folder):
                raise ModelfileError(f"FROM {modelfile.source}: {folder} is not a model folder "
                                     f"(an HF folder with config.json, or a tetrad checkpoint) "
                                     f"nor a .gguf file")
            return folder, None
        base = self.get(modelfile.source) if NAME.fullmatch(modelfile.source.lower()) else None
        if base is None:
            raise ModelfileError(f"FROM {modelfile.source}: no such folder (relative to the "
                                 f"Modelfile's) and no stored model of that name (tetrad list)")
        return base.folder, base

    def remove(self, name: str) -> None:
        folder = self.folder(name)
        try:
            with self._lock():
                if not os.path.lexists(folder):
                    raise self._missing(name)
                retired = self._retire(folder)
                for parent in folder.parents:  # the name's now empty folders
                    if parent == self.root or any(parent.iterdir()):
                        break
                    parent.rmdir()
            if retired is not None:
                shutil.rmtree(retired)
        except OSError as error:
            raise ConfigError(f"removing {parse_name(name)} from {self.root} failed "
                              f"({error})") from None

    def require_present(self, name: str) -> None:
        """A ConfigError when nothing, not even a broken model, is stored as `name`."""
        if not os.path.lexists(self.folder(name)):
            raise self._missing(name)

    def _missing(self, name: str) -> ConfigError:
        return ConfigError(f"no model named {parse_name(name)} in {self.root}: `tetrad list` "
                           f"shows the stored ones, `tetrad create` adds one")

    def _retire(self, folder: Path) -> Path | None:
        """Move a name's folder out of the way (a link, which the store never makes, is
        unlinked, not followed); the retired folder, to delete outside the lock."""
        if folder.is_symlink():
            folder.unlink()
        elif folder.exists():
            retired = self.root / f".tmp-{uuid.uuid4().hex}"
            folder.rename(retired)
            return retired
        return None

    @contextlib.contextmanager
    def _lock(self, exclusive: bool = True) -> Iterator[None]:
        """Renames of the store's names, one process at a time, and no reader in between: two
        creates of one name would otherwise each move the other's model aside, and a reader
        could find the name missing. A store this user cannot write is read without it."""
        try:
            file = open(self.root / LOCK, "a")
        except OSError:
            if exclusive:
                raise
            yield
            return
        with file:
            fcntl.flock(file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield

    def _load(self, folder: Path) -> StoredModel:
        """The model in `folder` (three deep in the store), checked: its folder is its name."""
        label = "{}/{}:{}".format(*folder.relative_to(self.root).parts)
        try:
            name = parse_name(label)
        except ConfigError:
            raise ConfigError(f"{folder} is not a stored model ({label[:80]!r} is not a model "
                              f"name): delete the folder") from None
        manifest = read_manifest(folder, name)
        try:
            size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
        except OSError as error:
            raise ConfigError(f"stored model {name} is broken ({error}): `tetrad rm {name}` "
                              f"removes it") from None
        return StoredModel(name, folder, manifest, size)


def read_manifest(folder: Path, name: str) -> dict[str, Any]:
    """`folder`'s manifest, held to what `tetrad create` writes; one ConfigError naming what is
    wrong otherwise (a store can be edited by hand, or written by an older tetrad)."""
    try:
        return _checked_manifest(folder, folder / MANIFEST, name)
    except (ConfigError, OSError) as error:
        problem = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ConfigError(f"stored model {name} is broken ({problem}): `tetrad rm {name}` removes "
                          f"it, `tetrad create {name}` stores it again") from None


def _checked_manifest(folder: Path, path: Path, name: str) -> dict[str, Any]:
    if folder.is_symlink() or not folder.is_dir():
        raise ConfigError(f"{folder} is a link or a file, not a folder the store made")
    if not os.path.lexists(path):
        raise ConfigError(f"{folder} has no {MANIFEST}")
    if not stat.S_ISREG(os.lstat(path).st_mode):  # a link, a FIFO or a device: never followed
        raise ConfigError(f"{path} is not a plain file")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested past the stack
        raise ConfigError(f"{path} is not JSON ({str(error)[:80]})") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path} holds a {type(manifest).__name__}, not an object")
    for key, kind in MANIFEST_FIELDS.items():
        if key not in manifest:
            raise ConfigError(f"{path} lacks {key!r}")
        value = manifest[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ConfigError(f"{path}: {key} is a {type(value).__name__}")
    if manifest["name"] != name:
        raise ConfigError(f"{path} says it is {manifest['name'][:80]!r}, but its folder is "
                          f"{name}'s")
    check_parameters(manifest["parameters"], str(path))
    if not all(isinstance(message, dict) and message.get("role") in ROLES
               and isinstance(message.get("content"), str) for message in manifest["messages"]):
        raise ConfigError(f"{path}: messages must be {{role, content}} objects with a role of "
                          f"{', '.join(ROLES)}")
    if not all(isinstance(text, str) for text in manifest["license"]):
        raise ConfigError(f"{path}: license must be a list of strings")
    if manifest["template"] and not (folder / "chat_template.jinja").is_file():
        raise ConfigError(f"{folder} lacks the chat_template.jinja its manifest names")
    check_context(manifest["parameters"], folder, lambda *settings: str(path))
    return manifest


def check_context(parameters: dict[str, Any], folder: Path, where: Callable[..., str]) -> None:
    """num_ctx within the model's context, and num_predict leaving a prompt room in it: a default
    max_tokens that does not would make every request that leaves max_tokens out fail.
    `where(*settings)`: what to name for the PARAMETER lines at fault."""
    context = resolve_model(str(folder)).max_seq_len
    num_ctx = parameters.get("max_model_len")
    if num_ctx is not None and num_ctx > context:
        raise ModelfileError(f"{where('max_model_len')}: PARAMETER num_ctx {num_ctx} exceeds the "
                             f"model's context length {context}")
    limit = num_ctx or context
    max_tokens = parameters.get("max_tokens")
    if max_tokens is not None and max_tokens >= limit:
        raise ModelfileError(
            f"{where('max_tokens', 'max_model_len')}: PARAMETER num_predict {max_tokens} leaves "
            f"no room for a prompt in a context of {limit} tokens"
            f"{' (num_ctx)' if num_ctx else ''}: use at most {limit - 1}, or -1 (up to the "
            f"context)")


def resolve_model_argument(argument: str, store: ModelStore | None = None
                           ) -> tuple[str, StoredModel | None]:
    """What a command's model argument names: an existing path as is (a GGUF file as its model
    folder, tetrad.store.gguf), else a stored model (its folder and its settings)."""
    store = store or ModelStore()
    if is_gguf_file(argument):
        return str(gguf_folder(argument, store.root)), None
    if Path(argument).expanduser().exists():
        return argument, None
    if not NAME.fullmatch(argument.strip().lower()):
        raise ConfigError(f"{argument[:200]} does not exist: pass a model folder or a stored "
                          f"model's name (tetrad list)")
    stored = store.get(argument)
    if stored is None:
        raise ConfigError(f"{argument} is neither a folder nor a model in {store.root} "
                          f"(tetrad list shows them)")
    return str(stored.folder), stored

