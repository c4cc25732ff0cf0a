"""What a server of many models (model_pool.py) can load: the models of the local store by name
(tetrad create / list), and those named on `tetrad serve`'s command line (folders and GGUF files
too), each loaded as `tetrad run NAME` loads it: build_engine with the server's engine flags and
the stored model's Modelfile settings. A request names models of the store, or the command
line's by their names, never a path: a client does not make the server read a folder of its
choosing. The store and build_engine come from the command line (tetrad/cli/serve.py): the entry
points import neither the store nor the engine's rooms."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.api import ApiError
from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template


class ModelCatalog:
    def __init__(self, engine_args: argparse.Namespace,
                 build_engine: Callable[[argparse.Namespace], LLM],
                 command_line: dict[str, tuple[str, Path]] | tuple = (), store=None, *,
                 kv_bytes: int = 0):
        """engine_args: `tetrad serve`'s engine flags, which build_engine (tetrad.cli.generate's)
        reads with the model's argument as `path`; command_line: served name -> (the command
        line's argument, its model folder or file), served beside the store's; store: a
        tetrad.store.models.ModelStore; kv_bytes: the KV pools the flags give each model, over
        its ranks (0 where only a load tells: a GPU's pool takes the memory left free)."""
        self.engine_args, self.build_engine = engine_args, build_engine
        self.named = dict(command_line)
        self.store, self.kv_bytes = store, kv_bytes
        flags = vars(engine_args)
        self.world_size = flags.get("tp", 1) * flags.get("pp", 1) * flags.get("dp", 1)

    def names(self) -> list[str]:
        stored = self.store.list() if self.store is not None else []
        return sorted({*self.named, *(model.name for model in stored)})

    def resolve(self, name: str | None) -> str:
        """The served name a request's model field means; a 400 without one, a 404 for one
        neither named at start nor stored."""
        if name is None:
            raise ApiError(400, "this server holds many models: name one in the request's "
                                "model field (GET /v1/models lists them)")
        return name if name in self.named else self._stored(name).name

    def estimate_bytes(self, name: str) -> int:
        """What loading `name` will take, before it loads (to make room first): its files, and
        the KV pools of the flags. Its size counted once loaded decides (model_pool.py)."""
        folder = self.named[name][1] if name in self.named else self._stored(name).folder
        files = sum(path.stat().st_size for path in folder.iterdir() if path.is_file()) \
            if folder.is_dir() else folder.stat().st_size
        return files + self.kv_bytes

    def load(self, name: str) -> tuple[LLM, ChatFormatter, dict | None]:
        """The engine of `name` (blocking: its weights are read and its ranks started), its chat
        formatter and its Modelfile's sampling defaults."""
        args = argparse.Namespace(**vars(self.engine_args))
        args.path = self.named[name][0] if name in self.named else name
        llm = self.build_engine(args)
        try:
            stored = args.stored
            chat = ChatFormatter(load_chat_template(llm.path), stored.system if stored else None)
        except BaseException:
            llm.close()
            raise
        return llm, chat, stored.sampling_defaults if stored else None

    def _stored(self, name: str):
        """The store's model `name`; a 404 when it holds none (or the name is no model name)."""
        try:
            stored = self.store.get(name) if self.store is not None else None
        except ConfigError as error:  # not a model name, or a broken stored model
            raise ApiError(404, f"model {name[:200]!r}: {error}", "not_found_error") from None
        if stored is None:
            where = f"the store {self.store.root}" if self.store is not None else "this server"
            raise ApiError(404, f"model {name[:200]!r} is not in {where} (GET /v1/models lists "
                                f"the models; tetrad create adds one)", "not_found_error")
        return stored
