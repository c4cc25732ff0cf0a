"""What a server of many models (model_pool.py) can load: the models of the local store by name
(tetrad create / list), and those named on `tetrad serve`'s command line (folders and GGUF files
too), each loaded as `tetrad run NAME` loads it: build_engine with the server's engine flags and
the stored model's Modelfile settings. A request names models of the store only: a client never
makes the server read a path of its choosing."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.api import ApiError
from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template
from tetrad.inference.worker.config import EngineConfig, serving_device
from tetrad.inference.worker.kv_cache import DEVICE_MEMORY_FRACTION, parse_bytes
from tetrad.spec.model import from_dict
from tetrad.spec.serving import DEFAULT_CPU_KV_MEMORY
from tetrad.store.models import ModelStore, StoredModel, parse_name, resolve_model_argument


class ModelCatalog:
    def __init__(self, engine_args: argparse.Namespace,
                 build_engine: Callable[[argparse.Namespace], LLM], command_line: list[str] = (),
                 store: ModelStore | None = None):
        """engine_args: `tetrad serve`'s engine flags, which build_engine (tetrad.cli.generate's)
        reads with the model's argument as `path`; command_line: model arguments served beside
        the store's, checked here, at start."""
        self.engine_args, self.build_engine = engine_args, build_engine
        self.store = store or ModelStore()
        self.config = from_dict(EngineConfig, {key: value for key, value in
                                               vars(engine_args).items()
                                               if key in EngineConfig.__dataclass_fields__})
        self.device = serving_device(self.config.device, self.config.world_size)
        self.named: dict[str, str] = {}  # served name -> the command line's argument
        for argument in command_line:
            path, stored = resolve_model_argument(argument, self.store)
            self.named[stored.name if stored else Path(path).resolve().name] = argument

    def names(self) -> list[str]:
        return sorted({*self.named, *(model.name for model in self.store.list())})

    def resolve(self, name: str | None, loaded=()) -> str:
        """The served name a request's model field means; a 400 without one, a 404 for one
        neither named at start nor stored. Names in `loaded` need no look in the store."""
        if name is None:
            raise ApiError(400, "this server holds many models: name one in the request's "
                                "model field (GET /v1/models lists them)")
        if name in self.named:
            return name
        try:
            full = parse_name(name)
        except ConfigError:
            full = None
        if full in self.named or full in loaded or (full is not None and
                                                    self.store.get(full) is not None):
            return full
        raise ApiError(404, f"model {name[:200]!r} is not in the store {self.store.root} "
                            f"(GET /v1/models lists the models; tetrad create adds one)",
                       "not_found_error")

    def estimate_bytes(self, name: str) -> int:
        """What loading `name` will take, before it loads (to make room first): its files, and
        the KV pools the flags size. A GPU's pool takes what memory is free when the flags give
        no --kv-memory: counted once loaded (the pool then decides on the counted bytes)."""
        folder = self._stored(name).folder if name not in self.named else \
            Path(resolve_model_argument(self.named[name], self.store)[0])
        files = sum(path.stat().st_size for path in folder.iterdir() if path.is_file()) \
            if folder.is_dir() else folder.stat().st_size
        config = self.config
        if config.num_blocks:
            kv = 0  # a number of blocks without their size: counted once loaded
        elif config.kv_memory is not None:
            kv = parse_bytes(config.kv_memory) * config.world_size
        else:
            kv = DEFAULT_CPU_KV_MEMORY * config.world_size if self.device.type == "cpu" else 0
        return files + kv

    def default_budget(self) -> int:
        """--max-loaded-memory's default: the memory of the devices the ranks use, less the
        share the KV-pool sizing leaves free (DEVICE_MEMORY_FRACTION)."""
        if self.device.type == "cuda":
            import torch

            total = sum(torch.cuda.mem_get_info(index)[1]
                        for index in range(self.config.world_size))
        else:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(total * DEVICE_MEMORY_FRACTION)

    def load(self, name: str) -> tuple[LLM, ChatFormatter, dict | None]:
        """The engine of `name` (blocking: its weights are read and its ranks started), its chat
        formatter and its Modelfile's sampling defaults."""
        args = argparse.Namespace(**vars(self.engine_args))
        args.path = self.named.get(name, name)
        llm = self.build_engine(args)
        try:
            stored: StoredModel | None = args.stored
            chat = ChatFormatter(load_chat_template(llm.path), stored.system if stored else None)
        except BaseException:
            llm.close()
            raise
        return llm, chat, stored.sampling_defaults if stored else None

    def _stored(self, name: str) -> StoredModel:
        try:
            return self.store.require(name)
        except ConfigError as error:  # removed since the request resolved it
            raise ApiError(404, str(error), "not_found_error") from None
