"""`tetrad serve` fit to expose: the API key, each limit with its 4xx (or 503) answer in OpenAI's
error JSON, strict types, lone surrogates, errors that never come as plain text, a failed step
that fails only its requests, /health telling the truth, /metrics read on the engine thread, and
outputs handed from the engine thread without copying."""

import asyncio
import http.client
import json
import threading
import time

import pytest
from serving import events, post, request, running, save_tiny_model

from tetrad.inference.engine import LLM
from tetrad.inference.core.output import CompletionOutput, RequestOutput

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
KEY = "sk-test-key"
LIMITS = dict(api_key=KEY, max_request_bytes=4096, max_sequences_per_request=4,
              max_stop_strings=2, max_waiting_requests=1, request_timeout=1.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    return folder


def serve(llm, **limits):
    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.server import build_app

    return running(build_app(llm, "tiny", config=ServerConfig(**limits)))


@pytest.fixture(scope="module")
def guarded(model_dir):
    llm = LLM(model_dir, block_size=4, num_blocks=96, log=None)
    with serve(llm, **LIMITS) as port:
        yield llm, port


AUTH = {"Authorization": f"Bearer {KEY}"}


def call(port, path, body, headers=AUTH):
    status, decoded, _ = request(port, "POST", path, body, headers)
    return status, decoded


def is_openai_error(body, kind=None) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and body["error"]["message"]
            and (kind is None or body["error"]["type"] == kind))


def test_api_key(guarded):
    _, port = guarded
    body = {"prompt": "Hi", "max_tokens": 2}
    status, answer = call(port, "/v1/completions", body, headers={})
    assert status == 401 and is_openai_error(answer, "authentication_error")
    status, answer = call(port, "/v1/completions", body, {"Authorization": "Bearer wrong"})
    assert status == 401 and is_openai_error(answer, "authentication_error")
    assert call(port, "/tokenize", {"prompt": "Hi"}, headers={})[0] == 401
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
    assert request(port, "GET", "/health")[0] == 200  # probes need no key


def test_body_size_sequences_and_stop_strings(guarded):
    _, port = guarded
    status, answer = call(port, "/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1})
    assert status == 413 and is_openai_error(answer) and "--max-request-bytes" in \
        answer["error"]["message"]
    # A chunked body (no Content-Length) is counted as it arrives.
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/v1/completions", (b"x" * 1000 for _ in range(5)),
                       {"Content-Type": "application/json", **AUTH}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and is_openai_error(json.loads(response.read()))
    status, answer = call(port, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2,
                                                    "max_tokens": 1})
    assert status == 400 and "6 sequences" in answer["error"]["message"]
    assert call(port, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})[0] \
        == 200
    status, answer = call(port, "/v1/completions", {"prompt": "a", "stop": ["1", "2", "3"]})
    assert status == 400 and "--max-stop-strings" in answer["error"]["message"]


def test_full_queue_gets_503_with_retry_after(guarded, monkeypatch):
    llm, port = guarded
    release = threading.Event()
    step = llm.step

    def held_step():
        release.wait(10)
        return step()

    monkeypatch.setattr(llm, "step", held_step)
    first = threading.Thread(target=call, args=(port, "/v1/completions",
                                                {"prompt": "Hi", "max_tokens": 2}))
    first.start()
    deadline = time.time() + 10
    while llm.num_waiting() < 1 and time.time() < deadline:
        time.sleep(0.01)
    status, answer, headers = request(port, "POST", "/v1/completions",
                                      {"prompt": "Hi", "max_tokens": 2}, AUTH)
    release.set()
    first.join()
    assert status == 503 and headers["retry-after"] == "1" and is_openai_error(answer)


