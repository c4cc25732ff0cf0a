"""`tetrad serve` through the real openai client on 127.0.0.1 (completions, chat, streaming),
its 4xx answers, /metrics, freeing a disconnected client's blocks; `tetrad generate` and
`tetrad run`."""

import http.client
import io
import json
import socket
import time

import pytest
from serving import events, post, running, save_tiny_model

from tetrad.cli.main import main
from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
ENGINE = dict(block_size=4, num_blocks=96, log=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    from tetrad.inference.entrypoints.server import build_app

    llm = LLM(model_dir, **ENGINE)
    with running(build_app(llm, "tiny")) as port:
        yield llm, port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[1]}/v1", api_key="unused")


def test_completions_chat_and_streaming_through_the_openai_client(model_dir, client):
    expected = LLM(model_dir, **ENGINE).generate(
        "Hello", SamplingParams(temperature=0, max_tokens=10))[0]
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=10,
                                           temperature=0)
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.prompt_tokens == 5
    chunks = client.completions.create(model="tiny", prompt="Hello", max_tokens=10,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    batch = client.completions.create(model="tiny", prompt=["Hello", "Hi"], max_tokens=4, n=2,
                                      temperature=0)
    assert sorted(choice.index for choice in batch.choices) == [0, 1, 2, 3]

    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streamed_text_chunks_are_the_json_of_their_dicts():
    from tetrad.inference.entrypoints.http import ChunkEvents

    common = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": 'a "b"'}
    for text in ["", " plain", 'quo"te \\ back\nline\t', "é中😀\ufffd", "\x00\x1f"]:
        for reason in [None, "stop", "length"]:
            completion = {"index": 3, "text": text, "logprobs": None, "finish_reason": reason}
            expected = f"data: {json.dumps({**common, 'choices': [completion]})}\n\n".encode()
            assert ChunkEvents(common, chat=False).text_event(3, text, reason) == expected
            assert ChunkEvents(common, chat=False).event(completion) == expected
            chat = {**common, "object": "chat.completion.chunk"}
            delta = {"index": 1, "delta": {"content": text} if text else {}, "logprobs": None,
                     "finish_reason": reason}
            assert ChunkEvents(chat, chat=True).text_event(1, text, reason) == \
                f"data: {json.dumps({**chat, 'choices': [delta]})}\n\n".encode()


def test_a_streamed_batch_gives_each_choice_its_own_text(server):
    _, port = server
    body = {"prompt": ["Hello", "Hi"], "max_tokens": 6, "n": 2, "temperature": 0}
    whole = {c["index"]: c["text"] for c in post(port, "/v1/completions", body)[1]["choices"]}
    streamed = {index: "" for index in whole}
    chunks = events(port, "/v1/completions", body)
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert streamed == whole and whole[0] != whole[2]  # the two prompts' answers differ


def test_stream_interval_merges_the_steps_between_events(model_dir, server):
    """--stream-interval 3: the first step's output at once, then every 3 steps with the
    steps' tokens merged, and the end; through the server, the text is every step's."""
    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.async_engine import Subscriber
    from tetrad.inference.core.output import CompletionOutput, RequestOutput
    from tetrad.inference.entrypoints.server import build_app

    subscriber = Subscriber(loop=None, collector=None, every_step=True)
    handed = []
    for step in range(1, 11):
        output = RequestOutput("r", None, [], [CompletionOutput(
            0, delta_text=str(step), delta_token_ids=[step],
            finish_reason="length" if step == 10 else None)], finished=step == 10)
        taken = subscriber.take(output, interval=3)
        if taken is not None:
            handed.append((step, taken.outputs[0].delta_text, taken.outputs[0].delta_token_ids))
    assert handed == [(1, "1", [1]), (4, "234", [2, 3, 4]), (7, "567", [5, 6, 7]),
                      (10, "8910", [8, 9, 10])]
    not_streamed = Subscriber(loop=None, collector=None, every_step=False)  # the end only
    unfinished = RequestOutput("s", None, [], [CompletionOutput(0, delta_text="a")])
    assert not_streamed.take(unfinished, interval=1) is None
    assert not_streamed.take(output, interval=1).outputs[0].delta_text == "10"

    body = {"prompt": "Hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    every_step = events(server[1], "/v1/completions", body)
    llm = LLM(model_dir, **ENGINE)
    with running(build_app(llm, "tiny", config=ServerConfig(stream_interval=3))) as port:
        merged = events(port, "/v1/completions", body)

    def text(chunks):
        return "".join(chunk["choices"][0]["text"] for chunk in chunks[:-1])
    assert merged[-1] == every_step[-1] == "[DONE]"
    assert text(merged) == text(every_step)
    assert merged[-2]["choices"][0]["finish_reason"] == "length"
    assert len(merged) - 1 <= 4  # steps 1, 2-4, 5-7, 8-10 (a slow reader's are merged further)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    _, port = server
    status, body = post(port, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["message"]
    status, body = post(port, "/v1/completions", {"prompt": "Hi", "temperature": "hot"})
    assert status == 400 and "temperature" in body["error"]["message"]
    status, body = post(port, "/v1/completions", {"prompt": "Hi", "top_p": 7})
    assert status == 400 and "top_p" in body["error"]["message"]
    status, body = post(port, "/v1/completions", {"prompt": "x" * 200})
    assert status == 400 and "context length" in body["error"]["message"]
    status, body = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 500})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = post(port, "/v1/chat/completions", {"messages": [{"role": "robot"}]})
    assert status == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices


def wait_until_idle(llm):
    deadline = time.time() + 20
    while llm.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    assert not llm.has_unfinished() and llm.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(server, stream, monkeypatch):
    llm, port = server
    step = llm.step

    def slow_step():  # the tiny model would finish 120 tokens before the disconnect is seen
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    before = llm.metrics.num_generated_tokens
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({
        "prompt": "Once", "max_tokens": 120, "ignore_eos": True, "stream": stream,
        "temperature": 0.8}).encode(), {"Content-Type": "application/json"})
    if stream:
        assert connection.getresponse().readline().startswith(b"data: ")
    else:
        while not llm.has_unfinished():
            time.sleep(0.005)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_until_idle(llm)
    assert llm.metrics.num_generated_tokens - before < 120  # aborted, not run to the end


