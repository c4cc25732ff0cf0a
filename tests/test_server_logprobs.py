"""Log-probabilities from `tetrad serve` (completions with logprobs and echo, chat with logprobs and
top_logprobs, streamed or not) equal a log-softmax of the model's own logits, computed here by a
plain forward pass over the whole sequence; prompt scores survive chunked prefill and the prefix
cache; /tokenize and /detokenize."""

import pytest
import torch
from serving import events, post, request, running, save_tiny_model

from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
import tetrad

pytest.importorskip("uvicorn")
TOL = 2e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tetrad.inference.entrypoints.server import build_app

    folder = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model(folder)
    # A 16-token budget splits longer prompts into chunks: prompt scores come from several steps.
    llm = LLM(folder, block_size=4, num_blocks=128, max_num_batched_tokens=16, log=None)
    model = tetrad.load_pretrained(folder).eval()
    with running(build_app(llm, "tiny")) as port:
        # Its own engine for the test's greedy runs: the server's steps on the server's thread.
        yield LLM(folder, block_size=4, num_blocks=128, log=None), model, port


def reference(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(next token | ids[:i + 1])."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


PROMPT = "To be, or not to be, that is the question"  # 42 tokens: three chunks


def test_completion_logprobs_and_echo(served):
    llm, model, port = served
    status, body = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                                  "temperature": 0, "logprobs": 3})
    assert status == 200
    choice = body["choices"][0]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    # The ids behind the token strings: greedy decoding in process gives the same tokens.
    generated = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    assert choice["logprobs"]["tokens"] == [llm.tokenizer.decode([t]) for t in generated]
    expected = reference(model, prompt_ids + generated)
    for step, (token, logprob, top) in enumerate(zip(
            generated, choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"])):
        row = expected[len(prompt_ids) + step - 1]
        assert logprob == pytest.approx(row[token].item(), abs=TOL)
        best = row.topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=TOL)
        assert logprob == pytest.approx(best.values[0].item(), abs=TOL)  # greedy: the best one
    assert choice["logprobs"]["text_offset"][0] == len(PROMPT)

    # echo with max_tokens 0 scores the prompt alone; asked twice (the second time its blocks are
    # in the prefix cache, which prompt scoring must not use) the answers agree.
    for _ in range(2):
        status, body = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0,
                                                      "echo": True, "logprobs": 1})
        assert status == 200 and body["usage"]["completion_tokens"] == 0
        echoed = body["choices"][0]
        assert echoed["text"] == PROMPT and echoed["finish_reason"] == "length"
        scores = echoed["logprobs"]["token_logprobs"]
        assert len(scores) == len(prompt_ids) and scores[0] is None
        assert echoed["logprobs"]["top_logprobs"][0] is None
        expected = reference(model, prompt_ids)
        assert scores[1:] == pytest.approx(
            [expected[i - 1, token].item() for i, token in enumerate(prompt_ids) if i], abs=TOL)
        assert echoed["logprobs"]["text_offset"][:3] == [0, 1, 2]

    # echo with a completion: prompt then generated tokens, as lm-evaluation-harness reads it.
    status, body = post(port, "/v1/completions", {"prompt": [prompt_ids, prompt_ids[:9]],
                                                  "max_tokens": 1, "echo": True, "logprobs": 1,
                                                  "temperature": 0})
    for choice, ids in zip(body["choices"], [prompt_ids, prompt_ids[:9]]):
        assert choice["text"].startswith(llm.tokenizer.decode(ids))
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        last = choice["logprobs"]["token_logprobs"][-1]
        assert last == pytest.approx(reference(model, ids)[-1].max().item(), abs=TOL)


def test_streamed_logprobs_match_the_whole_answer(served):
    _, _, port = served
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    whole = post(port, "/v1/completions", body)[1]["choices"][0]["logprobs"]
    chunks = events(port, "/v1/completions", body)
    assert chunks[-1] == "[DONE]"
    pieces = [chunk["choices"][0]["logprobs"] for chunk in chunks[:-1]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [item for piece in pieces for item in piece[key]] == whole[key], key


def test_chat_logprobs(served):
    llm, model, port = served
    from tetrad.inference.entrypoints.chat import ChatFormatter

    messages = [{"role": "user", "content": "Say something"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 4, "n": 2}
    status, answer = post(port, "/v1/chat/completions", body)
    assert status == 200 and len(answer["choices"]) == 2
    prompt = ChatFormatter().render(messages)
    prompt_ids = llm.tokenizer.encode(prompt)
    greedy = SamplingParams(temperature=0, max_tokens=5, stop=ChatFormatter().stop)
    ids = prompt_ids + llm.generate(prompt, greedy)[0].token_ids
    expected = reference(model, ids)
    for choice in answer["choices"]:
        content = choice["logprobs"]["content"]
        assert [bytes(entry["bytes"]).decode() for entry in content] == [
            llm.tokenizer.decode([token]) for token in ids[len(prompt_ids):]]
        for step, entry in enumerate(content):
            row = expected[len(prompt_ids) + step - 1]
            assert entry["logprob"] == pytest.approx(row[ids[len(prompt_ids) + step]].item(),
                                                     abs=TOL)
            assert [rival["logprob"] for rival in entry["top_logprobs"]] == pytest.approx(
                row.topk(4).values.tolist(), abs=TOL)
    streamed = events(port, "/v1/chat/completions", body)
    scores = [entry["logprob"] for chunk in streamed[:-1] if chunk["choices"][0]["index"] == 0
              and chunk["choices"][0]["logprobs"]
              for entry in chunk["choices"][0]["logprobs"]["content"]]
    assert scores == [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert post(port, "/v1/chat/completions", {"messages": messages, "top_logprobs": 2})[0] == 400
    assert post(port, "/v1/completions", {"prompt": "Hi", "logprobs": 21})[0] == 400
    status, answer = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    assert status == 400 and "max_tokens" in answer["error"]["message"]


def test_tokenize_endpoints(served):
    llm, _, port = served
    status, answer = post(port, "/tokenize", {"prompt": "Hello"})
    assert status == 200 and answer["tokens"] == llm.tokenizer.encode("Hello")
    assert post(port, "/detokenize", {"tokens": answer["tokens"]})[1] == {"prompt": "Hello"}
    assert post(port, "/detokenize", {"tokens": [10**6]})[0] == 400
    status, info, _ = request(port, "GET", "/tokenizer_info")
    assert status == 200 and "eos_token" in info
