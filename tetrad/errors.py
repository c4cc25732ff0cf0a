"""User-facing errors and the small checks that raise them. The CLI prints these as one line (no
traceback) and exits with status 2."""

import json
from pathlib import Path


class TetradError(Exception):
    """A problem the user can fix; the message says what to change."""


class ConfigError(TetradError):
    """A configuration that cannot work (shapes, degrees, paths, flags)."""


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def check_positive(name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def read_json_file(path: str | Path, what: str, made_by: str) -> object:
    """The JSON in `path`; a missing file or invalid JSON is one ConfigError naming `what` the file
    should be and `made_by`, the command that writes one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist (write one with {made_by} {path})")
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, nesting, huge numbers
        raise ConfigError(f"{path} is not a {what} (invalid JSON: {error})") from None
