"""Shared by the model pool tests: three tiny random models of different weights in a model
store, each one's greedy answer from its own engine, and a pool over the store."""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import pytest
import torch

from tetrad.cli.generate import build_engine
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.api import ServerConfig
from tetrad.inference.entrypoints.model_pool import ModelPool
from tetrad.inference.entrypoints.model_pool_catalog import ModelCatalog
from tetrad.models.hf import save_hf
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model
from tetrad.store.modelfile import parse_modelfile
from tetrad.store.models import ModelStore

NAMES = ("alpha:latest", "beta:latest", "gamma:latest")
ENGINE = dict(block_size=4, num_blocks=24, device="cpu", dtype="fp32")
PROMPT = "Hello"
MAX_TOKENS = 8


def save_model(folder, seed: int) -> None:
    torch.manual_seed(seed)
    model = Transformer(resolve_model("tiny"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.15)
    save_hf(model, folder)


def fill_store(root, sources) -> dict[str, str]:
    """The three models stored under NAMES in a store at `root`; each one's greedy text."""
    expected = {}
    for seed, name in enumerate(NAMES):
        folder = sources / name.split(":")[0]
        save_model(folder, seed)
        modelfile = parse_modelfile(f"FROM {folder}\n")
        modelfile.folder = sources
        ModelStore(root).create(name, modelfile)
        llm = LLM(folder, log=None, **ENGINE)
        expected[name] = llm.generate(PROMPT, SamplingParams(temperature=0,
                                                             max_tokens=MAX_TOKENS))[0].text
    return expected


def stored_models(tmp_path_factory):
    """For a module's fixture: the store (as $TETRAD_HOME) while the module runs, and each
    model's greedy answer from its own engine."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TETRAD_HOME", str(home))
        yield fill_store(home / "models", tmp_path_factory.mktemp("sources"))


def counted_bytes(name: str) -> int:
    """A stored model's bytes as its own engine holds them, counted on its tensors: parameters
    and KV pool."""
    llm = LLM(ModelStore().require(name).folder, log=None, **ENGINE)
    pool = llm.runner.kv_cache.pool
    return (sum(p.numel() * p.element_size() for p in llm.model.parameters())
            + pool.numel() * pool.element_size())


def engine_args(engine: dict = ENGINE) -> argparse.Namespace:
    return argparse.Namespace(path=[], tokenizer=None, **engine)


class LoadHook:
    """The catalog's load, counted per model; a model in `held` waits, once its load started,
    until the test lets it go (a slow load without sleeping)."""

    def __init__(self, catalog: ModelCatalog, held: tuple[str, ...] = ()):
        self.load, self.held = catalog.load, held
        self.started = {name: threading.Event() for name in held}
        self.go = {name: threading.Event() for name in held}
        self.calls: list[str] = []
        catalog.load = self

    def __call__(self, name: str):
        self.calls.append(name)
        if name in self.held:
            self.started[name].set()
            self.go[name].wait(120)
        return self.load(name)


def make_pool(budget: int = 2**34, keep_alive="5m", held: tuple[str, ...] = (),
              engine: dict = ENGINE) -> tuple[ModelPool, LoadHook, list[str]]:
    """A pool over the store $TETRAD_HOME names; its load hook and the lines it logs."""
    catalog = ModelCatalog(engine_args(engine), build_engine, (), ModelStore())
    hook = LoadHook(catalog, held)
    lines: list[str] = []
    return ModelPool(catalog, ServerConfig(), budget, keep_alive, lines.append), \
        hook, lines


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.01)


def completion(name: str, **extra) -> dict:
    return {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


POOL_THREADS = ("tetrad-engine", "tetrad-model-load", "tetrad-tokenize")


def assert_nothing_left_running() -> None:
    wait_until(lambda: not [thread for thread in threading.enumerate()
                            if thread.name.startswith(POOL_THREADS)], 30)
    assert multiprocessing.active_children() == []


def loaded(pool) -> set[str]:
    return {served.name for served in pool.loaded()}
