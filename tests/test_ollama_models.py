"""The Ollama API's model routes (/api/tags, /api/show, /api/ps, /api/pull, /api/delete,
/api/version), embeddings (/api/embed, /api/embeddings) and a stored model's Modelfile defaults,
through the official `ollama` client; and the whole API through a real `tetrad serve` process."""

import hashlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from serving import post, request, running, save_tiny_model

from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template
from tetrad.inference.entrypoints.served import OneModel, ServedModel
from tetrad.inference.entrypoints.server import build_server
from tetrad.spec.serving import ServerConfig
from tetrad.store.modelfile import parse_modelfile
from tetrad.store.models import ModelStore

ollama = pytest.importorskip("ollama")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(block_size=4, num_blocks=96, log=None)
PIRATE = "SYSTEM You are a pirate.\nPARAMETER temperature 0\nPARAMETER num_predict 6\nLICENSE MIT\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    store = ModelStore(tmp_path_factory.mktemp("home") / "models")
    for name, settings in [("pirate", PIRATE), ("other:v1", "")]:
        modelfile = parse_modelfile(f"FROM {folder}\n{settings}")
        store.create(name, modelfile)
    return store


@pytest.fixture(scope="module")
def served(store):
    """A server of the stored pirate:latest, with the store beside it (its `store`)."""
    stored = store.require("pirate")
    llm = LLM(stored.folder, **ENGINE)
    config = ServerConfig()
    model = ServedModel.build(llm, stored.name, config,
                              ChatFormatter(load_chat_template(stored.folder), stored.system),
                              stored.sampling_defaults)
    models = OneModel(model)
    models.store = store
    with running(build_server(models, config)) as port:
        yield llm, port, ollama.Client(host=f"http://127.0.0.1:{port}")


def test_tags_show_and_version(store, served):
    llm, port, client = served
    stored = store.require("pirate")
    count = sum(p.numel() for p in llm.model.parameters())
    [tag] = client.list().models
    assert tag.model == "pirate:latest" and tag.size == stored.size
    assert tag.digest == hashlib.sha256(json.dumps(stored.manifest, sort_keys=True).encode()
                                        ).hexdigest()
    assert tag.details.family == "llama" and tag.details.format == "safetensors"
    assert tag.details.parameter_size == f"{count / 1e3:.1f}K"
    assert tag.details.quantization_level == llm.config.dtype.upper()
    shown = client.show("pirate")
    assert shown.modelfile == stored.modelfile()
    assert shown.parameters.splitlines() == ["temperature 0.0", "num_predict 6"]
    assert shown.license == "MIT" and shown.modelinfo["general.parameter_count"] == count
    assert shown.modelinfo["llama.context_length"] == llm.model_config.max_seq_len
    other = client.show("other:v1")  # stored, not loaded: described from its folder
    assert other.modelinfo == shown.modelinfo and other.parameters == ""
    with pytest.raises(ollama.ResponseError) as error:
        client.show("nope")
    assert error.value.status_code == 404 and "'nope' not found" in error.value.error
    got, answer, _ = request(port, "GET", "/api/version")
    assert answer == {"version": importlib.metadata.version("tetrad")}


def test_ps_counts_weights_and_kv_pool(served):
    llm, _, client = served
    [entry] = client.ps().models
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    pool = llm.runner.kv_cache.pool
    assert entry.model == "pirate:latest"
    assert entry.size == weights + pool.numel() * pool.element_size()
    assert entry.size_vram == 0 and entry.expires_at is None  # a CPU, and a model never unloaded
    assert entry.context_length == llm.max_model_len


def test_the_modelfile_parameters_are_the_defaults_of_options(served):
    _, _, client = served
    default = client.generate(model="pirate:latest", prompt="Ahoy", raw=True)
    assert default.eval_count == 6 and default.done_reason == "length"  # num_predict 6
    greedy = client.generate(model="pirate:latest", prompt="Ahoy", raw=True,
                             options={"temperature": 0, "num_predict": 6})
    assert default.response == greedy.response  # temperature 0
    assert client.generate(model="pirate:latest", prompt="Ahoy", raw=True,
                           options={"num_predict": 2}).eval_count == 2


