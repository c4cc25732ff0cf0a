"""`tetrad create NAME -f Modelfile`: store a model under a name, with the Modelfile's system
message, chat template and sampling defaults (Ollama's `create`; docs/models.md)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("create", help="store a model under a name from a Modelfile",
                                   description=__doc__)
    parser.add_argument("name", help="name[:tag] to store it as (tag 'latest' by default)")
    parser.add_argument("-f", "--file", default="Modelfile",
                        help="the Modelfile (default: ./Modelfile)")
    parser.add_argument("-q", "--quantize", choices=("int8", "int4"),
                        help="store the blocks' projections quantized (GPTQ, once, here): "
                             "served as --quantization int8 / int4 without calibrating at load, "
                             "and never held in 16 bits")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.store.modelfile import read_modelfile
    from tetrad.store.models import ModelStore, parse_name

    parse_name(args.name)  # a bad name costs nothing
    modelfile = read_modelfile(args.file)
    quantize_folder = None
    if args.quantize:
        from tetrad.models.quant_store import quantize_folder

        print(f"quantizing to {args.quantize} (GPTQ on text the model samples itself; minutes "
              f"for a large model)", flush=True)
    model = ModelStore().create(args.name, modelfile, quantize=args.quantize,
                                quantize_folder=quantize_folder)
    print(f"created {model.name} ({format_size(model.size)}) in {model.folder}")
    return 0


def format_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
