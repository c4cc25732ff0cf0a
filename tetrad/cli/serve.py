"""`tetrad serve [MODEL ...] --port P`: an OpenAI-compatible server (/v1/completions,
/v1/chat/completions with streaming and log-probabilities, /v1/models, /tokenize, /detokenize,
/health, /metrics) over the serving engine. One MODEL: that model, loaded at start. None or
several: the models of the store (tetrad list) and those named, each loaded when a request names
it and unloaded after its keep_alive, as many at once as --max-loaded-memory holds."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from tetrad.cli.generate import add_engine_arguments, build_engine
from tetrad.errors import ConfigError
from tetrad.spec.serving import ServerConfig

DEFAULT_KEEP_ALIVE = "5m"  # Ollama's (OLLAMA_KEEP_ALIVE)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API",
                                   description=__doc__)
    add_engine_arguments(parser, nargs="*")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name",
                        help="the model name clients send (default: the stored model's name "
                             "or the folder's; one model only)")
    pool = parser.add_argument_group("many models (no MODEL, or several)")
    pool.add_argument("--max-loaded-memory",
                      help="what the loaded models may hold together, weights and KV caches, "
                           "e.g. 8GiB; least recently used idle models unload to make room "
                           "(default: 90%% of the GPUs' memory, or of this machine's on a CPU)")
    pool.add_argument("--keep-alive", default=DEFAULT_KEEP_ALIVE,
                      help="how long a model stays loaded after its last request, for requests "
                           "that bring no keep_alive: seconds or a duration (5m, 1h), 0 to "
                           "unload at once, negative to never (default %(default)s)")
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    from tetrad.spec.model import from_dict

    return from_dict(ServerConfig, {key: value for key, value in vars(args).items()
                                    if key in ServerConfig.__dataclass_fields__})


def run(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: F401 (a missing serve extra is named before any model is looked up)

    if len(args.path) == 1:
        args.path = args.path[0]
        return run_one(args)
    return run_many(args)


def listen(app, args: argparse.Namespace, what: str):
    """The uvicorn server of `app`, printing where it listens."""
    import uvicorn

    # loop and http "auto": uvloop and httptools where installed (requirements.txt has both),
    # whose C loop and parser leave more of the GIL to the engine thread while it streams.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning", loop="auto", http="auto"))
    print(f"serving {what} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    return server


def run_many(args: argparse.Namespace) -> int:
    from tetrad.inference.entrypoints.model_pool import ModelPool
    from tetrad.inference.entrypoints.model_pool_catalog import ModelCatalog
    from tetrad.inference.entrypoints.server import build_server
    from tetrad.inference.worker.config import EngineConfig, serving_device
    from tetrad.inference.worker.kv_cache import parse_bytes
    from tetrad.spec.model import from_dict

    for flag, value in (("--served-model-name", args.served_model_name),
                        ("--tokenizer", args.tokenizer)):
        if value is not None:
            raise ConfigError(f"{flag} goes with one model; with {len(args.path) or 'no'} "
                              f"models each is served by its name")
    from tetrad.store.models import ModelStore

    config = server_config(args)
    engine = from_dict(EngineConfig, {key: value for key, value in vars(args).items()
                                      if key in EngineConfig.__dataclass_fields__})
    device = serving_device(engine.device, engine.world_size)
    store = ModelStore()
    catalog = ModelCatalog(args, build_engine, named_models(args.path, store), store,
                           kv_bytes=kv_pool_bytes(engine, device))
    budget = (default_budget(device, engine.world_size) if args.max_loaded_memory is None
              else parse_bytes(args.max_loaded_memory))
    pool = ModelPool(catalog, config, budget, args.keep_alive)
    names = catalog.names()
    listen(build_server(pool, config), args,
           f"{len(names)} models ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) "
           f"within {budget / 2**30:.1f} GiB").run()
    return 0


def named_models(arguments: list[str], store) -> dict[str, tuple[str, Path]]:
    """The command line's models by the names they are served under (a stored model's, a
    folder's or a GGUF file's): each one's argument and its model folder; checked at start."""
    from tetrad.store.models import resolve_model_argument

    named = {}
    for argument in arguments:
        folder, stored = resolve_model_argument(argument, store)
        named[stored.name if stored else Path(folder).resolve().name] = (argument, Path(folder))
    return named


def kv_pool_bytes(engine, device) -> int:
    """The KV pools the flags give each model over its ranks, before it loads; 0 where only a
    load tells (a number of blocks without their size, a GPU's pool taking the memory free)."""
    from tetrad.inference.worker.kv_cache import parse_bytes
    from tetrad.spec.serving import DEFAULT_CPU_KV_MEMORY

    if engine.num_blocks:
        return 0
    if engine.kv_memory is not None:
        return parse_bytes(engine.kv_memory) * engine.world_size
    return DEFAULT_CPU_KV_MEMORY * engine.world_size if device.type == "cpu" else 0


def default_budget(device, world_size: int) -> int:
    """--max-loaded-memory's default: the memory of the devices the ranks use, less the share
    the KV-pool sizing leaves free (DEVICE_MEMORY_FRACTION)."""
    from tetrad.inference.worker.kv_cache import DEVICE_MEMORY_FRACTION

    if device.type == "cuda":
        import torch

        total = sum(torch.cuda.mem_get_info(index)[1] for index in range(world_size))
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(total * DEVICE_MEMORY_FRACTION)


def run_one(args: argparse.Namespace) -> int:
    from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template
    from tetrad.inference.entrypoints.server import build_app

    config = server_config(args)
    with build_engine(args) as llm:  # closed (its ranks stopped) however the server ends
        name = args.served_model_name or (args.stored.name if args.stored
                                          else llm.path.resolve().name)
        server = None  # the app stops it when the engine can no longer step (a dead tp rank)
        stored = args.stored  # a stored model's Modelfile: its SYSTEM and PARAMETERs are defaults
        app = build_app(llm, name, ChatFormatter(load_chat_template(llm.path),
                                                 stored.system if stored else None),
                        on_fatal=lambda: setattr(server, "should_exit", True),
                        defaults=stored.sampling_defaults if stored else None, config=config)
        server = listen(app, args, name)
        server.run()
    if llm.failure is not None:
        raise llm.failure
    return 0
