"""`tetrad serve` attacked: every hostile request gets its documented 4xx in OpenAI's error JSON
(never a 5xx or a traceback), the API key cannot be bypassed, a model's stop strings obey the
server's limit, and broken template files are one error. What stalls the server:
test_hostile_server_stalls.py."""

import http.client
import json

import pytest
from serving import request
from hostile_http import CHAT, COMPLETIONS, ENGINE, KEY, call, chat, error_says, hi, serve
from hostile_http import model_dir, server  # noqa: F401 (fixtures by name)

from tetrad.inference.engine import LLM


pytest.importorskip("uvicorn")


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
