"""The largest inputs the planner is meant for, checked before any search, and the checks the
commands share for a number a user typed.

Each bound sits well above anything built or published, so no real question is refused, and low
enough that the search's cost stays bounded: every loop of the search runs over divisors or a
fixed short list, so these bounds keep a plan under a second whatever the input. A value beyond
one is a typo or a probe, and the message says the bound and why it is there.
"""

from __future__ import annotations

import math

from tetrad.errors import ConfigError

# Sequences per optimizer step: 16.8M, 8,000 times Llama 3 405B's 2,048 (16M tokens per step).
MAX_GLOBAL_BATCH = 2**24
# Tokens of one sequence: 16.8M, above the longest published context (Llama 4 Scout's 10M).
MAX_SEQ_LEN = 2**24
# A token budget of 1e18 is 25,000 times Llama 3's 15.6e12 training tokens.
MAX_TOKENS = 1e18
# Network bandwidth per GPU: from gigabit Ethernet to 100 Tb/s (60 times a 1.6 Tb/s NIC).
MIN_NIC_GBPS, MAX_NIC_GBPS = 1.0, 1e5
# Dollars per GPU-hour: a hundred times the dearest catalog price (B200's $8.64).
MAX_PRICE_PER_GPU_HOUR = 1000.0


def check_count(flag: str, value: int | None, at_most: int, why: str,
                at_least: int | None = 1) -> None:
    """`value`, when given, is a whole number from `at_least` (None: the caller checks the low
    end with its own words) to `at_most` (`why` says where that bound comes from). A bool is
    not a count."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag} must be a whole number, got {value!r}")
    if at_least is not None and value < at_least:
        raise ConfigError(f"{flag} must be at least {at_least}, got {value}")
    if value > at_most:
        raise ConfigError(f"{flag} {value} is more than {at_most:,}, {why}")


def check_number(flag: str, value: float | None, low: float, high: float, why: str,
                 low_allowed: bool = True) -> None:
    """`value`, when given, is a finite number in [low, high] ((low, high] unless
    `low_allowed`): NaN and infinities would only come back out as "nan days"."""
    if value is None:
        return
    if not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number, got {value}")
    if value < low or (value == low and not low_allowed):
        raise ConfigError(f"{flag} must be {'at least' if low_allowed else 'more than'} "
                          f"{low:g}, got {value:g}")
    if value > high:
        raise ConfigError(f"{flag} {value:g} is more than {high:g}, {why}")
