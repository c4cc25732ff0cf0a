"""GGUF files in: the weights of files written from tiny random HF models the way llama.cpp writes
them equal the HF model's (exactly in F32; within the format's rounding in F16 / Q8_0 / Q4_0),
Q4_0 linears load as Int4Linear, the engine's greedy tokens on the F32 file are transformers', and
bad files fail in one line."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import byte_level_values, hf_llama, write_gguf  # noqa: E402
from tetrad.errors import ConfigError  # noqa: E402
from tetrad.inference.core.params import SamplingParams  # noqa: E402
from tetrad.inference.engine import LLM  # noqa: E402
from tetrad.models.hf import load_pretrained  # noqa: E402
from tetrad.models.quant import Int4Linear  # noqa: E402
from tetrad.store.gguf import unpack_gguf  # noqa: E402
from tetrad.tokenizer import BPETokenizer  # noqa: E402

TEXTS = ["To be, or not to be, that is the question. " * 4,
         "Whether 'tis nobler in the mind to suffer the slings and arrows. " * 4] * 10


@pytest.fixture(scope="module")
def tokenizer():
    return BPETokenizer.train(TEXTS, 300)


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """HF models and their HF folders: llama with GQA (its Q/K rows permuted in the file) and a
    tied qwen2 with Q/K/V biases."""
    vocab = tokenizer.vocab_size
    out = {}
    for name, model in {"llama": hf_llama(vocab, seed=1),
                        "qwen2": hf_llama(vocab, seed=2, model_type="qwen2",
                                          tie_word_embeddings=True)}.items():
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(folder)
        out[name] = model, folder
    return out


def gguf_model_folder(tmp_path, hf_model, kind, tokenizer):
    file = write_gguf(tmp_path / f"{kind}.gguf", hf_model, kind,
                      byte_level_values(tokenizer.tokenizer))
    folder = tmp_path / kind
    folder.mkdir()
    unpack_gguf(file, folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_weights_equal_the_hf_models_exactly(family, models, tokenizer, tmp_path):
    hf_model, hf_folder = models[family]
    reference = load_pretrained(hf_folder).state_dict()
    state = load_pretrained(gguf_model_folder(tmp_path, hf_model, "F32", tokenizer)).state_dict()
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name


def test_config_from_the_metadata_is_the_hf_configs(models, tokenizer, tmp_path):
    from tetrad.models.hf import pretrained_config

    for family, (hf_model, hf_folder) in models.items():
        (tmp_path / family).mkdir()
        folder = gguf_model_folder(tmp_path / family, hf_model, "F32", tokenizer)
        ours, theirs = pretrained_config(folder).to_dict(), pretrained_config(hf_folder).to_dict()
        ours.pop("name"), theirs.pop("name")
        assert ours == theirs, family


def test_f16_weights_are_the_hf_weights_rounded(models, tokenizer, tmp_path):
    hf_model, hf_folder = models["llama"]
    reference = load_pretrained(hf_folder).state_dict()
    state = load_pretrained(gguf_model_folder(tmp_path, hf_model, "F16", tokenizer)).state_dict()
    for name, tensor in reference.items():  # the model's dtype is its weights': float16
        assert torch.equal(state[name], tensor.half()), name


def test_bf16_weights_are_the_hf_weights_rounded(models, tokenizer, tmp_path):
    hf_model, hf_folder = models["qwen2"]
    reference = load_pretrained(hf_folder).state_dict()
    state = load_pretrained(gguf_model_folder(tmp_path, hf_model, "BF16", tokenizer)).state_dict()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor.bfloat16()), name


def test_q4_k_weights_are_the_files_blocks_dequantized(tokenizer, tmp_path):
    """Q4_K (super-blocks of 256, a 6-bit scale and minimum per 32) is dequantized at load: each
    weight equals gguf.quants' reading of the file's blocks, Q and K rows put back in HF order."""
    from gguf_files import llama_cpp_permute

    hf_model = hf_llama(tokenizer.vocab_size, hidden_size=256, intermediate_size=256)
    folder = gguf_model_folder(tmp_path, hf_model, "Q4_K", tokenizer)
    loaded = load_pretrained(folder, dtype=torch.float32).state_dict()
    reader = gguf.GGUFReader(folder / "model.gguf")
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    q, k, v = (stored[f"blk.1.attn_{p}.weight"] for p in "qkv")
    # llama.cpp's permute applied to the loaded rows gives the file's rows back
    qkv = loaded["layers.1.attn.qkv.weight"].numpy()
    assert np.array_equal(llama_cpp_permute(qkv[:256], 4), q)
    assert np.array_equal(llama_cpp_permute(qkv[256:384], 2), k)
    assert np.array_equal(qkv[384:], v)
    assert np.array_equal(loaded["layers.0.mlp.down.weight"].numpy(),
                          stored["blk.0.ffn_down.weight"])


def _block_amax(weight: torch.Tensor) -> torch.Tensor:
    """max |w| of each 32-weight block, repeated over the block."""
    rows, cols = weight.shape
    amax = weight.abs().view(rows, cols // 32, 32).amax(-1, keepdim=True)
    return amax.expand(rows, cols // 32, 32).reshape(rows, cols)


def test_q8_0_dequantizes_within_half_a_step(models, tokenizer, tmp_path):
    hf_model, hf_folder = models["llama"]
    reference = load_pretrained(hf_folder).state_dict()
    loaded = load_pretrained(gguf_model_folder(tmp_path, hf_model, "Q8_0", tokenizer),
                             dtype=torch.float32)
    for name, tensor in reference.items():
        value = loaded.state_dict()[name]
        if tensor.dim() == 1:
            assert torch.equal(value, tensor), name
            continue
        # Q8_0: d = amax / 127 per block, q = round(w / d): off by at most d / 2, plus |q| <=
        # 127 times d's rounding to fp16 (2^-11 of it).
        bound = _block_amax(tensor) / 127 * (0.5 + 127 * 2**-11)
        error = (value - tensor).abs()
        assert (error <= bound + 1e-7).all(), (name, (error - bound).max())
        assert error.max() > 0  # quantized indeed


def test_q4_0_linears_are_int4_within_one_step(models, tokenizer, tmp_path, capfd):
    hf_model, hf_folder = models["llama"]
    reference = load_pretrained(hf_folder)
    folder = gguf_model_folder(tmp_path, hf_model, "Q4_0", tokenizer)
    loaded = load_pretrained(folder, dtype=torch.bfloat16, keep_fp8=True)
    warning = capfd.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "1 Q4_0" in warning[0] and "embedding" in warning[0]
    dequantized = load_pretrained(folder, dtype=torch.float32)
    assert "16 Q4_0 tensors dequantized" in capfd.readouterr().err
    for block, plain in zip(loaded.layers, dequantized.layers):
        for name in ("attn.qkv", "attn.out", "mlp.up", "mlp.down"):
            layer = block.get_submodule(name)
            assert isinstance(layer, Int4Linear) and layer.group == 32, name
            # the same 4-bit values and scales: two bf16 roundings apart (the scale, the product)
            exact = plain.get_submodule(name).weight
            assert torch.allclose(layer.weight.float(), exact, rtol=2**-7, atol=0), name
    assert isinstance(loaded.lm_head, Int4Linear)
    for name, tensor in reference.state_dict().items():
        value = dequantized.state_dict()[name]
        if tensor.dim() == 2:
            # Q4_0: d = (the block's largest-magnitude weight) / -8, q = round(w / d) + 8 in
            # 0..15: off by d / 2, or by d where -(that weight) rounds to 16 and is clamped;
            # plus |q - 8| <= 8 times d's rounding to fp16.
            bound = _block_amax(tensor) / 8 * (1 + 8 * 2**-11)
            assert ((value - tensor).abs() <= bound + 1e-7).all(), name


def test_engine_greedy_tokens_equal_transformers_on_the_f32_file(models, tokenizer, tmp_path):
    hf_model, _ = models["llama"]
    folder = gguf_model_folder(tmp_path, hf_model, "F32", tokenizer)
    prompts = [tokenizer.encode(text[:40]) for text in TEXTS[:2]] + [[5, 17, 99, 3]]
    with LLM(folder, log=None, block_size=4) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     min_new_tokens=12)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected


def test_engine_serves_a_q4_0_file_with_int4_layers(models, tokenizer, tmp_path):
    """The file's dtype is bf16 (its matrices are all quantized): the engine's one rank keeps the
    Q4_0 linears as Int4Linear, and its greedy tokens are those of the same layers' plain
    forward over the whole sequence."""
    folder = gguf_model_folder(tmp_path, models["llama"][0], "Q4_0", tokenizer)
    prompt = tokenizer.encode(TEXTS[0][:30])
    with LLM(folder, log=None, block_size=4) as llm:
        assert llm.config.dtype == "bf16"
        assert isinstance(llm.model.layers[1].mlp.down, Int4Linear)
        tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    model = load_pretrained(folder, dtype=torch.bfloat16, keep_fp8=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert tokens == ids[len(prompt):]


def _tensor_file(tmp_path, arch="llama"):
    """A file of `arch` with its metadata and one embedding."""
    writer = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    for key, value in (("context_length", 64), ("embedding_length", 32), ("block_count", 0),
                       ("feed_forward_length", 64)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / f"{arch}.gguf"


def run_cli(*args):
    from tetrad.cli.main import main

    return main(list(args))


def test_an_unsupported_architecture_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    file = _tensor_file(tmp_path, "phi3")
    assert run_cli("generate", str(file), "--prompt", "hi") == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "architecture 'phi3' is not supported" in error and "llama, qwen2" in error


def test_an_unsupported_tensor_type_is_one_line(models, tokenizer, tmp_path):
    folder = gguf_model_folder(tmp_path, models["llama"][0], "F32", tokenizer)
    reader = gguf.GGUFReader(folder / "model.gguf", "r+")  # I32: as many bytes as F32
    norm = next(tensor for tensor in reader.tensors if tensor.name == "output_norm.weight")
    norm.field.parts[4][0] = gguf.GGMLQuantizationType.I32
    reader.data.flush()
    del reader
    with pytest.raises(ConfigError, match=r"output_norm.weight has type I32, which tetrad "
                                          r"cannot read") as error:
        load_pretrained(folder)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("keep", [20, 200, -100])
def test_a_truncated_file_is_one_line(tmp_path, capsys, monkeypatch, keep):
    """Cut inside the header (20 bytes), inside the metadata, and inside the tensor data."""
    monkeypatch.setenv("TETRAD_HOME", str(tmp_path / "home"))
    data = _tensor_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    assert run_cli("generate", str(cut), "--prompt", "hi") == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and str(cut) in error
    assert "truncated" in error
