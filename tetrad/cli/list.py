"""`tetrad list`: the models in the local store (Ollama's `list`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("list", help="list the stored models",
                                   description=__doc__)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.cli.create import format_size
    from tetrad.store import ModelStore

    models = ModelStore().list()
    rows = [("NAME", "SIZE", "CREATED", "FROM")] + [
        (m.name, format_size(m.size), m.manifest.get("created", "")[:16].replace("T", " "),
         m.manifest.get("from", "")) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0
