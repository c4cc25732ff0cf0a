"""The model store and the Modelfile against a careless user and an attacker: nothing written
through a hardlink, concurrent creates of one name, corrupt store contents, hostile names,
Modelfiles and source folders. Each case checks the documented answer: exit status 2 and one
line with the message's key words, or success and the exact files."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.inference.entrypoints.api import ServerConfig
from tetrad.spec.presets import resolve_model
from tetrad.store.models import MANIFEST, ModelStore, resolve_model_argument

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 128  # the source folder's max_position_embeddings
HF_CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": CONTEXT}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


@pytest.fixture
def src(tmp_path):
    """An HF-shaped folder with a chat template and a tokenizer config of its own."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def create(tmp_path, text: str | bytes, name: str = "m") -> tuple[int, str]:
    """`tetrad create NAME -f Modelfile` with `text` as the Modelfile: (status, stderr)."""
    modelfile = tmp_path / "Modelfile"
    modelfile.write_bytes(text if isinstance(text, bytes) else text.encode())
    return run_cli(["create", name, "-f", str(modelfile)])


def run_cli(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    return status, err.getvalue()


def one_line_error(status: int, err: str, *words: str) -> None:
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


# -- never write through a link ------------------------------------------------------------------

def test_a_template_system_and_parameters_never_change_the_source_or_other_models(tmp_path, src):
    before = contents(src)
    assert create(tmp_path, "FROM ./src\n", "a") == (0, "")
    a = ModelStore().require("a").folder
    a_before = contents(a)
    assert (a / "chat_template.jinja").stat().st_ino == (src / "chat_template.jinja").stat().st_ino
    assert create(tmp_path, 'FROM ./src\nTEMPLATE """HIJACKED"""\nSYSTEM evil\n'
                            'PARAMETER temperature 0.5\nPARAMETER stop x\n', "b") == (0, "")
    assert create(tmp_path, 'FROM a\nTEMPLATE """AGAIN"""\n', "c") == (0, "")
    assert contents(src) == before
    assert contents(a) == a_before
    b = ModelStore().require("b")
    assert (b.folder / "chat_template.jinja").read_text() == "HIJACKED"
    assert (b.system, b.parameters) == ("evil", {"temperature": 0.5, "stop": ["x"]})
    assert (ModelStore().require("c").folder / "chat_template.jinja").read_text() == "AGAIN"
    # The files the Modelfile does not touch are still shared, not copied.
    assert (b.folder / "model.safetensors").stat().st_ino == \
        (src / "model.safetensors").stat().st_ino


def test_a_source_file_that_links_outside_is_stored_as_its_content_and_never_written(tmp_path,
                                                                                     src):
    outside = tmp_path / "outside.jinja"
    outside.write_text("{{ outside }}")
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").symlink_to(outside)
    assert create(tmp_path, 'FROM ./src\n', "plain") == (0, "")
    assert create(tmp_path, 'FROM ./src\nTEMPLATE """HIJACKED"""\n', "templated") == (0, "")
    assert outside.read_text() == "{{ outside }}"
    plain = ModelStore().require("plain").folder / "chat_template.jinja"
    assert not plain.is_symlink() and plain.read_text() == "{{ outside }}"
    templated = ModelStore().require("templated").folder / "chat_template.jinja"
    assert templated.read_text() == "HIJACKED"


def test_a_model_recreated_from_its_own_folder_replaces_itself(tmp_path, src):
    assert create(tmp_path, "FROM ./src\n", "self") == (0, "")
    folder = ModelStore().require("self").folder
    assert create(tmp_path, f'FROM {folder}\nTEMPLATE """NEW"""\n', "self") == (0, "")
    assert (ModelStore().require("self").folder / "chat_template.jinja").read_text() == "NEW"
    assert (src / "chat_template.jinja").read_text() == "{{ messages[0].content }}"
    assert not [p for p in ModelStore().root.iterdir() if p.name.startswith(".tmp")]
    one_line_error(*create(tmp_path, f"FROM {ModelStore().root}\n", "store"),
                   "is not a model folder")


# -- concurrent creates of one name --------------------------------------------------------------

def test_eight_concurrent_creates_of_one_name_each_succeed_and_the_last_is_whole(tmp_path, src):
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "TETRAD_HOME": str(tmp_path / "home")}
    processes = []
    for writer in range(8):
        modelfile = tmp_path / f"Modelfile{writer}"
        modelfile.write_text(f'FROM ./src\nSYSTEM writer {writer}\nTEMPLATE """template {writer}"""'
                             f'\nPARAMETER seed {writer}\n')
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tetrad", "create", "same", "-f", str(modelfile)],
            env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0 and err == "", err
        assert out.startswith("created same:latest (")
    model = ModelStore().require("same")
    writer = int(model.system.split()[1])
    assert (model.folder / "chat_template.jinja").read_text() == f"template {writer}"
    assert model.parameters == {"seed": writer}
    assert contents(model.folder)["model.safetensors"] == b"weights"
    assert sorted(contents(model.folder)) == sorted([*contents(src), MANIFEST])
    assert [m.name for m in ModelStore().list()] == ["same:latest"]
    assert not [p for p in ModelStore().root.iterdir() if p.name.startswith(".tmp")]


