"""Ollama's Modelfile as tetrad reads it: every instruction, and one line naming the line at fault
for every kind of mistake (torch-free: the parser runs on the base install)."""

import pytest

from tetrad.cli.main import main
from tetrad.store.modelfile import ModelfileError, parse_modelfile, render_modelfile

FULL = '''# a pirate
from ./runs/ckpt
SYSTEM """You are
a pirate."""
Parameter temperature 0.2
PARAMETER top_p 0.9
PARAMETER top_k 20
PARAMETER repeat_penalty 1.1
PARAMETER seed 7
PARAMETER stop "User:"
PARAMETER stop <end>
PARAMETER num_predict 40
PARAMETER num_ctx 512
TEMPLATE "{% for m in messages %}{{ m.content }}{% endfor %}"
MESSAGE user Ahoy?
MESSAGE assistant Arr.
LICENSE """MIT"""
'''


def test_every_instruction_is_read_into_tetrads_settings():
    modelfile = parse_modelfile(FULL)
    assert modelfile.source == "./runs/ckpt"
    assert modelfile.system == "You are\na pirate."
    assert modelfile.parameters == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "seed": 7,
        "stop": ["User:", "<end>"], "max_tokens": 40, "max_model_len": 512}
    assert modelfile.template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert modelfile.messages == [{"role": "user", "content": "Ahoy?"},
                                  {"role": "assistant", "content": "Arr."}]
    assert modelfile.license == ["MIT"]


def test_a_rendered_modelfile_reads_back_to_the_same_settings():
    modelfile = parse_modelfile(FULL)
    text = render_modelfile(modelfile.source, modelfile.system, modelfile.template,
                            modelfile.parameters, modelfile.messages, modelfile.license)
    again = parse_modelfile(text)
    assert (again.source, again.system, again.template, again.parameters, again.messages,
            again.license) == (modelfile.source, modelfile.system, modelfile.template,
                               modelfile.parameters, modelfile.messages, modelfile.license)


def test_num_predict_minus_one_means_no_limit():
    assert parse_modelfile("FROM x\nPARAMETER num_predict -1\n").parameters == {
        "max_tokens": None}


BAD = [
    ("FROM x\nPARAMETR top_k 3\n", 2, "did you mean PARAMETER"),
    ("FROM x\n\n# c\nPARAMETER temprature 0.5\n", 4, "did you mean temperature"),
    ("FROM x\nPARAMETER min_p 0.1\n", 2, "min_p is not one tetrad uses"),
    ("FROM x\nPARAMETER temperature hot\n", 2, "needs a number, got 'hot'"),
    ("FROM x\nPARAMETER top_k 2.5\n", 2, "needs an integer"),
    ("FROM x\nPARAMETER top_p 1.5\n", 2, "top_p must be a finite number in (0, 1], got 1.5"),
    ("FROM x\nPARAMETER num_ctx 0\n", 2, "must be 1 or more"),
    ("FROM x\nSYSTEM hi\nTEMPLATE \"\"\"{{ .System }}\n{{ .Prompt }}\"\"\"\n", 3,
     "Ollama Go template"),
    ("FROM x\nTEMPLATE \"{% for m in messages %}\"\n", 2, "not valid Jinja"),
    ("FROM x\nSYSTEM \"\"\"never\nclosed\n", 2, "never closed"),
    ("FROM x\nFROM y\n", 2, "a second FROM"),
    ("FROM x\nADAPTER ./lora\n", 2, "ADAPTER (LoRA) is not supported"),
    ("FROM x\nMESSAGE robot hi\n", 2, "MESSAGE role 'robot'"),
    ("FROM\n", 1, "FROM needs an argument"),
]


@pytest.mark.parametrize("text, line, fragment", BAD)
def test_a_bad_modelfile_names_its_line(text, line, fragment):
    with pytest.raises(ModelfileError) as error:
        parse_modelfile(text)
    assert str(error.value).startswith(f"Modelfile:{line}: "), error.value
    assert fragment in str(error.value)


def test_a_modelfile_without_from_says_so():
    with pytest.raises(ModelfileError, match="no FROM line"):
        parse_modelfile("SYSTEM hi\n")


@pytest.mark.parametrize("text, line, fragment", BAD[:3])
def test_tetrad_create_turns_a_bad_modelfile_into_one_line(tmp_path, monkeypatch, capsys, text,
                                                          line, fragment):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    path = tmp_path / "Modelfile"
    path.write_text(text)
    assert main(["create", "m", "-f", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:{line}: " in err and fragment in err, err
    assert not (tmp_path / "home" / "models" / "m").exists()
