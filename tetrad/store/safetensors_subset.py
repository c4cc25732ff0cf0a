"""Some of a safetensors file's tensors, written as a safetensors file of their own, byte for byte
and without torch: the store keeps a checkpoint's parameters, not its AdamW moments.

The format: an 8-byte little-endian header length, a JSON header ({key: {dtype, shape,
data_offsets: [begin, end]}} with offsets into the data that follows, and `__metadata__`), the data.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from tetrad.errors import ConfigError

METADATA = "__metadata__"


def read_header(path: Path) -> tuple[dict, int]:
    """The header and where the data starts."""
    with open(path, "rb") as file:
        try:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        except (struct.error, ValueError) as error:
            raise ConfigError(f"{path} is not a safetensors file ({error})") from None
    return header, 8 + length


def tensor_keys(path: Path) -> set[str]:
    return set(read_header(path)[0]) - {METADATA}


def write_subset(source: Path, target: Path, keys: set[str]) -> None:
    """`target`: the tensors of `source` named in `keys`, data packed in the same order."""
    header, data_start = read_header(source)
    missing = keys - set(header)
    if missing:
        raise ConfigError(f"{source} lacks {sorted(missing)[:3]}")
    kept = sorted(keys, key=lambda key: header[key]["data_offsets"][0])
    new_header, offset = {}, 0
    for key in kept:
        begin, end = header[key]["data_offsets"]
        new_header[key] = {**header[key], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    if METADATA in header:
        new_header[METADATA] = header[METADATA]
    encoded = json.dumps(new_header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(source, "rb") as reader, open(target, "wb") as writer:
        writer.write(struct.pack("<Q", len(encoded)) + encoded)
        for key in kept:
            begin, end = header[key]["data_offsets"]
            reader.seek(data_start + begin)
            remaining = end - begin
            while remaining:  # in chunks: a shard may be larger than memory
                chunk = reader.read(min(remaining, 64 * 2**20))
                if not chunk:
                    raise ConfigError(f"{source} is truncated")
                writer.write(chunk)
                remaining -= len(chunk)
    shutil.copymode(source, target)