def test_pull_confirms_stored_models_and_delete_removes_them(store, served):
    _, port, client = served
    assert client.pull("pirate").status == "success"
    assert [p.status for p in client.pull("other:v1", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as error:
        client.pull("llama3")
    assert error.value.status_code == 404
    assert "tetrad pulls nothing over the network" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.delete("pirate")
    assert error.value.status_code == 409 and "is loaded: unload it first" in error.value.error
    assert store.get("pirate") is not None
    assert client.delete("other:v1").status == "success"
    assert store.get("other:v1") is None
    got, answer, _ = request(port, "DELETE", "/api/delete", {"model": "other:v1"})
    assert got == 404 and answer == {"error": "model 'other:v1' not found"}


def reference_embedding(model, ids: list[int]) -> torch.Tensor:
    """The last norm's output, mean-pooled and L2-normalized, with the model's layers run here
    one by one."""
    with torch.no_grad():
        x = model.embed(torch.tensor([ids]))
        rope = model.rotary(torch.arange(len(ids)))
        for layer in model.layers:
            x = layer(x, rope)
        return torch.nn.functional.normalize(model.norm(x)[0].mean(0), dim=0)


def test_embeddings_are_the_pooled_final_hidden_state(served):
    llm, port, client = served
    texts = ["The sea", "Ahoy, matey, ahoy"]
    vectors = client.embed(model="pirate:latest", input=texts).embeddings
    for text, vector in zip(texts, vectors):
        expected = reference_embedding(llm.model, list(text.encode()))
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    assert vectors[0] != vectors[1]
    alone = client.embed(model="pirate:latest", input=texts[1]).embeddings[0]
    assert torch.allclose(torch.tensor(alone), torch.tensor(vectors[1]), atol=1e-5)
    legacy = client.embeddings(model="pirate:latest", prompt=texts[0]).embedding
    assert torch.allclose(torch.tensor(legacy), torch.tensor(vectors[0]), atol=1e-5)
    short = client.embed(model="pirate:latest", input=texts[0], dimensions=8).embeddings[0]
    pooled = reference_embedding(llm.model, list(texts[0].encode()))
    assert torch.allclose(torch.tensor(short),
                          torch.nn.functional.normalize(pooled[:8], dim=0), atol=1e-5)
    long_text = "abc" * llm.max_model_len  # more tokens than the context
    cut = client.embed(model="pirate:latest", input=long_text).embeddings[0]
    expected = reference_embedding(llm.model, list(long_text.encode())[:llm.max_model_len])
    assert torch.allclose(torch.tensor(cut), expected, atol=1e-5)
    got, answer = post(port, "/api/embed", {"model": "pirate:latest", "input": long_text,
                                            "truncate": False})
    assert got == 400 and "more than the model's context length" in answer["error"]
    got, answer = post(port, "/api/embed", {"model": "pirate:latest", "input": [""]})
    assert got == 400 and answer == {"error": "input 0 is empty: there is nothing to embed"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_through_a_tetrad_serve_process(tmp_path):
    save_tiny_model(tmp_path / "tiny")
    port = free_port()
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "TETRAD_HOME": str(tmp_path / "home")}
    server = subprocess.Popen(
        [sys.executable, "-m", "tetrad", "serve", str(tmp_path / "tiny"), "--port", str(port),
         "--served-model-name", "tiny", "--block-size", "4", "--num-blocks", "96"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.communicate()[1][-2000:]
            try:
                if request(port, "GET", "/")[0] == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "tetrad serve did not start"
                time.sleep(0.5)
        client = ollama.Client(host=f"http://127.0.0.1:{port}")
        options = {"temperature": 0, "num_predict": 8}
        whole = client.generate(model="tiny", prompt="Hello", raw=True, options=options)
        streamed = list(client.generate(model="tiny", prompt="Hello", raw=True, options=options,
                                        stream=True))
        assert "".join(chunk.response for chunk in streamed) == whole.response
        assert whole.eval_count == 8 and streamed[-1].done
        got, completion = post(port, "/v1/completions", {"model": "tiny", "prompt": "Hello",
                                                          "max_tokens": 8, "temperature": 0})
        assert completion["choices"][0]["text"] == whole.response
        chat = client.chat(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                           options=options)
        assert chat.message.role == "assistant" and chat.eval_count == 8
        assert [m.model for m in client.list().models] == ["tiny"]
        assert request(port, "GET", "/api/version")[1]["version"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # never left running past the test
            server.kill()
            server.communicate()


def test_a_pool_of_stored_models_behind_the_ollama_api(tmp_path, monkeypatch):
    import argparse

    from tetrad.cli.generate import build_engine
    from tetrad.inference.entrypoints.model_pool import ModelPool
    from tetrad.inference.entrypoints.model_pool_catalog import ModelCatalog

    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    save_tiny_model(tmp_path / "tiny")
    store = ModelStore()
    names = ["alpha:latest", "beta:latest"]
    for name in names:
        store.create(name, parse_modelfile(f"FROM {tmp_path / 'tiny'}\n"))
    alpha, beta = names
    config = ServerConfig()
    engine_args = argparse.Namespace(path=[], tokenizer=None, device="cpu", dtype="fp32",
                                     **ENGINE)
    pool = ModelPool(ModelCatalog(engine_args, build_engine, (), store), config,
                     budget_bytes=2**34, keep_alive="5m", log=lambda line: None)
    with running(build_server(pool, config)) as port:
        client = ollama.Client(host=f"http://127.0.0.1:{port}")
        assert [m.model for m in client.list().models] == names  # loaded or not
        assert client.ps().models == []
        options = {"temperature": 0, "num_predict": 8}
        first = client.generate(model="alpha", prompt="Hello", raw=True, options=options,
                                keep_alive="10m")
        again = client.generate(model="alpha", prompt="Hello", raw=True, options=options)
        got, completion = post(port, "/v1/completions", {"model": alpha, "prompt": "Hello",
                                                          "max_tokens": 8, "temperature": 0})
        assert first.response == again.response == completion["choices"][0]["text"]
        assert first.load_duration > again.load_duration  # the first one loaded the model
        [entry] = client.ps().models
        assert entry.model == alpha and entry.size == pool.loaded()[0].size_bytes
        remaining = entry.expires_at.timestamp() - time.time()
        assert 240 < remaining <= 300  # the last request's keep_alive: the server's 5m
        with pytest.raises(ollama.ResponseError) as error:
            client.delete(alpha)
        assert error.value.status_code == 409
        assert client.delete(beta).status == "success"
        assert [m.model for m in client.list().models] == [alpha]
        stopped = client.generate(model="alpha", keep_alive=0)  # what `ollama stop` sends
        assert stopped.done_reason == "unload"
        deadline = time.monotonic() + 30
        while client.ps().models:
            assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
            time.sleep(0.1)
        assert client.delete(alpha).status == "success"
