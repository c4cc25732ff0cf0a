"""User-facing errors. The CLI prints these as one line (no traceback) and exits with status 2."""


class TetradError(Exception):
    """A problem the user can fix; the message says what to change."""


class ConfigError(TetradError):
    """A configuration that cannot work (shapes, degrees, paths, flags)."""
