"""`tetrad show NAME`: a stored model's shape, settings and files; `--modelfile` prints a
Modelfile that recreates it (Ollama's `show`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("show", help="show a stored model", description=__doc__)
    parser.add_argument("name", help="name[:tag]")
    parser.add_argument("--modelfile", action="store_true",
                        help="print a Modelfile that recreates the model")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.cli.create import format_size
    from tetrad.planner.model_stats import count_parameters
    from tetrad.spec.presets import resolve_model
    from tetrad.store.models import ModelStore

    model = ModelStore().require(args.name)
    if args.modelfile:
        print(model.modelfile(), end="")
        return 0
    config = resolve_model(str(model.folder))
    manifest = model.manifest
    print(f"{model.name}  ({format_size(model.size)} in {model.folder})")
    print(f"  from        {manifest['from']}")
    print(f"  created     {manifest['created']}")
    print(f"  model       {count_parameters(config) / 1e6:.2f}M parameters, {config.num_layers} "
          f"layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}, context "
          f"{config.max_seq_len}")
    if manifest.get("quantization"):
        print(f"  quantized   {manifest['quantization']} (the blocks' projections, stored)")
    if model.parameters:
        print("  parameters  " + ", ".join(f"{key}={value}" for key, value in
                                           model.parameters.items()))
    if model.system is not None:
        print(f"  system      {model.system!r}")
    if manifest["template"]:
        print("  template    chat_template.jinja")
    for message in model.messages:
        print(f"  message     {message['role']}: {message['content']}")
    for text in manifest["license"]:
        print(f"  license     {text.splitlines()[0] if text else ''}")
    return 0
