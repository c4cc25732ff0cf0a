"""The Ollama API of `tetrad serve` through the official `ollama` client: /api/generate and /api/chat
streamed and not, against /v1's answers to the same prompts; `options` that change sampling, and
those refused by name; Ollama's error shape."""

import http.client
import json
import socket
import time

import pytest
from serving import post, request, running, save_tiny_model, slow_steps

from tetrad.inference.engine import LLM
from tetrad.inference.entrypoints.server import build_app
from tetrad.spec.serving import ServerConfig

ollama = pytest.importorskip("ollama")
pytest.importorskip("uvicorn")
ENGINE = dict(block_size=4, num_blocks=96, log=None)
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    llm = LLM(folder, **ENGINE)  # the byte tokenizer has no end-of-text: answers run their length
    with running(build_app(llm, "tiny")) as port:
        yield llm, port


@pytest.fixture(scope="module")
def port(server):
    return server[1]


@pytest.fixture(scope="module")
def client(port):
    return ollama.Client(host=f"http://127.0.0.1:{port}")


def v1_completion(port, prompt, max_tokens=12) -> dict:
    status, body = post(port, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                   "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body


def v1_chat(port, messages, max_tokens=12) -> dict:
    status, body = post(port, "/v1/chat/completions", {"model": "tiny", "messages": messages,
                                                        "max_tokens": max_tokens,
                                                        "temperature": 0})
    assert status == 200, body
    return body


def test_generate_equals_v1_streamed_or_not(port, client):
    raw = client.generate(model="tiny", prompt="Hello there", raw=True, options=GREEDY)
    expected = v1_completion(port, "Hello there")
    assert raw.response == expected["choices"][0]["text"]
    assert raw.done and raw.done_reason == expected["choices"][0]["finish_reason"]
    assert raw.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert raw.eval_count == expected["usage"]["completion_tokens"]
    assert raw.total_duration >= raw.prompt_eval_duration + raw.eval_duration > 0
    chunks = list(client.generate(model="tiny", prompt="Hello there", raw=True, options=GREEDY,
                                  stream=True))
    assert "".join(chunk.response for chunk in chunks) == raw.response
    assert [chunk.done for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == raw.eval_count and chunks[-1].context == raw.context
    # Without raw the prompt is a user message in the model's chat rendering, as Ollama applies
    # the model's template; the answer is /v1/chat's to that message.
    templated = client.generate(model="tiny", prompt="Hello there", system="Be brief.",
                                options=GREEDY)
    chat = v1_chat(port, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hello there"}])
    assert templated.response == chat["choices"][0]["message"]["content"]
    assert templated.response != raw.response


def test_context_continues_a_generation(port, client):
    first = client.generate(model="tiny", prompt="Once", raw=True, options=GREEDY)
    assert first.context[:first.prompt_eval_count] == list(b"Once")  # the byte tokenizer's ids
    assert len(first.context) == first.prompt_eval_count + first.eval_count
    second = client.generate(model="tiny", prompt=" more", raw=True, context=first.context,
                             options=GREEDY)
    expected = v1_completion(port, first.context + list(b" more"))
    assert second.response == expected["choices"][0]["text"]
    assert second.prompt_eval_count == len(first.context) + len(b" more")


def test_chat_equals_v1_streamed_or_not(port, client):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "again"}]
    answer = client.chat(model="tiny", messages=messages, options=GREEDY)
    expected = v1_chat(port, messages)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected["choices"][0]["message"]["content"]
    assert answer.eval_count == expected["usage"]["completion_tokens"]
    chunks = list(client.chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    assert "".join(chunk.message.content for chunk in chunks) == answer.message.content
    assert chunks[-1].done and chunks[-1].done_reason == answer.done_reason


def test_options_change_sampling(port, client):
    def generate(**options):
        return client.generate(model="tiny", prompt="The", raw=True,
                               options={"num_predict": 16, **options})

    greedy = generate(temperature=0)
    assert generate(temperature=0, num_predict=3).eval_count == 3
    assert generate(temperature=0, num_predict=3).done_reason == "length"
    # top_k 1 keeps only the most likely token: sampling at any temperature is greedy.
    assert generate(temperature=1.5, top_k=1, seed=3).response == greedy.response
    seeded = [generate(temperature=1.5, seed=seed).response for seed in (7, 7, 8)]
    assert seeded[0] == seeded[1] != seeded[2]
    # A stop string taken from the greedy answer ends it just before.
    stop = greedy.response[5:7]
    stopped = generate(temperature=0, stop=[stop])
    assert stopped.done_reason == "stop"
    assert stopped.response == greedy.response[:greedy.response.index(stop)]
    penalized = generate(temperature=0, repeat_penalty=3.0)
    assert penalized.response != greedy.response
    assert len(set(penalized.response)) > len(set(greedy.response))
    # num_ctx caps prompt and answer together.
    capped = generate(temperature=0, num_ctx=len(b"The") + 4)
    assert capped.eval_count == 4 and capped.done_reason == "length"


@pytest.mark.parametrize("options, named", [
    ({"temprature": 0.5}, "unknown option 'temprature' (did you mean temperature?)"),
    ({"mirostat": 2}, "options.mirostat is not supported"),
    ({"num_thread": 4}, "options.num_thread is not supported"),
    ({"temperature": -1}, "options.temperature: temperature must be a finite number >= 0"),
    ({"top_k": 2.5}, "options.top_k must be an integer"),
    ({"num_predict": 0}, "options.num_predict 0 asks for no tokens"),
    ({"num_ctx": 10**6}, "options.num_ctx 1000000 exceeds the context this server loaded"),
    ({"stop": [""]}, "options.stop: stop must be a non-empty string"),
])
def test_options_that_are_refused_are_named(client, options, named):
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="tiny", prompt="x", options=options)
    assert error.value.status_code == 400 and named in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        list(client.chat(model="tiny", messages=[{"role": "user", "content": "x"}],
                         options=options, stream=True))
    assert error.value.status_code == 400 and named in error.value.error


@pytest.mark.parametrize("body, status, says", [
    ({"model": "tiny", "prompt": "x", "format": "json"}, 400, "format (JSON or a schema) is not"),
    ({"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template per request"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix (fill in the middle)"),
    ({"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, 400, "system has no place"),
    ({"model": "tiny", "prompt": "x", "think": True}, 400, "think is not supported"),
    ({"model": "tiny", "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive 'soon' is not"),
    ({"model": "tiny", "prompt": 3}, 400, "prompt: Input should be a valid string"),
    ({"model": "other", "prompt": "x"}, 404, "model 'other' is not served here"),
    ({"model": "tiny", "prompt": "x", "context": [256]}, 400, "prompt token ids must be in"),
])
def test_generate_errors_are_ollamas_shape(port, body, status, says):
    got, answer = post(port, "/api/generate", body)
    assert got == status and set(answer) == {"error"} and says in answer["error"], answer


def test_chat_refusals_and_unknown_paths(port):
    user = [{"role": "user", "content": "x"}]
    for body, says in [({"tools": [{"type": "function"}]}, "tools are not supported"),
                       ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
                        "images are not supported"),
                       ({"messages": [{"role": "tool", "content": "x"}]}, "each message needs"),
                       ({"format": {"type": "object"}}, "format (JSON or a schema)")]:
        got, answer = post(port, "/api/chat", {"model": "tiny", "messages": user, **body})
        assert got == 400 and says in answer["error"], answer
    got, answer, _ = request(port, "GET", "/api/copy")
    assert got == 404 and answer == {"error": "/api/copy is not part of tetrad's Ollama API"}
    got, answer = post(port, "/v1/completions", {"model": "other", "prompt": "x"})
    assert got == 404 and answer["error"]["type"] == "not_found_error"  # /v1 keeps OpenAI's


def test_a_request_without_prompt_loads_or_unloads(port):
    for keep_alive, reason in [(None, "load"), (0, "unload"), ("0s", "unload"), ("5m", "load")]:
        body = {"model": "tiny", **({} if keep_alive is None else {"keep_alive": keep_alive})}
        got, answer = post(port, "/api/generate", body)
        assert got == 200 and answer["done"] and answer["done_reason"] == reason, answer
        assert answer["response"] == ""
        got, answer = post(port, "/api/chat", {**body, "messages": []})
        assert answer["done_reason"] == reason and answer["message"]["content"] == ""


def test_streams_are_ndjson_and_probes_answer(port):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/api/generate", json.dumps(
        {"model": "tiny", "prompt": "Hi", "options": GREEDY}).encode())
    response = connection.getresponse()
    assert response.getheader("content-type") == "application/x-ndjson"
    lines = response.read().decode().splitlines()
    chunks = [json.loads(line) for line in lines]
    assert chunks[-1]["done"] and all(not chunk["done"] for chunk in chunks[:-1])
    assert set(chunks[-1]) >= {"total_duration", "load_duration", "prompt_eval_count",
                               "prompt_eval_duration", "eval_count", "eval_duration", "context"}
    for method in ("GET", "HEAD"):
        got, text, _ = request(port, method, "/")
        assert got == 200 and (method == "HEAD" or text.startswith("tetrad is running"))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_request_aborted(server, stream, monkeypatch):
    llm, port = server
    slow_steps(llm, monkeypatch, 0.01)  # else 100 tokens come before the disconnect is seen
    before = llm.metrics.num_generated_tokens
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/api/chat", json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "Once"}], "stream": stream,
        "options": {"num_predict": 100}}).encode())  # with the chat prompt, within 128
    if stream:
        assert json.loads(connection.getresponse().readline())["done"] is False
    else:
        started = time.monotonic()
        while not llm.has_unfinished():
            assert time.monotonic() - started < 20, "the request never reached the engine"
            time.sleep(0.005)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 20
    while llm.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm.has_unfinished() and llm.block_manager.num_used_blocks == 0
    assert llm.metrics.num_generated_tokens - before < 100  # aborted, not run to the end


