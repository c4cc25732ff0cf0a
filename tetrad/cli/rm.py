"""`tetrad rm NAME...`: remove models from the local store (Ollama's `rm`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("rm", help="remove stored models", description=__doc__)
    parser.add_argument("names", nargs="+", metavar="NAME", help="name[:tag]")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.store.models import ModelStore, parse_name

    store = ModelStore()
    for name in args.names:  # all or nothing: check every name before removing any
        store.require_present(name)  # a broken model too: rm is how it goes
    for name in args.names:
        store.remove(name)
        print(f"deleted {parse_name(name)}")
    return 0