# -- corrupt store contents ----------------------------------------------------------------------

def corrupt_manifest(manifest: Path, how: str) -> None:
    good = json.loads(manifest.read_text())
    changes = {
        "a list": b"[1, 2]",
        "a number": b"5",
        "binary bytes": bytes(range(256)),
        "invalid UTF-8": b'{"name": "\xff\xfe"}',
        "100k-deep JSON": b"[" * 100_000,
        "missing keys": b"{}",
        "a name escaping the store": json.dumps({**good, "name": "../../../etc"}).encode(),
        "a system message that is a number": json.dumps({**good, "system": 5}).encode(),
        "an infinite temperature": json.dumps({**good, "parameters": {"temperature": 1e999}}
                                              ).encode(),
        "num_predict 1e26": json.dumps({**good, "parameters": {"max_tokens": 10**26}}).encode(),
        "num_predict past the context": json.dumps(
            {**good, "parameters": {"max_tokens": CONTEXT}}).encode(),
        "1000 stop strings": json.dumps({**good, "parameters": {"stop": ["s"] * 1000}}).encode(),
        "an unknown parameter": json.dumps({**good, "parameters": {"min_p": 0.1}}).encode(),
    }
    if how in changes:
        manifest.write_bytes(changes[how])
    elif how == "a config.json holding a list":
        config = manifest.parent / "config.json"
        config.unlink()  # a hardlink to the source's: replaced, not written through
        config.write_text("[1, 2]")
    elif how == "a template it does not have":
        manifest.write_text(json.dumps({**good, "template": True}))
        (manifest.parent / "chat_template.jinja").unlink()
    elif how == "no manifest":
        manifest.unlink()
    elif how == "a manifest that is a folder":
        manifest.unlink()
        manifest.mkdir()
    elif how == "a manifest linked to a device":
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
    else:
        raise AssertionError(how)


CORRUPTIONS = [
    ("a list", "holds a list, not an object"),
    ("a number", "holds a int, not an object"),
    ("binary bytes", f"{MANIFEST} is not JSON"),
    ("invalid UTF-8", f"{MANIFEST} is not JSON"),
    ("100k-deep JSON", f"{MANIFEST} is not JSON"),
    ("missing keys", "lacks 'name'"),
    ("a name escaping the store", "says it is '../../../etc'"),
    ("a system message that is a number", "system is a int"),
    ("an infinite temperature", "temperature must be a finite number >= 0, got inf"),
    ("num_predict 1e26", "PARAMETER num_predict: must fit in 64 bits"),
    ("num_predict past the context", f"use at most {CONTEXT - 1}"),
    ("1000 stop strings", f"1000 stop strings, at most {ServerConfig().max_stop_strings}"),
    ("an unknown parameter", "'min_p' is not one tetrad uses"),
    ("a template it does not have", "lacks the chat_template.jinja"),
    ("a config.json holding a list", "config.json must hold one JSON object"),
    ("no manifest", f"has no {MANIFEST}"),
    ("a manifest that is a folder", "is not a plain file"),
    ("a manifest linked to a device", "is not a plain file"),
]


