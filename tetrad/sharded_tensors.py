"""Tensors saved in pieces by many ranks, read back whole or in any other layout's pieces.

A rank's piece of a tensor is described in the tensor's own single-process coordinates, so the
files mean the same thing whatever layout wrote them:

  box    the rows `rows` (global indices, in the piece's order) of dimension `dim`: a tensor
         parallel shard, which may pick non-contiguous rows (fused QKV, replicated kv heads);
         no dim: the whole tensor
  flat   elements [start, end) of the box flattened: a ZeRO rank's part of the flat buffer

Each rank writes one safetensors file of its pieces (`shard_00003.safetensors`, keys
`kind/name`); one `index.json` lists every piece with its file, box, flat range, the global
shape and the sha256 of its bytes. Reading a tensor back assembles it from every piece that holds
part of it (replicated copies hold the same values: any copy does) and fails if an element is
missing, so a wrong layout rule cannot go unnoticed. Nothing read is trusted: a piece whose bytes
do not match their checksum, an index naming a file outside its folder (or a link leading out of
it), a shard the index does not list, or an entry whose ranges do not fit its shape is one
ConfigError naming the file. (Per piece rather than per file: the model store keeps a subset of a
shard's pieces, byte for byte, and their checksums stay true.)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tetrad.errors import ConfigError

INDEX = "index.json"
FORMAT = "tetrad-sharded/1"
CHECKPOINT_KINDS = ("model", "exp_avg", "exp_avg_sq")  # parameters and AdamW's two moments
SHARD_FILE = re.compile(r"shard_\d{5}\.safetensors")


@dataclass
class Piece:
    """What one rank holds of one tensor."""

    kind: str  # one of CHECKPOINT_KINDS
    name: str  # the single-process parameter name
    data: torch.Tensor  # shaped like the box, or 1-D for a flat range
    global_shape: tuple[int, ...]
    dim: int | None = None
    rows: torch.Tensor | None = None
    flat: tuple[int, int] | None = None


def shard_file_name(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes, whatever its dtype (fp8 and bf16 included)."""
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def row_runs(rows: torch.Tensor) -> list[list[int]]:
    """Rows as [start, stop) runs of consecutive indices: short in JSON (a shard is a few runs)."""
    runs: list[list[int]] = []
    for row in rows.tolist():
        if runs and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    return runs


def rows_of(runs: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop) for start, stop in runs])


def write_pieces(folder: Path, rank: int, pieces: list[Piece]) -> list[dict]:
    """Write this rank's pieces into `folder` (flushed to disk) and return their index entries.
    A rank without pieces writes nothing."""
    if not pieces:
        return []
    file = shard_file_name(rank)
    tensors, entries = {}, []
    for piece in pieces:
        key = f"{piece.kind}/{piece.name}"
        tensors[key] = piece.data.detach().to("cpu").contiguous()
        entries.append({"file": file, "key": key, "kind": piece.kind, "name": piece.name,
                        "shape": list(piece.global_shape), "dim": piece.dim,
                        "rows": None if piece.rows is None else row_runs(piece.rows),
                        "flat": None if piece.flat is None else list(piece.flat),
                        "sha256": tensor_digest(tensors[key])})
    save_tensors(tensors, folder / file)
    with open(folder / file, "rb") as handle:
        os.fsync(handle.fileno())
    return entries


