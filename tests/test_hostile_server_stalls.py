"""`tetrad serve` attacked by what used to stall it: no hostile request (a slow chat template, a
huge prompt, a huge /tokenize, a saturated tokenizer pool) holds up a small one for more than a
second; clients that leave free what they held, and /health tells a stalled front end."""

import http.client
import json
import socket
import threading
import time

import pytest
from serving import request
from hostile_http import (AUTH, CHAT, COMPLETIONS, NESTED_LOOPS, SMALL_REQUEST_S, call, chat,
                         error_says, hi, serve, small_requests_while, template_threads, timed,
                         wait_for)
from hostile_http import model_dir, server  # noqa: F401 (fixtures by name)

from tetrad.inference.entrypoints import front_end
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.tokenizer import ByteTokenizer


pytest.importorskip("uvicorn")


def test_a_slow_chat_template_stalls_no_one_and_is_stopped(server):
    _, port = server
    hostile = [lambda: call(port, CHAT, chat("hi")) for _ in range(8)]
    start = time.perf_counter()
    seconds = small_requests_while(port, hostile)
    assert max(seconds) < SMALL_REQUEST_S, seconds
    for status, answer in hostile:  # over its time (400), or no render slot meanwhile (503)
        assert status in (400, 503), answer
        assert error_says(answer, "--template-timeout" if status == 400 else "retry later")
    assert time.perf_counter() - start < 10
    assert wait_for(lambda: not template_threads(), 5), "the renders were not stopped"
    assert call(port, "/health", None, method="GET")[0] == 200


def test_a_client_that_leaves_stops_its_render(model_dir):
    with serve(model_dir, ChatFormatter(NESTED_LOOPS), template_timeout=60) as (_, port):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", CHAT, chat("hi"), {"Content-Type": "application/json",
                                                      **AUTH})
        assert wait_for(lambda: template_threads(), 5)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        assert wait_for(lambda: not template_threads(), 5), "the render outlived its client"


def test_template_output_and_operations_are_bounded(model_dir):
    cases = {"{% for m in messages %}{% for i in range(100000) %}{{ m.content }}{% endfor %}"
             "{% endfor %}": "context length",  # its output passes the prompt's limit
             "{{ 'x' * 10**10 }}": "too large", "{{ 7 ** (10 ** 9) }}": "too large",
             "{{ raise_exception('no') }}": "template failed"}
    for template, words in cases.items():
        with serve(model_dir, ChatFormatter(template), template_timeout=30) as (_, port):
            start = time.perf_counter()
            status, answer = call(port, CHAT, chat("hello"))
            assert status == 400 and error_says(answer, words), (template, answer)
            assert time.perf_counter() - start < 5


def test_huge_prompts_are_refused_from_their_size_at_once(server):
    _, port = server
    huge = "x" * 10 * 2**20
    hostile = [lambda: timed(port, COMPLETIONS, {"prompt": huge, "max_tokens": 1}),
               lambda: timed(port, "/tokenize", {"prompt": huge}),
               lambda: timed(port, COMPLETIONS, {"prompt": ["Hi", huge]}),
               lambda: timed(port, CHAT, {"messages": [{"role": "user", "content": huge}]})]
    seconds = small_requests_while(port, hostile, rounds=3)
    # 40 MiB of bodies cross this process's own client threads and the event loop here, so the
    # bound is looser than the second the other tests hold: 0.2 s on the dev machine, 1.007 s once
    # on a loaded 2-core CI runner, 17 s when the prompt is tokenized before its size is checked.
    assert max(seconds) < 3 * SMALL_REQUEST_S, seconds
    assert [status for status, _ in hostile] == [400] * 4
    assert max(took for _, took in hostile) < 5  # 17 s and 41 s when tokenized first
    status, answer = call(port, "/tokenize", {"prompt": "y" * 129})
    assert status == 400 and error_says(answer, "129 bytes", "context length", "128")
    status, answer = call(port, "/tokenize", {"prompt": "y" * 128})
    assert status == 200 and answer["count"] == 128