@pytest.mark.parametrize("how, words", CORRUPTIONS, ids=[how for how, _ in CORRUPTIONS])
def test_a_corrupt_manifest_is_one_line_everywhere_and_the_healthy_models_still_list(
        tmp_path, src, capsys, how, words):
    assert create(tmp_path, "FROM ./src\n", "good") == (0, "")
    assert create(tmp_path, "FROM ./src\nSYSTEM s\n", "bad") == (0, "")
    corrupt_manifest(ModelStore().folder("bad") / MANIFEST, how)
    assert main(["list"]) == 0
    listed = capsys.readouterr()
    assert [line.split()[0] for line in listed.out.splitlines()] == ["NAME", "good:latest"]
    problem = listed.err.strip()
    assert len(problem.splitlines()) == 1 and problem.startswith(
        "tetrad list: stored model bad:latest is broken (") and words in problem, problem
    assert "tetrad rm bad:latest" in problem
    for argv in (["show", "bad"], ["generate", "bad", "--prompt", "x"],
                 ["export", "bad", "--out", str(tmp_path / "out")]):
        one_line_error(*run_cli(argv), "stored model bad:latest is broken", words)
    with pytest.raises(ConfigError, match="is broken"):
        resolve_model_argument("bad")  # what serve, run and generate load by
    one_line_error(*create(tmp_path, "FROM bad\n", "child"), "is broken")
    assert run_cli(["rm", "bad"]) == (0, "")
    assert [m.name for m in ModelStore().list()] == ["good:latest"]


def test_a_stored_template_that_is_not_text_is_one_line(tmp_path, src):
    assert create(tmp_path, 'FROM ./src\nTEMPLATE """{{ messages }}"""\n') == (0, "")
    template = ModelStore().folder("m") / "chat_template.jinja"
    template.write_bytes(bytes(range(256)))  # written fresh by create: no other file shares it
    one_line_error(*run_cli(["show", "m", "--modelfile"]), "stored model m:latest is broken",
                   "chat_template.jinja")


def test_a_model_folder_that_is_a_link_or_badly_named_is_reported_not_followed(tmp_path, src,
                                                                                capsys):
    assert create(tmp_path, "FROM ./src\n", "good") == (0, "")
    library = ModelStore().root / "library"
    (library / "linked").mkdir()
    (library / "linked" / "latest").symlink_to(ModelStore().folder("good"))
    (library / "Bad Name" / "latest").mkdir(parents=True)
    assert main(["list"]) == 0
    listed = capsys.readouterr()
    assert [line.split()[0] for line in listed.out.splitlines()] == ["NAME", "good:latest"]
    problems = listed.err.strip().splitlines()
    assert len(problems) == 2
    assert "'library/Bad Name:latest' is not a model name" in problems[0]
    assert "linked:latest is broken" in problems[1] and "is a link or a file" in problems[1]
    assert run_cli(["rm", "linked"]) == (0, "")
    assert ModelStore().require("good").folder.is_dir()  # the link went, not what it named


@pytest.mark.parametrize("name", ["../x", "a/b/c", "x/../y", "", "/etc/passwd", "a" * 100_000,
                                  "name:tag:more", "UPPER CASE"])
def test_a_bad_name_is_refused_before_any_work(tmp_path, src, name):
    status, err = create(tmp_path, "FROM ./src\n", name)
    one_line_error(status, err, "is not a model name")
    assert len(err) < 400  # an absurdly long name is not echoed whole
    assert not ModelStore().root.exists() or not any(ModelStore().root.glob("*/*/*"))
    one_line_error(*run_cli(["rm", name]), "is not a model name")
    one_line_error(*run_cli(["show", name]), "is not a model name")