def save_tensors(tensors: dict[str, torch.Tensor], path: Path,
                 metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file readable as any other the process writes:
    safetensors creates it owner-only (0600), which a serving job run by another user of a shared
    filesystem could not read."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_index(folder: Path, entries: list[dict]) -> None:
    (folder / INDEX).write_text(json.dumps({"format": FORMAT, "pieces": entries}))


class ShardedReader:
    """The tensors of a folder written by write_pieces + write_index, one at a time, each piece
    checked against its index entry and checksum."""

    def __init__(self, folder: Path):
        self.folder = folder
        try:
            index = json.loads((folder / INDEX).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise ConfigError(f"checkpoint {folder} is corrupt ({INDEX}: {error})") from None
        if not isinstance(index, dict) or not isinstance(index.get("pieces"), list):
            raise ConfigError(f"checkpoint {folder} is corrupt ({INDEX} is not an object with a "
                              f"list of pieces)")
        if index.get("format") != FORMAT:
            raise ConfigError(f"checkpoint {folder} has format {index.get('format')!r}; this "
                              f"tetrad reads {FORMAT!r}")
        self.pieces: dict[tuple[str, str], list[dict]] = {}
        for number, entry in enumerate(index["pieces"]):
            problem = entry_problem(entry)
            if problem:
                raise ConfigError(f"checkpoint {folder} is corrupt ({INDEX} piece {number}: "
                                  f"{problem})")
            self.pieces.setdefault((entry["kind"], entry["name"]), []).append(entry)
        self._check_files({entry["file"] for entries in self.pieces.values()
                           for entry in entries})
        self._files: dict[str, object] = {}

    def _check_files(self, named: set[str]) -> None:
        """Every named file inside the folder (no path, no link leading out); no unlisted shard."""
        inside = self.folder.resolve()
        for file in sorted(named):
            if Path(file).name != file or file.startswith("."):
                raise ConfigError(f"checkpoint {self.folder} is corrupt ({INDEX} names {file!r}, "
                                  f"a file outside the checkpoint folder)")
            if (self.folder / file).resolve().parent != inside:
                raise ConfigError(f"checkpoint {self.folder} is corrupt ({file} is a link to "
                                  f"{(self.folder / file).resolve()}, outside the folder)")
        unlisted = sorted(path.name for path in self.folder.iterdir()
                          if SHARD_FILE.fullmatch(path.name) and path.name not in named)
        if unlisted:
            raise ConfigError(f"checkpoint {self.folder} is corrupt ({unlisted[0]} is not in its "
                              f"{INDEX}: a shard of another save)")

    def names(self, kind: str) -> list[str]:
        return [name for piece_kind, name in self.pieces if piece_kind == kind]

    def tensors(self, kind: str) -> "LazyMapping":
        """Every tensor of `kind` by name, each assembled only when it is looked up."""
        return LazyMapping(self.names(kind), lambda name: self.whole(kind, name))

    def _read(self, entry: dict) -> Piece:
        file = entry["file"]
        try:
            if file not in self._files:
                self._files[file] = safe_open(str(self.folder / file), "pt")
            data = self._files[file].get_tensor(entry["key"])
        except (OSError, SafetensorError) as error:
            raise ConfigError(f"checkpoint {self.folder} is corrupt ({file}: {error})") from None
        if "sha256" in entry and tensor_digest(data) != entry["sha256"]:
            raise ConfigError(f"checkpoint {self.folder} is corrupt ({file}: the bytes of "
                              f"{entry['key']} do not match their checksum in {INDEX})")
        rows, flat = entry.get("rows"), entry.get("flat")
        return Piece(entry["kind"], entry["name"], data, tuple(entry["shape"]), entry.get("dim"),
                     None if rows is None else rows_of(rows), None if flat is None else tuple(flat))

    def whole(self, kind: str, name: str) -> torch.Tensor:
        entries = self.pieces.get((kind, name))
        if not entries:
            raise ConfigError(f"checkpoint {self.folder} has no {kind} of {name}")
        try:
            return assemble([self._read(entry) for entry in entries])
        except ValueError as error:
            raise ConfigError(f"checkpoint {self.folder} is incomplete: {error}") from None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_range(value, limit: int) -> bool:
    return (isinstance(value, list) and len(value) == 2 and all(map(_is_count, value))
            and value[0] <= value[1] <= limit)


def entry_problem(entry) -> str | None:
    """What makes an index entry unusable (types, ranges outside its shape), or None."""
    if not isinstance(entry, dict):
        return "not an object"
    fields = {"file": str, "key": str, "kind": str, "name": str, "shape": list}
    for field, kind in fields.items():
        if not isinstance(entry.get(field), kind):
            return f"{field} is {entry.get(field)!r}"
    shape, dim, rows, flat = entry["shape"], entry.get("dim"), entry.get("rows"), entry.get("flat")
    if not all(map(_is_count, shape)):
        return f"shape is {shape!r}"
    if dim is not None and not (_is_count(dim) and dim < len(shape)):
        return f"dim {dim!r} of a {len(shape)}-d tensor"
    if (dim is None) != (rows is None):
        return "dim and rows must come together"
    box = list(shape)
    if rows is not None:
        if not isinstance(rows, list) or not rows or not all(
                _is_range(run, shape[dim]) and run[0] < run[1] for run in rows):
            return f"rows {rows!r} outside dimension {dim} of size {shape[dim]}"
        box[dim] = sum(stop - start for start, stop in rows)
    if flat is not None and not _is_range(flat, math.prod(box)):
        return f"flat range {flat!r} outside its {math.prod(box)} elements"
    if "sha256" in entry and not isinstance(entry["sha256"], str):
        return f"sha256 is {entry['sha256']!r}"
    return None


def assemble(pieces: list[Piece]) -> torch.Tensor:
    """One tensor from pieces of it, any layout's. Pieces of the same box (a tp shard's rows, or
    the whole tensor) must cover it together (ZeRO ranks split it into flat ranges); boxes may
    share rows (replicated kv heads: equal copies, any does). Plain slice copies, coverage kept
    as ranges: ValueError naming how many elements no piece holds."""
    first = pieces[0]
    shape, numel = first.global_shape, math.prod(first.global_shape)
    split_dims = {piece.dim for piece in pieces if piece.dim is not None}
    if len(split_dims) > 1 or any(piece.global_shape != shape for piece in pieces):
        raise ValueError(f"{first.kind} of {first.name}: its pieces disagree on its shape or on "
                         f"the dimension they split")
    boxes: dict[tuple, list[Piece]] = {}
    for piece in pieces:
        rows = None if piece.rows is None else tuple(piece.rows.tolist())
        boxes.setdefault((piece.dim, rows), []).append(piece)
    whole, rows_held = None, None
    for (dim, rows), box_pieces in boxes.items():
        box_shape = list(shape)
        if dim is not None:
            box_shape[dim] = len(rows)
        box = _assemble_box(box_pieces, box_shape, numel)
        if dim is None:
            return box
        if whole is None:
            whole = box.new_empty(shape)
            rows_held = torch.zeros(shape[dim], dtype=torch.bool)
        index = torch.tensor(rows, dtype=torch.long)
        whole.index_copy_(dim, index, box)
        rows_held[index] = True
    if not bool(rows_held.all()):
        missing = int((~rows_held).sum()) * (numel // shape[dim])
        raise ValueError(f"{first.kind} of {first.name} misses {missing} of {numel} elements")
    return whole


def _assemble_box(pieces: list[Piece], box_shape: list[int], numel: int) -> torch.Tensor:
    """One box from its whole piece or its flat ranges, which must cover it."""
    box = pieces[0].data.new_empty(box_shape)
    flat = box.view(-1)
    ranges = []
    for piece in pieces:
        start, end = piece.flat or (0, flat.numel())
        if piece.data.numel() != end - start:
            raise ValueError(f"{piece.kind} of {piece.name}: the index places {end - start} "
                             f"elements, the shard holds {piece.data.numel()}")
        flat[start:end] = piece.data.reshape(-1)
        ranges.append((start, end))
    held = reach = 0
    for start, end in sorted(ranges):  # the union's size: overlapping ranges count once
        held += max(0, end - max(start, reach))
        reach = max(reach, end)
    if held < flat.numel():
        raise ValueError(f"{pieces[0].kind} of {pieces[0].name} misses {flat.numel() - held} of "
                         f"{numel} elements")
    return box


def whole_pieces(kind: str, tensors: Mapping[str, torch.Tensor]) -> list[Piece]:
    """Whole tensors as pieces: what a rank holding the whole model writes."""
    return [Piece(kind, name, tensor, tuple(tensor.shape)) for name, tensor in tensors.items()]


class LazyMapping(Mapping):
    """Tensors by name, each computed only when looked up (`get(name)`): a rank resuming under
    another layout holds one whole tensor at a time besides its own pieces."""

    def __init__(self, names, get: Callable[[str], torch.Tensor]):
        self._names, self._get = list(names), get
        self._known = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
