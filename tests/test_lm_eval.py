"""lm-evaluation-harness scores a multiple-choice task against `tetrad serve` through its
`local-completions` model (echo + logprobs), with the server's own tokenizer (/tokenize,
/tokenizer_info: lm-eval's "remote" tokenizer backend) behind an API key; the task and its data are
local files, nothing is downloaded. Each choice's log-likelihood equals the sum of a log-softmax of
the model's logits over the continuation, computed here by a plain forward pass."""

import json

import pytest
import torch
from serving import running, save_tiny_model

import tetrad
from tetrad.inference.engine import LLM

pytest.importorskip("uvicorn")
pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
KEY = "sk-eval"
QUESTIONS = [("The sky is", ["blue", "green", "loud"], 0),
             ("To be, or not to", ["be", "sing"], 0),
             ("One, two,", ["three", "cat", "x"], 2)]


def test_lm_eval_local_completions_scores_a_local_task(tmp_path, monkeypatch):
    # Offline for good: datasets and the hub read these when they are imported.
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its Bearer key
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from tetrad.inference.entrypoints.api import ServerConfig
    from tetrad.inference.entrypoints.server import build_app

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (tmp_path / "task.yaml").write_text(f"""task: tetrad_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    folder = tmp_path / "model"
    save_tiny_model(folder)
    llm = LLM(folder, block_size=4, num_blocks=128, log=None)
    with running(build_app(llm, "tiny", config=ServerConfig(api_key=KEY))) as port:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": "tiny",
                        "tokenizer_backend": "remote", "auth_token": KEY, "max_retries": 1,
                        "batch_size": 2},
            tasks=["tetrad_local_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True)

    model = tetrad.load_pretrained(folder).eval()
    tokenizer = llm.tokenizer
    expected_correct = []
    samples = sorted(results["samples"]["tetrad_local_choice"], key=lambda s: s["doc_id"])
    for sample, (question, choices, answer) in zip(samples, QUESTIONS):
        scores = []
        for choice, (loglikelihood, greedy) in zip(choices, sample["filtered_resps"]):
            # lm-eval puts the task's target delimiter, a space, before each choice.
            context, continuation = tokenizer.encode(question), tokenizer.encode(" " + choice)
            with torch.no_grad():
                logprobs = model(torch.tensor([context + continuation]))[0].log_softmax(-1)
            rows = logprobs[len(context) - 1:-1]
            expected = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
            assert loglikelihood == pytest.approx(expected.sum().item(), abs=1e-4)
            assert greedy == (rows.argmax(-1) == torch.tensor(continuation)).all().item()
            scores.append(expected.sum().item())
        expected_correct.append(float(max(range(len(choices)), key=scores.__getitem__) == answer))
    assert results["results"]["tetrad_local_choice"]["acc,none"] == pytest.approx(
        sum(expected_correct) / len(QUESTIONS))