def test_the_servers_limits_answer_in_ollamas_shape(tmp_path, monkeypatch):
    save_tiny_model(tmp_path)
    llm = LLM(tmp_path, **ENGINE)
    config = ServerConfig(api_key="sesame", max_request_bytes=4096, request_timeout=0.5)
    with running(build_app(llm, "tiny", config=config)) as port:
        got, answer = post(port, "/api/generate", {"model": "tiny", "prompt": "x"})
        assert got == 401 and set(answer) == {"error"} and "API key" in answer["error"]
        keyed = ollama.Client(host=f"http://127.0.0.1:{port}",
                              headers={"Authorization": "Bearer sesame"})
        assert keyed.generate(model="tiny", prompt="x", options={"num_predict": 2}).done
        assert request(port, "GET", "/")[0] == 200  # the probe stays open, as /health does
        with pytest.raises(ollama.ResponseError) as error:
            keyed.generate(model="tiny", prompt="x" * 5000)
        assert error.value.status_code == 413 and "exceeds 4096 bytes" in error.value.error
        slow_steps(llm, monkeypatch, 0.05)
        long = {"temperature": 0, "num_predict": 100}
        with pytest.raises(ollama.ResponseError) as error:
            keyed.generate(model="tiny", prompt="Once", raw=True, options=long)
        assert error.value.status_code == 408 and "ran longer than 0.5 s" in error.value.error
        chunks = []
        with pytest.raises(ollama.ResponseError) as error:  # a last {"error"} line, raised
            for chunk in keyed.chat(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    options=long, stream=True):
                chunks.append(chunk)
        assert "ran longer than 0.5 s" in error.value.error
        assert chunks and not chunks[-1].done  # it had begun
