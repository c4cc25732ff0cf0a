"""One row of the HF <-> tetrad weight mapping (tetrad.models.hf and its per-family tables)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    tetrad: str
    hf: tuple[str, ...]  # concatenated along dim 0, in this order
    sizes: tuple[int, ...] = ()  # rows of each HF piece, when there are several
    transpose: bool = False  # GPT-2's Conv1D stores [in, out]
    rows: tuple[int, ...] = ()  # row order to read them in (DeepSeek's interleaved rope rows)
