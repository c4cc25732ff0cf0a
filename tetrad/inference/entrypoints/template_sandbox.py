"""The jinja2 environment chat templates render in: HF's immutable sandbox (no attribute writes,
no unsafe calls), plus bounds on the work one operation can start. A render as a whole is bounded
in time by the server (front_end.py stops its thread), which works between two Python bytecodes;
a single C operation cannot be stopped that way, so the ones whose size the messages can drive
('x' * n, a + b, n ** k) are refused past a size here, before they start."""

from __future__ import annotations

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_SEQUENCE_ITEMS = 10**7  # a str or list made by * or +: ~10 MB, a few ms to build
MAX_INT_BITS = 10**6  # an int made by * or **: multiplying two of these takes about a ms


def _int_bits(value) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _result_size(symbol: str, left, right) -> tuple[int, int]:
    """(items, int bits) of `left symbol right`, computed without computing it."""
    if symbol == "**":
        exponent = right if isinstance(right, int) and right > 0 else 0
        return 0, _int_bits(left) * exponent
    if symbol == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            return len(left) + len(right), 0
        return 0, max(_int_bits(left), _int_bits(right)) + 1
    for sequence, count in ((left, right), (right, left)):  # "*"
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
            return len(sequence) * max(count, 0), 0
    return 0, _int_bits(left) + _int_bits(right)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, symbol: str, left, right):
        items, bits = _result_size(symbol, left, right)
        if items > MAX_SEQUENCE_ITEMS or bits > MAX_INT_BITS:
            raise SecurityError(f"the template's {symbol!r} would build a value of "
                                f"{items or bits} {'items' if items else 'bits'}: too large")
        return self.binop_table[symbol](left, right)


class RenderTooLong(ValueError):
    """A render's output passed its limit."""


def render_bounded(template, max_chars: int | None, **variables) -> str:
    """template's output, stopped as soon as it passes max_chars characters (None: no limit)."""
    pieces, length = [], 0
    for piece in template.generate(**variables):
        length += len(piece)
        if max_chars is not None and length > max_chars:
            raise RenderTooLong(f"the chat template's output passed {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)
