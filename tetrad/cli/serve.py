"""`tetrad serve PATH --port P`: an OpenAI-compatible server (/v1/completions,
/v1/chat/completions with streaming, /v1/models, /health, /metrics) over the serving engine."""

from __future__ import annotations

import argparse
import sys

from tetrad.cli.generate import add_engine_arguments, build_engine


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API",
                                   description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name",
                        help="the model name clients send (default: the stored model's name "
                             "or the folder's)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tetrad.inference.chat import ChatFormatter, load_chat_template
    from tetrad.inference.server import build_app

    llm = build_engine(args)
    name = args.served_model_name or (args.stored.name if args.stored
                                      else llm.path.resolve().name)
    server = None  # the app stops it when the engine can no longer step (a dead tp rank)
    stored = args.stored  # a stored model's Modelfile: its SYSTEM and PARAMETERs are defaults
    app = build_app(llm, name, ChatFormatter(load_chat_template(llm.path),
                                             stored.system if stored else None),
                    on_fatal=lambda: setattr(server, "should_exit", True),
                    defaults=stored.sampling_defaults if stored else None)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning"))
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        server.run()
    finally:
        llm.close()
    if llm.failure is not None:
        raise llm.failure
    return 0
