"""The local model store: create / list / show / rm, names, hardlinks, a checkpoint stored as its
parameters only, and stored names with their Modelfile defaults in generate / run / serve."""

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.inference.entrypoints.chat import ChatFormatter
from tetrad.inference.entrypoints.api import ChatRequest, CompletionRequest, ServerConfig
from tetrad.store.modelfile import ModelfileError, parse_modelfile
from tetrad.models.hf import load_pretrained
from tetrad.store.safetensors_subset import write_subset
from tetrad.store.models import MANIFEST, ModelStore, default_root, parse_name

TRAIN = ["train", "--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
         "--sample-tokens", "0"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def hf_folder(tmp_path):
    """An HF-shaped folder: the store copies files, it never loads them."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "pytorch_model.bin").write_bytes(b"a format tetrad does not read")
    (folder / ".gitattributes").write_text("")
    return folder


def create(folder, text: str, name: str = "pirate"):
    modelfile = parse_modelfile(text)
    modelfile.folder = folder
    return ModelStore().create(name, modelfile)


@pytest.mark.parametrize("name, full", [("pirate", "pirate:latest"), ("Pirate:V1", "pirate:v1"),
                                        ("me/pirate:7b-q.1", "me/pirate:7b-q.1"),
                                        ("library/pirate", "pirate:latest")])
def test_names_are_ollamas(name, full):
    assert parse_name(name) == full


@pytest.mark.parametrize("name", ["", "a b", "-x", "a:b:c", "a/b/c", "../x", "x:", "é", "a" * 65])
def test_bad_names_are_refused(name):
    with pytest.raises(ConfigError, match="is not a model name"):
        parse_name(name)


def test_the_store_lives_in_the_cache_unless_tetrad_home_says(home, monkeypatch, tmp_path):
    assert default_root() == home / "models"
    monkeypatch.delenv("TETRAD_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_root() == tmp_path / "cache" / "tetrad" / "models"


def test_create_hardlinks_the_model_files_and_survives_the_source(hf_folder, tmp_path):
    model = create(tmp_path, "FROM ./hf\nSYSTEM Arr.\nPARAMETER temperature 0.3\n")
    assert model.name == "pirate:latest"
    assert sorted(p.name for p in model.folder.iterdir()) == [
        "config.json", "model.safetensors", MANIFEST]
    assert (model.folder / "model.safetensors").stat().st_ino == \
        (hf_folder / "model.safetensors").stat().st_ino
    shutil.rmtree(hf_folder)
    again = ModelStore().require("pirate")
    assert (again.folder / "model.safetensors").read_bytes() == b"weights"
    assert (again.system, again.parameters) == ("Arr.", {"temperature": 0.3})


def test_from_a_stored_model_inherits_its_settings_and_overrides_some(hf_folder, tmp_path):
    create(tmp_path, "FROM ./hf\nSYSTEM Arr.\nPARAMETER temperature 0.3\nPARAMETER top_k 5\n"
                     "TEMPLATE {{ messages[0].content }}\n")
    child = create(tmp_path, "FROM pirate\nPARAMETER temperature 0.9\n", "pirate:hot")
    assert child.system == "Arr."
    assert child.parameters == {"temperature": 0.9, "top_k": 5}
    assert (child.folder / "chat_template.jinja").read_text() == "{{ messages[0].content }}"
    assert [m.name for m in ModelStore().list()] == ["pirate:hot", "pirate:latest"]


def test_no_name_holds_another_in_its_folder(hf_folder, tmp_path):
    create(tmp_path, "FROM ./hf\n", "me/pirate:v1")
    create(tmp_path, "FROM ./hf\n", "me:pirate")
    create(tmp_path, "FROM ./hf\n", "pirate")
    assert [m.name for m in ModelStore().list()] == ["me/pirate:v1", "me:pirate", "pirate:latest"]
    ModelStore().remove("me:pirate")
    assert [m.name for m in ModelStore().list()] == ["me/pirate:v1", "pirate:latest"]


def test_create_replaces_a_name_and_a_failed_create_leaves_the_store_as_it_was(hf_folder,
                                                                               tmp_path):
    create(tmp_path, "FROM ./hf\nSYSTEM one\n")
    create(tmp_path, "FROM ./hf\nSYSTEM two\n")
    assert ModelStore().require("pirate").system == "two"
    with pytest.raises(ModelfileError, match="no such folder .* and no stored model"):
        create(tmp_path, "FROM ./nowhere\n")
    with pytest.raises(ModelfileError, match="is not a model folder"):
        create(tmp_path, f"FROM {tmp_path}\n")
    assert [m.name for m in ModelStore().list()] == ["pirate:latest"]
    assert ModelStore().require("pirate").system == "two"
    assert not [p for p in ModelStore().root.iterdir() if p.name.startswith(".tmp")]


def test_list_show_and_rm_through_the_cli(hf_folder, tmp_path, capsys):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM ./hf\nSYSTEM Arr.\nPARAMETER num_ctx 64\nMESSAGE user Ahoy\n")
    assert main(["create", "me/pirate:v1", "-f", str(modelfile)]) == 0
    assert capsys.readouterr().out.startswith("created me/pirate:v1 (")
    assert main(["list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split() == ["NAME", "SIZE", "CREATED", "FROM"]
    assert listing[1].startswith("me/pirate:v1 ") and listing[1].endswith("./hf")
    assert main(["show", "me/pirate:v1"]) == 0
    shown = capsys.readouterr().out
    assert "2 layers, hidden 64, vocabulary 256" in shown and "max_model_len=64" in shown
    assert "'Arr.'" in shown and "user: Ahoy" in shown
    assert main(["show", "me/pirate:v1", "--modelfile"]) == 0
    recreated = parse_modelfile(capsys.readouterr().out)
    assert (recreated.system, recreated.parameters) == ("Arr.", {"max_model_len": 64})
    assert main(["rm", "me/pirate:v1", "nope"]) == 2  # all or nothing
    assert "no model named nope:latest" in capsys.readouterr().err
    assert main(["rm", "me/pirate:v1"]) == 0
    assert ModelStore().list() == [] and not (ModelStore().root / "me").exists()
    assert main(["show", "me/pirate:v1"]) == 2
    assert main(["generate", "nothing-here", "--prompt", "x"]) == 2
    assert "neither a folder nor a model" in capsys.readouterr().err


def test_a_safetensors_subset_keeps_the_named_tensors_byte_for_byte(tmp_path):
    tensors = {"model/a": torch.randn(3, 5), "exp_avg/a": torch.randn(3, 5),
               "model/b": torch.randn(7).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "all.safetensors", metadata={"format": "pt"})
    write_subset(tmp_path / "all.safetensors", tmp_path / "some.safetensors",
                 {"model/a", "model/b"})
    with safe_open(tmp_path / "some.safetensors", "pt") as file:
        assert sorted(file.keys()) == ["model/a", "model/b"]
        assert file.metadata() == {"format": "pt"}
        for key in file.keys():
            assert torch.equal(file.get_tensor(key), tensors[key])


def test_a_trained_model_is_stored_as_its_parameters_and_runs_by_name(
        tmp_path, corpus_file, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main([*TRAIN, "--data", corpus_file, "--checkpoint-dir", str(run),
                 "--save-as", "mine"]) == 0
    assert "stored as mine:latest" in capsys.readouterr().out
    stored = ModelStore().require("mine")
    trained, kept = load_pretrained(run), load_pretrained(stored.folder)
    for (name, a), (_, b) in zip(trained.named_parameters(), kept.named_parameters()):
        assert torch.equal(a, b), name
    # Only the parameters: the shard holds their bytes plus its header, no AdamW moments.
    shard = stored.folder / "shard_00000.safetensors"
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    assert shard.stat().st_size == 8 + header + sum(
        p.numel() * p.element_size() for p in trained.parameters())
    assert not (stored.folder / "training_state.pt").exists()
    from_root = create(tmp_path, f"FROM {run}\n", "from-root")  # a root leads to its latest step
    assert (from_root.folder / "shard_00000.safetensors").read_bytes() == shard.read_bytes()

    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM mine\nSYSTEM Be brief.\nPARAMETER temperature 0\n"
                         "PARAMETER num_predict 5\nPARAMETER num_ctx 64\nMESSAGE user hi\n")
    assert main(["create", "brief", "-f", str(modelfile)]) == 0
    capsys.readouterr()
    shutil.rmtree(run)  # the stored models no longer need the run
    assert main(["generate", "brief", "--prompt", "To be", "--num-blocks", "16"]) == 0
    by_name = capsys.readouterr()
    assert main(["generate", str(stored.folder), "--prompt", "To be", "--num-blocks", "16",
                 "--temperature", "0", "--max-tokens", "5", "--max-model-len", "64"]) == 0
    assert by_name.out == capsys.readouterr().out  # the Modelfile's PARAMETERs were the defaults
    assert "5 tokens" in by_name.err

    monkeypatch.setattr("sys.stdin", io.StringIO("/show\n/bye\n"))
    assert main(["run", "brief", "--num-blocks", "16"]) == 0
    shown = capsys.readouterr().out
    assert "context 64 tokens" in shown and "temperature=0.0" in shown
    assert "system: 'Be brief.'; 1 messages" in shown

    assert main(["export", "brief", "--out", str(tmp_path / "exported")]) == 0
    assert torch.equal(load_pretrained(tmp_path / "exported").embed.weight, kept.embed.weight)

    captured = {}
    monkeypatch.setattr("tetrad.inference.entrypoints.server.build_app",
                        lambda llm, name, chat, on_fatal, defaults, config: captured.update(
                            name=name, system=chat.system, defaults=defaults))
    monkeypatch.setattr("uvicorn.Server.run", lambda server: None)
    assert main(["serve", "brief", "--num-blocks", "16"]) == 0
    assert captured == {"name": "brief:latest", "system": "Be brief.",
                        "defaults": {"temperature": 0, "max_tokens": 5}}


def test_save_as_without_a_checkpoint_dir_leaves_only_the_stored_model(corpus_file, capsys):
    assert main([*TRAIN, "--data", corpus_file, "--save-as", "quick:v1"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint:" not in out and "stored as quick:v1" in out
    root = ModelStore().root
    assert [m.name for m in ModelStore().list()] == ["quick:v1"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert main([*TRAIN, "--data", corpus_file, "--save-as", "Bad Name"]) == 2
    assert "is not a model name" in capsys.readouterr().err


def test_a_run_whose_storing_fails_keeps_its_checkpoint_and_says_where(corpus_file, capsys,
                                                                      monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ModelStore, "create", full_disk)
    assert main([*TRAIN, "--data", corpus_file, "--save-as", "quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err.startswith("tetrad train: error: the run finished, but storing it as quick "
                          "failed ([Errno 28] No space left on device)"), err
    checkpoint = err.split("its checkpoint is ")[1].split(":")[0]
    assert (Path(checkpoint) / "model.json").is_file()


def test_save_as_under_torchrun_needs_a_shared_checkpoint_dir(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main([*TRAIN, "--save-as", "quick"]) == 2
    assert "needs --checkpoint-dir" in capsys.readouterr().err


def test_the_server_takes_modelfile_defaults_for_the_fields_a_request_leaves_out():
    defaults = {"temperature": 0.0, "max_tokens": 5, "stop": ("User:",), "top_k": 3}
    params = CompletionRequest(prompt="x", temperature=0.7).sampling_params(ServerConfig(),
                                                                     defaults=defaults)
    assert (params.temperature, params.max_tokens, params.stop, params.top_k) == (
        0.7, 5, ("User:",), 3)
    chat = ChatRequest(messages=[], stop=["END"], max_completion_tokens=9)
    chat.max_tokens = chat.max_completion_tokens
    params = chat.sampling_params(ServerConfig(), ("\nUser:",), defaults)
    assert (params.temperature, params.max_tokens, params.stop) == (0.0, 9, ("END", "\nUser:"))


def test_a_default_system_message_goes_first_unless_the_conversation_brings_one():
    chat = ChatFormatter(None, system="Be brief.")
    assert chat.render([{"role": "user", "content": "hi"}]) == \
        "System: Be brief.\nUser: hi\nAssistant:"
    assert chat.render([{"role": "system", "content": "Be long."},
                        {"role": "user", "content": "hi"}]) == \
        "System: Be long.\nUser: hi\nAssistant:"
