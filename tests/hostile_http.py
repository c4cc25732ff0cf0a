"""What the hostile-server tests share: a tiny model served with an API key, plain HTTP calls,
OpenAI error bodies, and small requests timed while hostile ones run beside them."""

import json
import threading
import time
from contextlib import contextmanager

import pytest
from serving import request, running, save_tiny_model

from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.engine import LLM


pytest.importorskip("uvicorn")
KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(block_size=4, num_blocks=96, log=None)
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                "{{ messages[0].content }}")
SMALL_REQUEST_S = 1.0  # the goal: no request stalls another for more than a second


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    return folder


@contextmanager
def serve(model_dir, chat=None, tokenizer=None, **limits):
    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.server import build_app

    llm = LLM(model_dir, tokenizer, **ENGINE)
    config = ServerConfig(**{"api_key": KEY, "max_request_bytes": 11 * 2**20, **limits})
    with running(build_app(llm, "tiny", chat, config=config)) as port:
        yield llm, port


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, ChatFormatter(NESTED_LOOPS), template_timeout=1.0) as served:
        yield served


def call(port, path, body, headers=AUTH, method="POST"):
    status, decoded, _ = request(port, method, path, body, headers)
    return status, decoded


def error_says(body, *words) -> bool:
    """An OpenAI error body whose message holds each word."""
    if not (isinstance(body, dict) and set(body) == {"error"} and
            set(body["error"]) == {"message", "type", "param", "code"}):
        return False
    return all(word.lower() in body["error"]["message"].lower() for word in words)


def hi(**fields) -> bytes:
    return json.dumps({"prompt": "Hi", "max_tokens": 2, **fields}).encode()


def chat(content, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                       **fields}).encode()


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
def timed(port, path, body) -> tuple[int, float]:
    start = time.perf_counter()
    status, _ = call(port, path, body)
    return status, time.perf_counter() - start


def small_requests_while(port, hostile: list, rounds: int = 5) -> list[float]:
    """Seconds each small completion and /tokenize took while the hostile calls (thunks) ran on
    threads of their own; their answers go back into `hostile`'s place."""
    answers = [None] * len(hostile)

    def run(index):
        answers[index] = hostile[index]()

    small = ((COMPLETIONS, hi(max_tokens=1)), ("/tokenize", {"prompt": "Hi"}))
    # One untimed round first: a path's first call imports modules (encodings.idna among them);
    # an import's file operations each give up the GIL, which the eight rendering threads then
    # take in turn. On CI's 2 cores the first call took 1.07 s, the later ones 2-7 ms: a cold
    # start, not a stall the hostile requests cause.
    for path, body in small:
        assert timed(port, path, body)[0] == 200
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(hostile))]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the hostile requests are in
    seconds = []
    for _ in range(rounds):
        for path, body in small:
            status, took = timed(port, path, body)
            assert status == 200
            seconds.append(took)
    for thread in threads:
        thread.join()
    hostile[:] = answers
    return seconds


def template_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tetrad-chat-template" and t.is_alive()]


def wait_for(condition, seconds: float) -> bool:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()
