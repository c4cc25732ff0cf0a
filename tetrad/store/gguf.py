"""A GGUF file as a model folder (torch-free): `model.gguf` (the file itself, linked or copied)
beside what serving reads of any model folder, written from the file's metadata: config.json,
tokenizer.json + tokenizer_config.json (its end-of-text and BOS tokens) and chat_template.jinja
(tokenizer.chat_template). Weights are read from model.gguf at load (tetrad.models.gguf), so one
loading path serves `tetrad create` with `FROM ./model.gguf` (the folder is the stored model) and
`tetrad run ./model.gguf` (the folder is a cache in the store, beside the named models).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from tetrad.errors import ConfigError
from tetrad.spec.gguf import GGUF_FILE, hf_config_from_gguf, metadata, open_gguf
from tetrad.store.files import link_or_copy, write_fresh
from tetrad.store.gguf_tokenizer import gguf_tokenizer

CACHE = ".gguf"  # under the store's root: a dot folder, which listing the store skips
TOKENIZER_KEYS = ("model", "pre", "tokens", "scores", "token_type", "merges", "bos_token_id",
                  "eos_token_id", "unknown_token_id", "add_bos_token", "add_space_prefix")


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_file() and path.suffix.lower() == ".gguf"


def unpack_gguf(file: Path, folder: Path, link: bool = False) -> None:
    """The model folder of GGUF `file` in the empty `folder`; `link`: model.gguf is a symbolic
    link to `file` (a cache that the file outlives), else a hardlink or copy (a stored model that
    outlives the file)."""
    reader = open_gguf(file)
    hf = hf_config_from_gguf(reader, str(file))
    values = {key: metadata(reader, f"tokenizer.ggml.{key}") for key in TOKENIZER_KEYS}
    values = {key: value for key, value in values.items() if value is not None}
    tokens = values.get("tokens") or []
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for which in ("bos", "eos"):
        index = values.get(f"{which}_token_id")
        if index is not None and 0 <= index < len(tokens):
            tokenizer_config[f"{which}_token"] = tokens[index]
    if tokens:
        gguf_tokenizer(values, str(file)).save(str(folder / "tokenizer.json"))
        write_fresh(folder / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))
    template = metadata(reader, "tokenizer.chat_template")
    if template:
        write_fresh(folder / "chat_template.jinja", template)
    write_fresh(folder / "config.json", json.dumps(hf, indent=2) + "\n")
    if link:
        os.symlink(file.resolve(), folder / GGUF_FILE)
    else:
        link_or_copy(file, folder / GGUF_FILE)


def gguf_folder(file: str | Path, root: Path) -> Path:
    """The model folder of GGUF `file` for a command that runs it by path: made once under
    `root`/.gguf and reused while the file keeps its size and modification time. It is named as
    the file is, less .gguf (what `tetrad serve` calls the model)."""
    file = Path(file).expanduser().resolve()
    status = file.stat()
    key = hashlib.sha256(f"{file}\0{status.st_size}\0{status.st_mtime_ns}".encode()).hexdigest()
    folder = root / CACHE / key[:32] / file.stem
    if (folder / "config.json").is_file():
        return folder
    staging = root / CACHE / f".tmp-{uuid.uuid4().hex}"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        unpack_gguf(file, staging, link=True)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent run that made it first
                raise
    except OSError as error:
        raise ConfigError(f"unpacking {file} into {root / CACHE} failed ({error})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
