"""The shape of a run report that `tetrad report` reads, checked once when it is loaded: a file
that is JSON but not what `tetrad train --report` writes (a list where the ranks go, a step
without its loss, a NaN loss) is one line naming the field, not a traceback from deep in the
table."""

from __future__ import annotations

import math
from typing import Any

from tetrad.errors import ConfigError


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _table_of_numbers(value: Any) -> bool:
    return isinstance(value, dict) and all(_number(v) for v in value.values())


def check_report(report: dict[str, Any], path: str) -> None:
    def refuse(field: str, wants: str) -> None:
        raise ConfigError(f"{path} is not a run report tetrad train wrote: {field} must be "
                          f"{wants}")

    ranks = report["ranks"]
    if not isinstance(ranks, list) or not ranks:
        refuse("ranks", "a non-empty list")
    for index, entry in enumerate(ranks):
        if not isinstance(entry, dict) or type(entry.get("rank")) is not int:
            refuse(f"ranks[{index}]", "an object with an integer rank")
        for field in ("bytes", "comm_bytes"):
            if not _table_of_numbers(entry.get(field)):
                refuse(f"ranks[{index}].{field}", "an object of finite numbers")
        if not _table_of_numbers(entry.get("coords")):
            refuse(f"ranks[{index}].coords", "an object of integers")
    steps = report.get("steps", [])
    if not isinstance(steps, list):
        refuse("steps", "a list")
    for index, step in enumerate(steps):
        if not (isinstance(step, dict) and type(step.get("step")) is int
                and all(_number(step.get(field)) for field in ("loss", "time_s"))):
            refuse(f"steps[{index}]", "an object with an integer step and finite loss and time_s")
    for field in ("config", "predicted", "device"):
        if not isinstance(report.get(field) or {}, dict):
            refuse(field, "an object")
