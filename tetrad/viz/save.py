"""Writing a figure: where it cannot go (a missing or read-only folder, /proc, a folder's own
name, a format matplotlib lacks) is one line saying so, and the figure is closed either way."""

from __future__ import annotations

from pathlib import Path

from tetrad.errors import ConfigError


def save_figure(figure, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise ConfigError(f"cannot write the picture to {path}: "
                          f"{error.strerror or error}") from None
    except ValueError as error:  # matplotlib: an extension it has no writer for
        raise ConfigError(f"cannot write the picture to {path}: {error}") from None
    finally:
        plt.close(figure)
