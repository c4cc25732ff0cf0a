"""Shared by the server tests: a tiny random model saved as an HF folder, the server's app run by
uvicorn on a free port of 127.0.0.1, and raw HTTP requests to it."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import torch

from tetrad.models.hf import save_hf
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model


def save_tiny_model(folder) -> None:
    torch.manual_seed(0)
    model = Transformer(resolve_model("tiny"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.15)
    save_hf(model, folder)


@contextmanager
def running(app):
    """Serve `app` on 127.0.0.1; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join()


def request(port, method: str, path: str, body: bytes | dict | None = None,
            headers: dict | None = None) -> tuple[int, object, dict]:
    """(status, decoded JSON or text, headers)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    raw = response.read()
    try:
        decoded = json.loads(raw or b"null")
    except ValueError:
        decoded = raw.decode()
    return response.status, decoded, dict(response.getheaders())


def post(port, path, body: bytes | dict, read_all=True):
    if not read_all:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, data, {"Content-Type": "application/json"})
        return connection, connection.getresponse()
    status, decoded, _ = request(port, "POST", path, body)
    return status, decoded


def events(port, path: str, body: dict) -> list:
    """The data events of a streamed answer, decoded (the last, [DONE], as a string)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                       {"Content-Type": "application/json"})
    lines = connection.getresponse().read().decode().splitlines()
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return [json.loads(item) if item != "[DONE]" else item for item in data]


def slow_steps(llm, monkeypatch, seconds: float) -> None:
    """Each engine step takes `seconds` longer: a request outlives a deadline or a disconnect
    whatever the machine's speed."""
    step = llm.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