def test_metrics(server):
    _, port = server
    assert post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})[0] == 200
    metrics = http.client.HTTPConnection("127.0.0.1", port)
    metrics.request("GET", "/metrics")
    values = {}
    for line in metrics.getresponse().read().decode().splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["tetrad_time_to_first_token_seconds_count"] >= 1
    assert values["tetrad_time_per_output_token_seconds_count"] >= 1
    assert values["tetrad_generation_tokens_total"] >= 3
    assert values["tetrad_kv_blocks_total"] == 96 and values["tetrad_kv_blocks_used"] == 0
    for name in ("tetrad_running", "tetrad_waiting", "tetrad_swapped", "tetrad_preemptions_total",
                 "tetrad_generation_tokens_per_second", "tetrad_kv_utilization"):
        assert name in values


def test_generate_and_run_commands(model_dir, tmp_path, monkeypatch, capsys):
    report = tmp_path / "report.json"
    assert main(["generate", str(model_dir), "--prompt", "Hello", "--max-tokens", "6",
                 "--temperature", "0", "--num-blocks", "64", "--report", str(report)]) == 0
    expected = LLM(model_dir, **ENGINE).generate(
        "Hello", SamplingParams(temperature=0, max_tokens=6))[0].text
    out = capsys.readouterr()
    assert out.out == expected + "\n" and "KV cache: 64 blocks" in out.err
    summary = json.loads(report.read_text())["summary"]
    assert summary["generated_tokens"] == 6 and summary["kv_blocks_total"] == 64

    monkeypatch.setattr("sys.stdin", io.StringIO(
        "/set temperature 0\n/set max_tokens 5\n/set colour red\n/show\nHello\n/bye\nnever\n"))
    assert main(["run", str(model_dir), "--num-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "set temperature = 0" in out and "temperature=0.0" in out and "max_tokens=5" in out
    assert "cannot set 'colour'" in out
    assert main(["generate", str(model_dir), "--prompt", "x", "--preemption", "sideways"]) == 2
    assert "preemption must be one of" in capsys.readouterr().err
