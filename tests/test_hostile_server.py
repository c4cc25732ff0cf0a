"""`tetrad serve` attacked: every hostile request gets its documented 4xx in OpenAI's error JSON
(never a 5xx or a traceback), the API key cannot be bypassed, and no hostile request (a slow chat
template, a huge prompt, a huge /tokenize, a saturated tokenizer pool) holds up a small one for
more than a second; clients that leave free what they held, and /health tells a stalled front
end."""

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from serving import request, running, save_tiny_model

from tetrad.inference.entrypoints import front_end
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.engine import LLM
from tetrad.tokenizer import ByteTokenizer

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
REFUSED = [  # (path, raw body, status, words its error message holds)
    *[(COMPLETIONS, f'{{"prompt": "Hi", "{field}": {value}}}'.encode(), 400, (field,))
      for field in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty") for value in ("Infinity", "-Infinity", "NaN")],
    (CHAT, chat([{"type": "text", "text": 5}]), 400, ("text", "string")),
    (CHAT, chat([{"type": "text"}]), 400, ("text", "string")),
    (CHAT, chat([{"type": "text", "text": ["a"]}]), 400, ("text", "string")),
    (CHAT, chat([["nested", ["junk"]]]), 400, ("content",)),
    (CHAT, chat({"text": "a dict"}), 400, ("content",)),
    (CHAT, chat(None), 400, ("content",)),
    (CHAT, json.dumps({"messages": ["hi"]}).encode(), 400, ("messages",)),
    (CHAT, json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), 400,
     ("role",)),
    (CHAT, json.dumps({"messages": {"role": "user"}}).encode(), 400, ("messages",)),
    (CHAT, json.dumps({"messages": []}).encode(), 400, ("empty",)),
    (CHAT, chat("x", top_logprobs=3), 400, ("top_logprobs",)),
    (CHAT, chat("x", logprobs=True, top_logprobs=21), 400, ("logprobs",)),
    (CHAT, chat("x", max_completion_tokens=-3), 400, ("max_tokens",)),
    (COMPLETIONS, json.dumps({"prompt": [1.5]}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": [None]}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": [True, 1]}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": [["a"]]}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": [[1, "a"]]}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": {"a": 1}}).encode(), 400, ("prompt",)),
    (COMPLETIONS, json.dumps({"prompt": [-1]}).encode(), 400, ("vocab",)),
    (COMPLETIONS, json.dumps({"prompt": [10**30]}).encode(), 400, ("vocab",)),
    (COMPLETIONS, json.dumps({"prompt": [1] * 200}).encode(), 400, ("context length",)),
    (COMPLETIONS, json.dumps({"prompt": ""}).encode(), 400, ("empty",)),
    (COMPLETIONS, json.dumps({"prompt": "\ud800"}).encode(), 400, ("utf-8",)),
    (COMPLETIONS, hi(n=10**9), 400, ("--max-sequences-per-request",)),
    (COMPLETIONS, hi(n=0), 400, ("n must",)),
    (COMPLETIONS, hi(logprobs=10**6), 400, ("logprobs",)),
    (COMPLETIONS, hi(logprobs=-1), 400, ("logprobs",)),
    (COMPLETIONS, hi(max_tokens=-1), 400, ("max_tokens",)),
    (COMPLETIONS, hi(max_tokens=10**30), 400, ("max_tokens",)),
    (COMPLETIONS, hi(max_tokens=1.5), 400, ("max_tokens",)),
    (COMPLETIONS, hi(seed="1"), 400, ("seed",)),
    (COMPLETIONS, hi(seed=1.5), 400, ("seed",)),
    (COMPLETIONS, hi(logit_bias={"abc": 5}), 400, ("logit_bias",)),
    (COMPLETIONS, hi(logit_bias={"1": "x"}), 400, ("logit_bias",)),
    (COMPLETIONS, hi(top_k=-1), 400, ("top_k",)),
    (COMPLETIONS, hi(stop=[""]), 400, ("stop",)),
    (COMPLETIONS, hi(stop=[5]), 400, ("stop",)),
    (COMPLETIONS, hi(stop=["a"] * 1000), 400, ("--max-stop-strings",)),
    (COMPLETIONS, hi(model="other"), 404, ("not served",)),
    (COMPLETIONS, b"{not json", 400, ()),
    (COMPLETIONS, b"[1, 2]", 400, ("body",)),
    (COMPLETIONS, b"", 400, ()),
    ("/tokenize", json.dumps({"prompt": 5}).encode(), 400, ("prompt",)),
    ("/tokenize", json.dumps({"prompt": ["a"]}).encode(), 400, ("prompt",)),
    ("/detokenize", json.dumps({"tokens": [1, 10**20]}).encode(), 400, ("vocab",)),
    ("/detokenize", json.dumps({"tokens": ["a"]}).encode(), 400, ("tokens",)),
    ("/detokenize", json.dumps({"tokens": [1] * 129}).encode(), 400, ("context length",)),
    ("/v1/nowhere", hi(), 404, ()),
]


@pytest.mark.parametrize("path, body, status, words", REFUSED,
                         ids=[f"{i}-{case[0]}" for i, case in enumerate(REFUSED)])
def test_hostile_bodies_get_their_4xx(server, path, body, status, words):
    got, answer = call(server[1], path, body)
    assert (got, error_says(answer, *words)) == (status, True), answer


