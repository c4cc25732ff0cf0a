"""Loading for serving: weights go straight from safetensors into parameters of the target dtype
(a model built on the meta device), --dtype auto takes the checkpoint's dtype, and a folder whose
tokenizer cannot decode the model's vocabulary stops at load time."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
from tetrad.models.hf import checkpoint_dtype, load_pretrained


def save_llama(folder, vocab_size=256, dtype=torch.float32):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return model.eval()


def test_weights_load_in_the_stored_or_asked_dtype_without_init(tmp_path, monkeypatch):
    save_llama(tmp_path, dtype=torch.bfloat16)
    stored = load_file(tmp_path / "model.safetensors")
    assert checkpoint_dtype(tmp_path) == torch.bfloat16
    # No random init: the model is built on the meta device, where init draws nothing.
    init = torch.nn.init.normal_

    def only_on_meta(tensor, *args, **kwargs):
        assert tensor.is_meta, "a weight was randomly initialized in memory"
        return init(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", only_on_meta)
    model = load_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.layers[1].mlp.down.weight,
                       stored["model.layers.1.mlp.down_proj.weight"])
    assert {p.dtype for p in load_pretrained(tmp_path, dtype=torch.float16).parameters()} == {
        torch.float16}


def test_dtype_auto_serves_a_bf16_checkpoint_in_bf16_and_equals_hf(tmp_path):
    hf_model = save_llama(tmp_path, dtype=torch.bfloat16)
    llm = LLM(tmp_path, log=None, block_size=4)
    assert llm.config.dtype == "bf16"
    assert llm.runner.kv_cache.pool.dtype == torch.bfloat16
    assert {p.dtype for p in llm.model.parameters()} == {torch.bfloat16}
    prompt = [5, 17, 99, 3, 42]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # bf16 rounding may differ from HF's in later tokens: the first one must agree.
    assert llm.generate(prompt, greedy)[0].outputs[0].token_ids[0] == expected[0, 5].item()
    assert LLM(tmp_path, log=None, dtype="fp32").config.dtype == "fp32"


def test_a_vocabulary_the_byte_tokenizer_cannot_decode_stops_at_load(tmp_path):
    save_llama(tmp_path, vocab_size=4096)  # no tokenizer.json: the byte tokenizer would be used
    with pytest.raises(ConfigError, match="4096 tokens but its tokenizer only 256"):
        LLM(tmp_path, log=None)
