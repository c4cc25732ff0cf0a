"""Writing a figure: where it cannot go (a missing or read-only folder, /proc, a folder's own
name, a format matplotlib lacks) is one line saying so, and the figure is closed either way.
`check_picture_path` says so before any work: the commands call it first."""

from __future__ import annotations

import os
from pathlib import Path

from tetrad.errors import ConfigError


def check_picture_path(path: str | Path) -> None:
    """The picture's folder exists and is writable, the name is not a folder's, and matplotlib
    has a writer for its extension (its backend table, without loading pyplot)."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write the picture to {path}: no folder {folder}")
    if path.is_dir():
        raise ConfigError(f"cannot write the picture to {path}: it is a folder")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise ConfigError(f"cannot write the picture to {path}: matplotlib writes "
                          f"{', '.join(sorted(formats))}, not {path.suffix or 'no extension'}")
    existed = path.exists()
    try:  # opening is the only honest test (root passes every permission check, /proc refuses)
        with open(path, "ab"):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write the picture to {path}: "
                          f"{error.strerror or error}") from None
    if not existed:
        os.unlink(path)


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
