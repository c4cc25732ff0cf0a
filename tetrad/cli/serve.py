"""`tetrad serve PATH --port P`: an OpenAI-compatible server (/v1/completions,
/v1/chat/completions with streaming and log-probabilities, /v1/models, /tokenize, /detokenize,
/health, /metrics) over the serving engine."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from tetrad.cli.generate import add_engine_arguments, build_engine
from tetrad.spec.serving import ServerConfig


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
    limits = parser.add_argument_group("access and limits")
    limits.add_argument("--api-key", default=os.environ.get("TETRAD_API_KEY"),
                        help="clients must send 'Authorization: Bearer KEY' to /v1/* and "
                             "/tokenize (default: $TETRAD_API_KEY; none: open)")
    defaults = {field.name: field.default for field in dataclasses.fields(ServerConfig)}
    for flag, kind, help_text in SERVER_FLAGS:
        limits.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                            help=help_text.format_map(defaults))
    limits.add_argument("--enable-docs", action="store_true", default=argparse.SUPPRESS,
                        help="serve the API's /docs, /redoc and /openapi.json (off by default)")
    parser.set_defaults(run=run)


# Help texts name a default as {field}: ServerConfig's, the one place each is declared.
SERVER_FLAGS: list[tuple[str, type, str]] = [
    ("--max-request-bytes", int, "largest request body, in bytes (default {max_request_bytes}; "
                                 "more: 413)"),
    ("--max-sequences-per-request", int, "prompts x n of one request (default "
                                         "{max_sequences_per_request}; more: 400)"),
    ("--max-stop-strings", int, "stop strings per request (default {max_stop_strings}; more: "
                                "400)"),
    ("--max-waiting-requests", int, "requests queued and not started yet; more get a 503 with "
                                    "Retry-After (default {max_waiting_requests})"),
    ("--request-timeout", float, "seconds a request may run before it is stopped with a 408 "
                                 "(default {request_timeout:g})"),
    ("--template-timeout", float, "seconds the chat template may take on one request's "
                                  "messages; a render past it is stopped (400) (default "
                                  "{template_timeout:g})"),
    ("--stream-interval", int, "engine steps between a streamed answer's events: its first "
                               "token and its end go at once, the steps between merged "
                               "(default {stream_interval}: every step)"),
]


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tetrad.spec.model import from_dict
    from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template
    from tetrad.inference.entrypoints.server import build_app

    options = {key: value for key, value in vars(args).items()
               if key in ServerConfig.__dataclass_fields__}
    config = from_dict(ServerConfig, options)
    with build_engine(args) as llm:  # closed (its ranks stopped) however the server ends
        name = args.served_model_name or (args.stored.name if args.stored
                                          else llm.path.resolve().name)
        server = None  # the app stops it when the engine can no longer step (a dead tp rank)
        stored = args.stored  # a stored model's Modelfile: its SYSTEM and PARAMETERs are defaults
        app = build_app(llm, name, ChatFormatter(load_chat_template(llm.path),
                                                 stored.system if stored else None),
                        on_fatal=lambda: setattr(server, "should_exit", True),
                        defaults=stored.sampling_defaults if stored else None, config=config)
        # loop and http "auto": uvloop and httptools where installed (requirements.txt has
        # both), whose C loop and parser leave more of the GIL to the engine thread while it
        # streams.
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level="warning", loop="auto", http="auto"))
        print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
        server.run()
    if llm.failure is not None:
        raise llm.failure
    return 0
