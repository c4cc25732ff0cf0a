"""Every key `tetrad plan train/serve --json` prints is listed in the field tables of README.md
and docs/planner.md: top-level keys, each `configs[]` key, and the keys of its nested objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tetrad.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "train": ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16",
              "--tp", "2", "--pp", "2", "--ep", "1", "--tokens", "1e12", "--top", "1"],
    "serve": ["plan", "serve", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "2",
              "--tp", "2", "--pp", "1", "--top", "1"],
}


def _table(path: Path, mode: str) -> str:
    """The `tetrad plan MODE` field table of `path`: its heading up to the next heading."""
    text = path.read_text()
    start = text.index(f"# `tetrad plan {mode}`\n")
    return text[start:text.index("\n#", start + 1)]


def _missing(table: str, out: dict) -> list[str]:
    rows = table.splitlines()
    missing = [key for key in out if f"`{key}`" not in table]
    for key, value in out["configs"][0].items():
        row = [line for line in rows if f"`configs[].{key}`" in line]
        if not row:
            missing.append(f"configs[].{key}")
        elif isinstance(value, dict):
            missing += [f"configs[].{key}.{sub}" for sub in value if f"`{sub}`" not in row[0]]
    return missing


@pytest.mark.parametrize("mode", sorted(RUNS))
def test_every_json_key_is_in_the_field_tables(capsys, mode):
    assert main(RUNS[mode] + ["--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] and out["configs"][0]["memory_gib"]
    for doc in ("README.md", "docs/planner.md"):
        assert _missing(_table(ROOT / doc, mode), out) == [], doc