# -- Modelfile nonsense --------------------------------------------------------------------------

LIMIT = ServerConfig().max_stop_strings
NONSENSE = [
    ("PARAMETER stop s\n" * 1000, LIMIT + 2, f"{LIMIT + 1} stop strings, at most {LIMIT}"),
    ("PARAMETER num_predict 100000000000000000000000000\n", 2, "must fit in 64 bits"),
    ("PARAMETER num_predict 1e26\n", 2, "needs an integer"),
    ("PARAMETER num_predict 500\n", 2, f"use at most {CONTEXT - 1}"),
    ("PARAMETER num_ctx 32\nPARAMETER num_predict 32\n", 3, "in a context of 32 tokens"),
    ("PARAMETER num_ctx 100000\n", 2, f"exceeds the model's context length {CONTEXT}"),
    ("PARAMETER num_ctx 0\n", 2, "must be 1 or more"),
    ("PARAMETER num_ctx -5\n", 2, "must be 1 or more"),
    ("PARAMETER temperature nan\n", 2, "temperature must be a finite number >= 0, got nan"),
    ("PARAMETER temperature inf\n", 2, "temperature must be a finite number >= 0, got inf"),
    ("PARAMETER temperature 1e400\n", 2, "temperature must be a finite number >= 0, got inf"),
    ("PARAMETER temperature -1\n", 2, ">= 0, got -1.0"),
    ("PARAMETER top_p nan\n", 2, "top_p must be a finite number in (0, 1], got nan"),
    ("PARAMETER top_p 0\n", 2, "in (0, 1], got 0.0"),
    ("PARAMETER top_p 1.5\n", 2, "in (0, 1], got 1.5"),
    ("PARAMETER top_k -1\n", 2, ">= 0 (0 means off), got -1"),
    ("PARAMETER top_k 1e3\n", 2, "needs an integer"),
    ("PARAMETER top_k 99999999999999999999\n", 2, "must fit in 64 bits"),
    ("PARAMETER repeat_penalty 0\n", 2, "> 0 (1 means off), got 0.0"),
    ("PARAMETER repeat_penalty -inf\n", 2, "a finite number > 0 (1 means off), got -inf"),
    ("PARAMETER repeat_penalty Infinity\n", 2, "a finite number > 0 (1 means off), got inf"),
    ("PARAMETER seed 1.5\n", 2, "needs an integer"),
    ("PARAMETER seed 1e23\n", 2, "needs an integer"),
    ("PARAMETER seed -99999999999999999999\n", 2, "must fit in 64 bits"),
    ("PARAMETER mirostat 1\n", 2, "mirostat is not one tetrad uses"),
    ("PARAMETER stop\n", 2, "stop must be a non-empty string"),
]


@pytest.mark.parametrize("lines, line, words", NONSENSE)
def test_modelfile_nonsense_is_refused_naming_its_line(tmp_path, src, lines, line, words):
    one_line_error(*create(tmp_path, "FROM ./src\n" + lines), f"Modelfile:{line}: ", words)
    assert not ModelStore().root.exists() or not any(ModelStore().root.glob("*/*/*"))


@pytest.mark.parametrize("text, words", [
    (b"FROM ./src\n" + bytes(range(128, 256)), "not UTF-8 text (byte 11)"),
    (b"FROM ./src\nSYSTEM a\x00b\n", "holds NUL bytes"),
    ('FROM ./src\nTEMPLATE """' + "x" * 10 * 2**20 + '"""\n', "more than a Modelfile's 1 MiB"),
    ("FROM ./src\n" + "# comment\n" * 200_000, "more than a Modelfile's 1 MiB"),
    ("FROM ./nowhere\n", "FROM ./nowhere: no such folder"),
    ("FROM ../../../../../../../etc\n", "is not a model folder"),
    ("FROM nobody:latest\n", "no stored model of that name"),
    ("SYSTEM no source\n", "no FROM line"),
])
def test_a_hostile_modelfile_or_source_is_one_line(tmp_path, src, text, words):
    one_line_error(*create(tmp_path, text), words)
    assert not ModelStore().root.exists() or not any(ModelStore().root.glob("*/*/*"))


