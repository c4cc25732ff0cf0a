"""HF interoperability: tiny random HF models load into tetrad with the same logits, tetrad
checkpoints export to folders transformers loads with the same logits, and bad inputs say what to
fix. Weights are randomized (biases and norms too) so that a swapped or dropped tensor shows."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig,  # noqa: E402
                          MixtralConfig, Qwen2Config)

from tetrad import load_hf_weights, load_pretrained  # noqa: E402
from tetrad.cli.main import main  # noqa: E402
from tetrad.spec.model import ModelConfig  # noqa: E402
from tetrad.errors import ConfigError  # noqa: E402
from tetrad.models.transformer import Transformer  # noqa: E402
from tetrad.spec.presets import preset  # noqa: E402
from tetrad.sharded_tensors import whole_pieces, write_index, write_pieces  # noqa: E402
from tetrad.tokenizer import BPETokenizer  # noqa: E402

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, rope_theta=5000.0, rms_norm_eps=1e-5)
GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32)

HF_CASES = {
    "llama": lambda: LlamaConfig(**LLAMA, num_key_value_heads=4),
    "llama-tied": lambda: LlamaConfig(**LLAMA, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-gqa": lambda: Qwen2Config(**LLAMA, num_key_value_heads=2),
    "qwen2-tied": lambda: Qwen2Config(**LLAMA, num_key_value_heads=1, tie_word_embeddings=True),
    "gpt2": lambda: GPT2Config(**GPT2),
    "gpt2-untied": lambda: GPT2Config(**GPT2, tie_word_embeddings=False),
    "mixtral": lambda: MixtralConfig(**LLAMA, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            is_norm_scale = param.dim() == 1 and "norm" in name or ".ln_" in name
            param.copy_(noise + 1.0 if is_norm_scale and name.endswith("weight") else noise)
    return model.eval()


def save_hf_model(config, folder, **save_args):
    model = randomize(AutoModelForCausalLM.from_config(config))
    model.save_pretrained(folder, **save_args)
    return model


def assert_same_logits(tetrad_model, hf_model):
    with torch.no_grad():
        ours, theirs = tetrad_model(TOKENS), hf_model(TOKENS).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", list(HF_CASES))
def test_load_pretrained_matches_hf_logits(case, tmp_path):
    hf_model = save_hf_model(HF_CASES[case](), tmp_path)
    model = load_pretrained(tmp_path)
    assert not model.training
    assert model.config.tie_embeddings == hf_model.config.tie_word_embeddings
    assert_same_logits(model, hf_model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_load_in_another_dtype_converts_a_slice_at_a_time_exactly(dtype, tmp_path, monkeypatch):
    """Loading an fp32 folder in 16 bits converts each tensor a few rows at a time (so its
    stored copy is never whole beside it): every parameter equals the fp32 load's, converted."""
    from tetrad.models import hf_weights

    save_hf_model(HF_CASES["llama"](), tmp_path)
    whole = load_pretrained(tmp_path)
    # A few rows a slice, the last one short: a slice left out would leave torch.empty's bytes.
    monkeypatch.setattr(hf_weights, "CONVERT_SLICE_BYTES", 3 * 4 * 64)
    converted = load_pretrained(tmp_path, dtype=dtype)
    for (name, expected), (same_name, got) in zip(whole.named_parameters(),
                                                  converted.named_parameters()):
        assert name == same_name and got.dtype == dtype
        assert torch.equal(got, expected.to(dtype)), name


def test_sharded_checkpoint(tmp_path):
    hf_model = save_hf_model(HF_CASES["qwen2-gqa"](), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_same_logits(load_pretrained(tmp_path), hf_model)


def test_gpt2_base_model_without_transformer_prefix(tmp_path):
    """Hub GPT-2 checkpoints are saved from the base model: wte.weight, h.0.attn.c_attn.weight."""
    hf_model = randomize(AutoModelForCausalLM.from_config(HF_CASES["gpt2"]()))
    hf_model.transformer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    assert_same_logits(load_pretrained(tmp_path), hf_model)


def write_checkpoint(model: Transformer, root, step="step_00000300", tokenizer=None):
    folder = root / step
    folder.mkdir(parents=True)
    (folder / "model.json").write_text(json.dumps(model.config.to_dict()))
    params = {name: param.detach() for name, param in model.named_parameters()}
    write_index(folder, write_pieces(folder, 0, whole_pieces("model", params)))
    (root / "latest").write_text(step + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


GPT2_LIKE = ModelConfig(name="g", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                        ffn_hidden_size=256, max_seq_len=32, norm="layernorm", position="learned",
                        mlp="gelu", bias=True, tie_embeddings=True)
EXPORT_CASES = {
    "llama": (preset("tiny"), "LlamaForCausalLM"),
    "qwen2-tied": (preset("tiny").replace(qkv_bias=True, tie_embeddings=True),
                   "Qwen2ForCausalLM"),
    "gpt2": (GPT2_LIKE, "GPT2LMHeadModel"),
    "mixtral": (preset("tiny").replace(num_experts=4, num_experts_per_token=2),
                "MixtralForCausalLM"),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_round_trip(case, tmp_path):
    config, architecture = EXPORT_CASES[case]
    model = randomize(Transformer(config), seed=1)
    write_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == architecture
    assert_same_logits(model, hf_model)
    back = load_pretrained(out).state_dict()
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[name], value) for name, value in model.state_dict().items())
    assert not (out / "tokenizer.json").exists()  # byte-level: nothing to export


def test_export_copies_bpe_tokenizer(tmp_path):
    tokenizer = BPETokenizer.train(["hello world, hello tetrad"] * 20, vocab_size=280)
    model = randomize(Transformer(preset("tiny").replace(vocab_size=tokenizer.vocab_size)))
    write_checkpoint(model, tmp_path / "ckpt", tokenizer=tokenizer)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "hello tetrad world"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)
    assert hf_tokenizer.eos_token_id == tokenizer.eos_id
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_id


