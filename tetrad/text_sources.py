"""Raw text from the three forms a `--data` path takes: a text file, a folder of .txt files, or a
.jsonl file of {"text": ...} objects. Shared by the tokenizer trainer and the training data loader;
no torch here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tetrad.errors import ConfigError


def iter_texts(path: str | Path) -> Iterator[str]:
    """One text per file (a text file, each .txt in a folder, sorted so that runs are
    reproducible) or per line of a .jsonl file. A bad path raises here, not on first use."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ConfigError(f"data folder {path} holds no .txt files: add some, or pass a text "
                              f"or .jsonl file")
        return map(_read, files)
    if path.is_file():
        return _iter_jsonl(path) if path.suffix == ".jsonl" else iter([_read(path)])
    raise ConfigError(f"data path {path} does not exist: pass a text file, a folder of .txt "
                      f"files or a .jsonl file")


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{file} is not UTF-8 text ({error}): convert it or leave it out") \
            from None


def _iter_jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number} is not valid JSON: {error}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"{path}:{number} has no string \"text\" field: every line of "
                                  f"a .jsonl data file must be an object like {{\"text\": \"...\"}}")
            yield record["text"]