def test_a_modelfile_that_is_not_a_readable_file_is_one_line(tmp_path):
    one_line_error(*run_cli(["create", "m", "-f", str(tmp_path)]), "is not a file")
    one_line_error(*run_cli(["create", "m", "-f", "/dev/zero"]), "is not a file")
    one_line_error(*run_cli(["create", "m", "-f", str(tmp_path / "none")]), "does not exist")


def write_checkpoint(folder: Path, index: object) -> None:
    """A tetrad checkpoint folder whose index.json is `index`."""
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps(dataclasses.asdict(resolve_model("tiny"))))
    (folder / "index.json").write_text(json.dumps(index))
    (folder / "shard_00000.safetensors").write_bytes(b"")


@pytest.mark.parametrize("index, words", [
    ([1, 2], "is not a checkpoint index"),
    ({"pieces": [{"file": 5, "kind": "model", "key": "k"}]}, "is not a checkpoint index"),
    ({"pieces": [{"file": "../victim.safetensors", "kind": "model", "key": "k"}]},
     "names '../victim.safetensors', which is not a file in"),
    ({"pieces": [{"file": "/etc/passwd", "kind": "model", "key": "k"}]},
     "names '/etc/passwd', which is not a file in"),
    ({"pieces": [{"file": "missing.safetensors", "kind": "model", "key": "k"}]},
     "names 'missing.safetensors', which is not a file in"),
])
def test_a_checkpoint_index_naming_files_outside_its_folder_is_refused(tmp_path, index, words):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not yours")
    write_checkpoint(tmp_path / "ckpt", index)
    one_line_error(*create(tmp_path, "FROM ./ckpt\n"), words)
    assert victim.read_bytes() == b"not yours"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("victim")] == [victim.name]
    assert not any(ModelStore().root.glob("*/*/*"))


def test_export_never_writes_into_the_store_or_through_a_hardlink(tmp_path):
    from serving import save_tiny_model

    save_tiny_model(tmp_path / "real")
    assert create(tmp_path, "FROM ./real\n", "a") == (0, "")
    stored = ModelStore().require("a").folder
    before = contents(stored)
    for out in (stored, ModelStore().root / "new"):
        one_line_error(*run_cli(["export", "a", "--out", str(out), "--dtype", "bf16"]),
                       "is inside the model store")
    one_line_error(*run_cli(["export", "a", "--out", str(tmp_path / "real"), "--dtype", "bf16"]),
                   "holds config.json, a file hardlinked elsewhere")
    assert contents(stored) == before
    assert run_cli(["export", "a", "--out", str(tmp_path / "fresh"), "--dtype", "bf16"])[0] == 0
    assert contents(stored) == before


def test_a_store_that_cannot_be_written_is_one_line_and_keeps_the_model_it_had(
        tmp_path, src, home, monkeypatch):
    assert create(tmp_path, "FROM ./src\nSYSTEM one\n") == (0, "")
    rename = Path.rename
    failures = []

    def full_disk_on_the_swap(self, target):
        if Path(target).name == "latest" and not failures:
            failures.append(self)
            raise OSError(28, "No space left on device")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", full_disk_on_the_swap)
    one_line_error(*create(tmp_path, "FROM ./src\nSYSTEM two\n"),
                   "storing m:latest in", "No space left on device")
    monkeypatch.setattr(Path, "rename", rename)
    assert ModelStore().require("m").system == "one"
    assert not [p for p in ModelStore().root.iterdir() if p.name.startswith(".tmp")]
    (home / "models").rename(home / "elsewhere")
    (home / "models").write_text("a file where the store should be")
    one_line_error(*create(tmp_path, "FROM ./src\n", "n"), "storing n:latest in", "File exists")
