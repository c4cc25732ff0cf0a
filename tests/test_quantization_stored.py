"""A model stored quantized (`tetrad create --quantize`, tetrad.models.quant_store) serves exactly
what `--quantization` computes at load from its 16-bit weights: the same held values, greedy
tokens and bytes (the planner's prediction), on every family with an HF form; its folder holds
no 16-bit projection; the load never builds the 16-bit projections it replaces; and what
cannot be done is refused in one line. tp=2 on a stored model: test_quantization_tp.py."""

import json
import weakref

import pytest
import torch
from safetensors import safe_open
from test_quantization import FAMILIES, GREEDY, PROMPTS, random_model

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.models import quant
from tetrad.models.fp8_weights import weight_bytes
from tetrad.models.hf import load_pretrained, save_hf
from tetrad.models.quant_store import (QUANTIZED_FILE, StoredProjections, quantize_folder,
                                       stored_quantization)
from tetrad.planner.serving import weight_bytes_per_gpu
from tetrad.spec.model import ModelConfig
from tetrad.spec.serving import ServeLayout
from tetrad.store.models import ModelStore
from tetrad.tokenizer import ByteTokenizer

# The families of test_quantization.py that have an HF form: its MoE's shared expert and dense
# layer have none (mixtral's has neither), so a mixtral-shaped one stands in.
STORABLE = {**{name: FAMILIES[name] for name in ("llama", "gpt2", "qwen", "mla")},
            "mixtral": ModelConfig(name="mixtral", vocab_size=256, hidden_size=256, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=64,
                                   ffn_hidden_size=256, max_seq_len=128, num_experts=4,
                                   num_experts_per_token=2, moe_ffn_hidden_size=256)}


def engine(folder, **settings) -> LLM:
    return LLM(folder, ByteTokenizer(), device="cpu", block_size=4, log=None, **settings)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("family, method", [("llama", "int8"), ("llama", "int4"),
                                            ("gpt2", "int4"), ("qwen", "int8"), ("mla", "int4"),
                                            ("mixtral", "int8")])
def test_a_stored_model_serves_what_quantizing_at_load_serves(tmp_path, family, method):
    config = STORABLE[family]
    save_hf(random_model(config), tmp_path / "bf16")
    (tmp_path / "stored").mkdir()
    quantize_folder(tmp_path / "bf16", tmp_path / "stored", method)
    assert stored_quantization(tmp_path / "stored") == method
    at_load = engine(tmp_path / "bf16", quantization=method)
    stored = engine(tmp_path / "stored")
    assert stored.config.quantization == method and stored.config.dtype == "bf16"
    held, expected = stored.model.state_dict(), at_load.model.state_dict()
    assert held.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name
    assert ([o.token_ids for o in stored.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in at_load.generate(PROMPTS, GREEDY)])
    assert weight_bytes(stored.model) == weight_bytes_per_gpu(config, ServeLayout(), method, 0)
    # The folder's 16-bit file has everything but the projections, which are quantized only.
    with safe_open(str(tmp_path / "stored" / "model.safetensors"), "pt") as file:
        sixteen_bit = set(file.keys())
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as file:
        everything = set(file.keys())
    with safe_open(str(tmp_path / "stored" / QUANTIZED_FILE), "pt") as file:
        quantized = {key.rpartition(".")[0] for key in file.keys()}
    assert sixteen_bit < everything and quantized == {
        name for name, module in at_load.model.named_modules()
        if type(module).__name__ in ("Int8Linear", "Int4Linear")}


def test_the_load_never_builds_the_projections_it_replaces(tmp_path, monkeypatch):
    """The stored projections' 16-bit weights stay on the meta device until swapped out: no
    memory holds them, at any point of the load."""
    save_hf(random_model(FAMILIES["llama"]), tmp_path / "bf16")
    (tmp_path / "stored").mkdir()
    quantize_folder(tmp_path / "bf16", tmp_path / "stored", "int4")
    model = load_pretrained(tmp_path / "stored", "cpu", torch.bfloat16)
    projections = {f"{name}.weight" for name in model.stored_quantized}
    params = dict(model.named_parameters())
    assert projections and all(params[name].is_meta for name in projections)
    assert not any(p.is_meta for name, p in params.items() if name not in projections)
    calibrations = []
    monkeypatch.setattr("tetrad.models.quant_model.calibrated_weights",
                        lambda *args, **kwargs: calibrations.append(1))
    engine(tmp_path / "stored")
    assert calibrations == []  # served from the stored values: GPTQ did not run again