def test_export_refuses_models_without_hf_form(tmp_path, capsys):
    write_checkpoint(Transformer(preset("tiny-moe")), tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    assert "num_shared_experts = 0" in capsys.readouterr().err


def test_load_hf_weights_into_existing_model(tmp_path):
    hf_model = save_hf_model(HF_CASES["llama"](), tmp_path)
    model = load_pretrained(tmp_path)
    fresh = Transformer(model.config).eval()
    load_hf_weights(fresh, tmp_path)
    assert_same_logits(fresh, hf_model)
    wrong = Transformer(model.config.replace(num_layers=1))
    with pytest.raises(ConfigError, match="does not use"):
        load_hf_weights(wrong, tmp_path)
    wrong = Transformer(model.config.replace(ffn_hidden_size=128))
    with pytest.raises(ConfigError, match=r"expects shape \(256, 64\)"):
        load_hf_weights(wrong, tmp_path)


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_bad_inputs_raise_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        load_pretrained(tmp_path / "missing")
    with pytest.raises(ConfigError, match="neither config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConfigError, match="'bert' is not supported"):
        load_pretrained(tmp_path / "bert")

    folder = tmp_path / "llama"
    save_hf_model(HF_CASES["llama"](), folder)
    edit_config(folder, intermediate_size=80)
    with pytest.raises(ConfigError, match=r"layers.0.mlp.up.weight: the model expects shape "
                                          r"\(160, 64\) but .* gives \(192, 64\)"):
        load_pretrained(folder)
    edit_config(folder, intermediate_size=96, rope_parameters={"rope_type": "llama3"})
    with pytest.raises(ConfigError, match="rope scaling 'llama3'"):
        load_pretrained(folder)
    (folder / "model.safetensors").unlink()
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    with pytest.raises(ConfigError, match="no weights to load"):
        load_pretrained(folder)


def test_bad_checkpoints_raise_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        (tmp_path / "latest").write_text("step_00000001")
        load_pretrained(tmp_path)
    folder = write_checkpoint(Transformer(preset("tiny")), tmp_path / "ckpt")
    (folder / "model.json").write_text(json.dumps(preset("tiny").replace(
        ffn_hidden_size=64).to_dict()))
    with pytest.raises(ConfigError, match="layers.0.mlp.up.weight: the model expects shape"):
        load_pretrained(tmp_path / "ckpt")
    (folder / "model.json").write_text(json.dumps(preset("tiny").replace(
        tie_embeddings=True).to_dict()))
    with pytest.raises(ConfigError, match="does not match its model.json"):
        load_pretrained(folder)


def test_sliding_window_caps_max_seq_len():
    from tetrad.spec.hf import model_config_from_hf
    hf = dict(LLAMA, model_type="mistral", sliding_window=8, max_position_embeddings=64)
    assert model_config_from_hf(hf).max_seq_len == 8
    hf.update(model_type="qwen2", use_sliding_window=False)
    assert model_config_from_hf(hf).max_seq_len == 64


def test_import_tetrad_stays_torch_free():
    code = ("import sys, tetrad, tetrad.tokenizer, tetrad.text_sources, tetrad.spec.hf; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert callable(tetrad.load_pretrained); assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name, content, words", [
    ("model.json", b"\xff\xfe", "is not a tetrad model description"),
    ("model.json", b"[1, 2]", "must be a table of names and values, not a list"),
    ("model.safetensors.index.json", b"{", "is not a safetensors index"),
    ("model.safetensors.index.json", b'{"weight_map": []}', "must map tensor names"),
    ("model.safetensors.index.json", b'{"weight_map": {"a": "../../etc/passwd"}}',
     "must map tensor names to file names in its folder"),
])
def test_a_damaged_model_description_is_one_error(tmp_path, name, content, words):
    if name != "model.json":
        save_hf_model(HF_CASES["llama"](), tmp_path, max_shard_size="20KB")
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        load_pretrained(tmp_path)
