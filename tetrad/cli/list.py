"""`tetrad list`: the models in the local store (Ollama's `list`); a broken one is named on stderr,
one line each, and the others are still listed."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("list", help="list the stored models",
                                   description=__doc__)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from tetrad.cli.create import format_size
    from tetrad.store.models import ModelStore

    models, broken = ModelStore().scan()
    rows = [("NAME", "SIZE", "CREATED", "FROM")] + [
        (m.name, format_size(m.size), m.manifest["created"][:16].replace("T", " "),
         m.manifest["from"]) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    for problem in broken:
        print(f"tetrad list: {problem}", file=sys.stderr)
    return 0