class SlowTokenizer(ByteTokenizer):
    """Takes its time (off the GIL, as HF tokenizers' batch encoding does) on long text, and
    claims no bound on a token's bytes, so long text is allowed in."""

    longest_token_bytes = None

    def encode(self, text: str) -> list[int]:
        if len(text) > front_end.INLINE_TOKENIZE_BYTES:
            time.sleep(2.0)
        return super().encode(text)


def test_a_saturated_tokenizer_pool_delays_no_small_prompt_and_health_tells(
        model_dir, monkeypatch):
    monkeypatch.setattr(front_end, "TOKENIZE_STALL_S", 0.5)
    with serve(model_dir, tokenizer=SlowTokenizer()) as (_, port):
        long_text = "z" * (front_end.INLINE_TOKENIZE_BYTES + 1)
        hostile = [lambda: call(port, "/tokenize", {"prompt": long_text})
                   for _ in range(3 * front_end.TOKENIZE_THREADS)]
        health = []
        hostile.append(lambda: (time.sleep(1.0), health.append(
            call(port, "/health", None, method="GET")))[0])
        seconds = small_requests_while(port, hostile, rounds=3)
        assert max(seconds) < SMALL_REQUEST_S, seconds
        status, answer = health[0]
        assert status == 503 and error_says(answer, "tokenizing is stalled"), answer
        assert all(status == 200 for status, _ in hostile[:-1])
        assert call(port, "/health", None, method="GET")[0] == 200


class StuckChat(ChatFormatter):
    """A render blocked in C (a lock wait), where stopping its thread cannot reach it."""

    def __init__(self):
        super().__init__("{{ messages[0].content }}")
        self.release = threading.Event()

    def render(self, messages, max_chars=None):
        self.release.wait(30)
        return super().render(messages, max_chars)


def test_health_reports_a_render_that_does_not_stop(model_dir, monkeypatch):
    monkeypatch.setattr(front_end, "STOP_GRACE_S", 0.3)
    stuck = StuckChat()
    with serve(model_dir, stuck, template_timeout=0.3) as (_, port):
        status, answer = call(port, CHAT, chat("hi"))
        assert status == 400 and error_says(answer, "--template-timeout")
        time.sleep(0.5)
        status, answer = call(port, "/health", None, method="GET")
        assert status == 503 and error_says(answer, "do not stop"), answer
        stuck.release.set()
        assert wait_for(lambda: not template_threads(), 5)
        assert call(port, "/health", None, method="GET")[0] == 200


def test_clients_leaving_mid_stream_free_their_sequences(server, monkeypatch):
    llm, port = server
    step = llm.step

    def slow_step():  # the tiny model would finish its tokens before the clients leave
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    before = llm.metrics.num_generated_tokens
    connections = []
    for _ in range(16):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", COMPLETIONS, hi(max_tokens=100, ignore_eos=True, stream=True),
                           {"Content-Type": "application/json", **AUTH})
        assert connection.getresponse().readline().startswith(b"data: ")
        connections.append(connection)
    for connection in connections:
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
    assert wait_for(lambda: not llm.has_unfinished() and
                    llm.block_manager.num_used_blocks == 0, 20)
    assert llm.metrics.num_generated_tokens - before < 16 * 100  # aborted, not run to the end


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(model_dir):
    from tetrad.tokenizer import BPETokenizer

    words = "the quick brown fox jumps over the lazy dog and runs far away "
    bpe = BPETokenizer.train([words * 50], vocab_size=300)
    bpe.longest_token_bytes = None  # no byte bound: the long text is tokenized
    with serve(model_dir, tokenizer=bpe) as (_, port):
        long_text = words * 16000  # ~1 MB: a second or more of tokenizing on this machine
        hostile = [lambda: timed(port, "/tokenize", {"prompt": long_text})]
        seconds = small_requests_while(port, hostile, rounds=3)
        (status, took), = hostile
        assert status == 200 and took > 2 * max(seconds)  # it ran while the small ones did
        assert max(seconds) < SMALL_REQUEST_S, seconds