def test_wrong_methods_and_huge_bodies_are_json_errors(server):
    _, port = server
    status, answer = call(port, COMPLETIONS, None, method="GET")
    assert status == 405 and error_says(answer)
    status, answer = call(port, COMPLETIONS, b'{"prompt": "' + b"x" * 12 * 2**20 + b'"}')
    assert status == 413 and error_says(answer, "--max-request-bytes")


BYPASSES = [  # (method, path, headers): none may reach a route
    ("GET", "/v1/models", {}),
    ("GET", "/v1/models", {"Authorization": f"bearer {KEY}"}),
    ("GET", "/v1/models", {"Authorization": f"BEARER {KEY}"}),
    ("GET", "/v1/models", {"Authorization": "Bearer"}),
    ("GET", "/v1/models", {"Authorization": "Bearer "}),
    ("GET", "/v1/models", {"Authorization": f"Bearer {KEY} "}),
    ("GET", "/v1/models", {"Authorization": f"Bearer  {KEY}"}),
    ("GET", "/v1/models", {"Authorization": f"Basic {KEY}"}),
    ("GET", "/v1/models", {"Authorization": KEY}),
    ("GET", "/v1/models", {"X-Api-Key": KEY, "Api-Key": KEY}),
    ("GET", f"/v1/models?api_key={KEY}", {}),
    ("GET", f"/v1/models?key={KEY}&Authorization=Bearer%20{KEY}", {}),
    ("GET", "//v1/models", {}),
    ("GET", "/v1/../v1/models", {}),
    ("GET", "/./v1/models", {}),
    ("GET", "/%76%31/models", {}),
    ("GET", "/v1%2Fmodels", {}),
    ("GET", "/V1/models", {}),
    ("GET", "/v1/models/", {}),
    ("GET", "/v1/models;x", {}),
    ("HEAD", "/v1/models", {}),
    ("OPTIONS", "/v1/models", {}),
    ("OPTIONS", "/v1/completions", {"Access-Control-Request-Method": "POST",
                                    "Origin": "http://evil"}),
    ("POST", "/tokenize", {}),
    ("POST", "/tokenize/", {}),
    ("POST", "//tokenize", {}),
    ("POST", "/detokenize", {"Authorization": "Bearer wrong"}),
    ("POST", "/v1/completions", {"Authorization": f"Bearer {KEY[:-1]}"}),
    ("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}x"}),
    ("POST", "/v1/chat/completions", {"Authorization": f"Bearer {KEY.upper()}"}),
]


@pytest.mark.parametrize("method, path, headers", BYPASSES,
                         ids=[f"{i}-{m}-{p}" for i, (m, p, _) in enumerate(BYPASSES)])
def test_the_api_key_cannot_be_bypassed(server, method, path, headers):
    body = b'{"prompt": "Hi", "max_tokens": 1}' if method == "POST" else None
    status, answer, _ = request(server[1], method, path, body, headers)
    assert status in (401, 404, 405), (status, answer)
    if method != "HEAD":  # a HEAD answer has no body
        assert error_says(answer), answer


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

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(hostile))]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the hostile requests are in
    seconds = []
    for _ in range(rounds):
        for path, body in ((COMPLETIONS, hi(max_tokens=1)), ("/tokenize", {"prompt": "Hi"})):
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


def test_a_models_stop_strings_obey_the_servers_limit(model_dir):
    from tetrad.errors import ConfigError
    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.server import build_app

    llm = LLM(model_dir, **ENGINE)
    with pytest.raises(ConfigError, match="3 stop strings.*--max-stop-strings 2"):
        build_app(llm, "tiny", defaults={"stop": ("a", "b", "c")},
                  config=ServerConfig(max_stop_strings=2))
    assert build_app(llm, "tiny", defaults={"stop": ("a", "b")},
                     config=ServerConfig(max_stop_strings=2))


def test_no_bpe_token_stands_for_more_bytes_than_the_bound():
    import random

    from tokenizers import Tokenizer, models

    from tetrad.tokenizer import BPETokenizer

    rng = random.Random(0)
    corpus = ["".join(rng.choice("ab cé€\n") for _ in range(400)) for _ in range(20)]
    bpe = BPETokenizer.train(corpus, vocab_size=400)
    longest = bpe.longest_token_bytes
    for text in corpus[:5] + ["ab" * 300, "€" * 200, "\U0001f600" * 50]:
        ids = bpe.encode(text)
        assert len(ids) * longest >= len(text.encode())  # so more bytes is more tokens
        assert max(len(bpe.decode([token]).encode()) for token in ids) <= longest
    # One unk token can stand for any unknown text: no bound.
    assert BPETokenizer(Tokenizer(models.BPE(unk_token="[UNK]"))).longest_token_bytes is None


@pytest.mark.parametrize("name, content, words", [
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "chat_template.jinja is not a chat template"),
    ("tokenizer_config.json", b"{not json", "tokenizer_config.json is not a chat template"),
    ("tokenizer_config.json", b"\xff", "tokenizer_config.json is not a chat template"),
    ("tokenizer_config.json", b"[1, 2]", "must hold a JSON object, got list"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template must be text, got int"),
    ("tokenizer_config.json", b"[" * 100_000, "tokenizer_config.json is not a chat template"),
])
def test_a_broken_template_file_is_one_error_naming_it(tmp_path, name, content, words):
    from tetrad.errors import ConfigError
    from tetrad.inference.entrypoints.chat import load_chat_template
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        load_chat_template(tmp_path)


def test_named_templates_give_the_default_one(tmp_path):
    from tetrad.inference.entrypoints.chat import load_chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, "junk", {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path) == "D"
