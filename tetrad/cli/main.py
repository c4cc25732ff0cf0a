"""`tetrad` command line: argument parsing only. Each subcommand lives in its own module with
`add_parser(subparsers)` and a `run(args)`; heavy imports (torch) happen inside `run`, so
`tetrad plan` starts in milliseconds."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys

import tetrad.cli

from tetrad.errors import TetradError

# Which extra of pyproject.toml brings each third-party module a subcommand may import (the base
# install has none of them); tests/test_packaging.py checks this against pyproject.toml.
EXTRA_MODULES = {
    "train": ("torch", "numpy", "safetensors", "tokenizers", "tqdm"),
    "serve": ("torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "uvloop", "httptools",
              "pydantic", "jinja2", "gguf", "numpy"),
    "plot": ("matplotlib",),
}
SERVING_COMMANDS = ("serve", "run", "generate")


def missing_extra(module: str | None, command: str) -> str | None:
    """The extra to install for a `command` that could not import `module`; None when no extra
    brings it (then the missing module is a bug, not an install choice)."""
    top = (module or "").partition(".")[0]
    extras = [extra for extra, modules in EXTRA_MODULES.items() if top in modules]
    if "serve" in extras and command in SERVING_COMMANDS:
        return "serve"
    return extras[0] if extras else None


def subcommand_modules() -> list[str]:
    """Every module of tetrad.cli but this one is a subcommand, registered in name order."""
    return sorted(info.name for info in pkgutil.iter_modules(tetrad.cli.__path__)
                  if info.name != "main")


class OneLineParser(argparse.ArgumentParser):
    """argparse with tetrad's rule for bad input: one line on stderr and exit status 2 (the
    usage stays with --help). A negative number in scientific notation (`--tokens -1e12`) is
    read as a value, as -5 and -0.5 are, so that the command's own check can say what is wrong
    with it, rather than as an unknown option. Subcommand parsers are of the same class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="tetrad", description="Plan, train and serve large transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in subcommand_modules():
        importlib.import_module(f"tetrad.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except TetradError as error:
        print(f"tetrad {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = missing_extra(error.name, args.command)
        if extra is None:
            raise
        print(f"tetrad {args.command}: error: {error.name} is not installed: "
              f"pip install 'tetrad[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`tetrad schedule ... | head`): nothing left to say to it.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"tetrad {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