def test_a_stored_int4_model_is_unpacked_one_projection_at_a_time(tmp_path, monkeypatch):
    """int4's levels take a byte each once unpacked, twice their stored bytes: the load unpacks
    each projection as its layer is built, never the whole model's at once."""
    save_hf(random_model(FAMILIES["llama"]), tmp_path / "bf16")
    (tmp_path / "stored").mkdir()
    quantize_folder(tmp_path / "bf16", tmp_path / "stored", "int4")
    unpacked, most_alive = [], []
    read, build = StoredProjections.__getitem__, quant.Int4Linear._build.__func__

    def tracked_read(self, name):
        weight = read(self, name)
        unpacked.append(weakref.ref(weight.values))
        return weight

    def counted_build(cls, *args, **kwargs):
        most_alive.append(sum(ref() is not None for ref in unpacked))
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(StoredProjections, "__getitem__", tracked_read)
    monkeypatch.setattr(quant.Int4Linear, "_build", classmethod(counted_build))
    engine(tmp_path / "stored")
    # qkv, out, gate/up and down of each layer, each unpacked and built once
    assert len(unpacked) == len(most_alive) == 4 * FAMILIES["llama"].num_layers
    assert max(most_alive) == 1


def test_create_quantize_stores_it_and_show_says_so(tmp_path, capsys):
    save_hf(random_model(FAMILIES["llama"]), tmp_path / "bf16")
    (tmp_path / "bf16" / "tokenizer_config.json").write_text("{}")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM ./bf16\nPARAMETER temperature 0.5\n")
    assert main(["create", "small:q4", "-f", str(modelfile), "-q", "int4"]) == 0
    assert "created small:q4" in capsys.readouterr().out
    stored = ModelStore().require("small:q4")
    assert stored.manifest["quantization"] == "int4"
    assert (stored.folder / "tokenizer_config.json").is_file()  # the other files come along
    assert json.loads((stored.folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored.size < sum(p.stat().st_size for p in (tmp_path / "bf16").iterdir())
    assert main(["show", "small:q4"]) == 0
    assert "quantized   int4" in capsys.readouterr().out
    # A model created FROM it keeps being the quantized one.
    modelfile.write_text("FROM small:q4\nPARAMETER temperature 0.9\n")
    assert main(["create", "small:warm", "-f", str(modelfile)]) == 0
    assert ModelStore().require("small:warm").manifest["quantization"] == "int4"
    assert engine(ModelStore().require("small:warm").folder).config.quantization == "int4"


def test_what_cannot_be_stored_or_served_quantized_is_refused_in_one_line(tmp_path, capsys):
    save_hf(random_model(FAMILIES["llama"]), tmp_path / "bf16")
    (tmp_path / "stored").mkdir()
    quantize_folder(tmp_path / "bf16", tmp_path / "stored", "int4")
    with pytest.raises(ConfigError, match="stored quantized to int4.*not --quantization int8"):
        engine(tmp_path / "stored", quantization="int8")
    (tmp_path / "stored" / QUANTIZED_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="is not a readable safetensors file"):
        engine(tmp_path / "stored")
    quantize_folder(tmp_path / "bf16", tmp_path / "stored", "int4")
    assert main(["export", str(tmp_path / "stored"), "--out", str(tmp_path / "out")]) == 2
    assert "has no HF form" in capsys.readouterr().err
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM ./stored\n")
    assert main(["create", "again", "-f", str(modelfile), "-q", "int8"]) == 2
    assert "stored quantized already" in capsys.readouterr().err
    (tmp_path / "gguf.gguf").write_bytes(b"GGUF" + bytes(60))
    modelfile.write_text("FROM ./gguf.gguf\n")
    assert main(["create", "again", "-f", str(modelfile), "-q", "int4"]) == 2
    assert "GGUF file" in capsys.readouterr().err
    assert ModelStore().list() == []