def test_request_timeout_stops_the_request(guarded, monkeypatch):
    llm, port = guarded
    step = llm.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    body = {"prompt": "Once", "max_tokens": 100, "ignore_eos": True}
    status, answer = call(port, "/v1/completions", body)
    assert status == 408 and is_openai_error(answer, "timeout_error")
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json", **AUTH})
    data = [line for line in connection.getresponse().read().decode().splitlines()
            if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and is_openai_error(json.loads(data[-2][6:]),
                                                          "timeout_error")
    deadline = time.time() + 20
    while llm.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    assert llm.block_manager.num_used_blocks == 0  # both were aborted, their blocks freed


def test_strict_types_surrogates_and_json_errors_everywhere(guarded):
    _, port = guarded
    for field, value in [("max_tokens", "10"), ("n", True), ("stream", "yes"),
                         ("temperature", "0.5"), ("logprobs", True)]:
        status, answer = call(port, "/v1/completions", {"prompt": "Hi", field: value})
        assert status == 400 and field in answer["error"]["message"], (field, answer)
    assert call(port, "/v1/completions", {"prompt": "Hi", "temperature": 0, "max_tokens": 1}
                )[0] == 200  # an integer is a number
    surrogate = b'{"prompt": "Hi \\ud800 there", "max_tokens": 2}'
    status, answer = call(port, "/v1/completions", surrogate)
    assert status == 400 and "surrogate" in answer["error"]["message"]
    status, answer = call(port, "/v1/chat/completions",
                          b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert status == 400 and "surrogate" in answer["error"]["message"]
    status, answer = call(port, "/v1/completions", b'{"prompt": "Hi", "stop": ["\\ud800"]}')
    assert status == 400 and "surrogate" in answer["error"]["message"]
    status, answer = call(port, "/v1/completions", b'{"prompt": ["Hi", "\\ud800"]}')
    assert status == 400 and "surrogate" in answer["error"]["message"]  # a batch's texts too
    for method, path in [("GET", "/nowhere"), ("GET", "/v1/completions"), ("GET", "/docs"),
                         ("GET", "/openapi.json")]:
        status, answer, _ = request(port, method, path, headers=AUTH)
        assert status in (404, 405) and is_openai_error(answer), (path, answer)


def test_serve_flags_are_checked_before_the_model_loads(model_dir, capsys):
    from tetrad.cli.main import main

    assert main(["serve", str(model_dir), "--max-waiting-requests", "0"]) == 2
    assert "max_waiting_requests must be" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--request-timeout", "-1"]) == 2
    assert "request_timeout must be" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--stream-interval", "0"]) == 2
    assert "stream_interval must be" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--template-timeout", "nan"]) == 2
    assert "template_timeout must be" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--request-timeout", "inf"]) == 2
    assert "request_timeout must be" in capsys.readouterr().err


def test_docs_only_when_asked(model_dir):
    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.server import build_app

    llm = LLM(model_dir, block_size=4, num_blocks=16, log=None)
    assert build_app(llm, "tiny").docs_url is None
    assert build_app(llm, "tiny", config=ServerConfig(enable_docs=True)).docs_url == "/docs"


def test_a_failed_step_fails_only_its_requests_and_health_tells(model_dir, monkeypatch):
    # One sequence at a time, so that a step runs exactly one request.
    llm = LLM(model_dir, block_size=4, num_blocks=96, max_num_seqs=1, log=None)
    poison = 7  # a prompt holding this id makes the step that runs it fail
    execute = llm._execute
    broken = threading.Event()

    def execute_or_fail(plan):
        if broken.is_set() or poison in plan.token_ids:
            raise RuntimeError("device fault")
        return execute(plan)

    monkeypatch.setattr(llm, "_execute", execute_or_fail)
    with serve(llm) as port:
        results = {}

        def send(name, prompt):
            results[name] = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                           "temperature": 0})

        threads = [threading.Thread(target=send, args=(name, prompt)) for name, prompt in
                   [("before", [1, 2, 3]), ("poisoned", [1, poison, 3]), ("after", [4, 5])]]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        assert results["before"][0] == 200 and results["after"][0] == 200
        status, answer = results["poisoned"]
        assert status == 500 and is_openai_error(answer, "server_error")
        assert "device fault" in answer["error"]["message"]
        stream = events(port, "/v1/completions", {"prompt": [poison], "max_tokens": 2})
        assert is_openai_error(stream[-2], "server_error") and stream[-1] == "[DONE]"
        assert request(port, "GET", "/health")[0] == 200  # one bad request: a healthy engine
        broken.set()  # now every step fails
        for _ in range(3):
            assert post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 500
        status, answer, _ = request(port, "GET", "/health")
        assert status == 503 and "engine steps failed: RuntimeError: device fault" in \
            answer["error"]["message"]
        broken.clear()
        assert post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
        assert request(port, "GET", "/health")[0] == 200
        assert llm.block_manager.num_used_blocks == 0


def test_a_request_whose_text_fails_finishes_alone(model_dir):
    from tetrad.inference.core.params import RequestFailed, SamplingParams

    llm = LLM(model_dir, block_size=4, num_blocks=96, log=None)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    healthy, broken = llm.add_request("Hello", params), llm.add_request("Hi", params)
    llm.step()  # both prefilled together, in one batch

    def fail(*_args, **_kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    llm.tracker.requests[broken].detokenizers[0].add = fail
    finals = {}
    while llm.has_unfinished():
        finals.update({o.request_id: o for o in llm.step() if o.finished})
    assert finals[broken].outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in finals[broken].error
    assert finals[healthy].error is None and len(finals[healthy].token_ids) == 5
    assert llm.block_manager.num_used_blocks == 0

    def broken_step(_plan):
        raise RuntimeError("device fault")

    llm._execute = broken_step
    with pytest.raises(RequestFailed, match="failed: RuntimeError: device fault"):
        llm.generate("Hey", params)


def test_metrics_are_read_on_the_engine_thread(guarded, monkeypatch):
    llm, port = guarded
    threads = []
    metrics_text = llm.metrics_text

    def recording():
        threads.append(threading.current_thread().name)
        return metrics_text()

    monkeypatch.setattr(llm, "metrics_text", recording)
    running = threading.Thread(target=call, args=(port, "/v1/completions", {
        "prompt": "Once", "max_tokens": 60, "ignore_eos": True}))
    running.start()
    statuses = [request(port, "GET", "/metrics")[0] for _ in range(30)]
    running.join()
    assert set(statuses) == {200} and set(threads) == {"tetrad-engine"}


def test_outputs_cross_threads_as_views_merged_for_a_slow_reader():
    from tetrad.inference.entrypoints.async_engine import OutputCollector

    output = RequestOutput("r", "p", list(range(3000)), [CompletionOutput(0)])
    views = []
    for step in range(50):
        completion = output.outputs[0]
        completion.delta_text, completion.delta_token_ids = "", []  # as the tracker does
        completion.token_ids += [step]
        completion.delta_token_ids += [step]
        completion.text += f"{step},"
        completion.delta_text += f"{step},"
        views.append(output.view())
    assert all(view.prompt_token_ids is output.prompt_token_ids for view in views)
    assert views[-1].outputs[0].token_ids == []  # an unfinished view carries only its delta

    async def collect():
        collector = OutputCollector()
        for view in views:  # a reader that takes nothing until the end
            collector.put(view)
        return collector.pending, await collector.get()

    pending, merged = asyncio.run(collect())
    assert pending is merged
    assert merged.outputs[0].delta_token_ids == list(range(50))
    assert merged.outputs[0].delta_text == "".join(f"{step}," for step in range(50))
