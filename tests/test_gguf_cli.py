"""GGUF files through the commands: `tetrad create` with `FROM ./model.gguf` stores a model that
outlives the file and keeps its context, `tetrad run ./model.gguf` and `tetrad serve ./model.gguf`
chat in the file's template (a Modelfile TEMPLATE replaces it)."""

import io
import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_files import TEMPLATE, byte_level_values, hf_llama, write_gguf  # noqa: E402
from tetrad.cli.main import main  # noqa: E402
from tetrad.inference.entrypoints.template_sandbox import BoundedSandbox  # noqa: E402
from tetrad.tokenizer import BPETokenizer  # noqa: E402

MESSAGES = [{"role": "user", "content": "to be or not"}]


@pytest.fixture(scope="module")
def tokenizer():
    return BPETokenizer.train(["To be, or not to be, that is the question. " * 8] * 10, 300)


@pytest.fixture
def gguf_file(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    return write_gguf(tmp_path / "tiny-llama.gguf", hf_llama(tokenizer.vocab_size), "F32",
                      byte_level_values(tokenizer.tokenizer))


def rendered(template: str) -> str:
    return BoundedSandbox(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=MESSAGES, add_generation_prompt=True)


def test_create_from_a_gguf_file_stores_a_model_that_outlives_it(gguf_file, tmp_path, capsys):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM ./{gguf_file.name}\nPARAMETER num_ctx 64\n"
                         f"PARAMETER temperature 0\n")
    assert main(["create", "tiny:q", "-f", str(modelfile)]) == 0
    capsys.readouterr()
    gguf_file.unlink()  # the store holds its own link to the bytes
    assert main(["generate", "tiny:q", "--prompt", "To be", "--max-tokens", "4"]) == 0
    assert "4 tokens in" in capsys.readouterr().err
    assert main(["show", "tiny:q", "--modelfile"]) == 0
    assert "PARAMETER num_ctx 64" in capsys.readouterr().out


def test_create_checks_parameters_against_the_files_context(gguf_file, tmp_path, capsys):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM ./{gguf_file.name}\nPARAMETER num_ctx 4096\n")
    assert main(["create", "tiny:q", "-f", str(modelfile)]) == 2
    error = capsys.readouterr().err
    assert "Modelfile:2: PARAMETER num_ctx 4096 exceeds the model's context length 128" in error
    assert main(["list"]) == 0
    assert "tiny:q" not in capsys.readouterr().out


def chat_prompts(monkeypatch, argv, stdin="to be or not\n/bye\n"):
    """The prompts `tetrad run` sends the engine for `stdin`."""
    from tetrad.inference.engine import LLM

    prompts = []
    monkeypatch.setattr(LLM, "stream", lambda self, prompt, params: prompts.append(prompt)
                        or iter(()))
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(argv) == 0
    return prompts


def test_run_chats_in_the_files_template(gguf_file, monkeypatch):
    assert chat_prompts(monkeypatch, ["run", str(gguf_file)]) == [rendered(TEMPLATE)]


def test_a_modelfile_template_replaces_the_files(gguf_file, tmp_path, monkeypatch):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f'FROM ./{gguf_file.name}\nTEMPLATE """{template}"""\n')
    assert main(["create", "tiny:t", "-f", str(modelfile)]) == 0
    assert chat_prompts(monkeypatch, ["run", "tiny:t"]) == [rendered(template)]


def test_serve_chats_in_the_files_template(gguf_file, tokenizer, monkeypatch):
    from serving import request, running

    replies = []

    def listen(app, args, what):
        class Once:
            def run(self):
                with running(app) as port:
                    replies.append(request(port, "POST", "/v1/chat/completions", {
                        "model": what, "messages": MESSAGES, "max_tokens": 2}))
        return Once()

    monkeypatch.setattr("tetrad.cli.serve.listen", listen)
    assert main(["serve", str(gguf_file)]) == 0
    status, body, _ = replies[0]
    assert status == 200, json.dumps(body)
    assert body["model"] == "tiny-llama"
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered(TEMPLATE)))
