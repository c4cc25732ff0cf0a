"""GGUF files written from tiny random HF models the way llama.cpp's convert_hf_to_gguf.py writes
them (its tensor names, its metadata keys, its permuted llama Q/K rows), with gguf.GGUFWriter and
gguf.quants.quantize: the inputs of tests/test_gguf*.py and benchmarks/gguf_agreement.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType, GGUFWriter, quants

# HF tensor suffix (in model.layers.N.) -> llama.cpp's (in blk.N.)
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "<|assistant|>")


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> adjacent pairs."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def write_gguf(path: Path, hf_model, kind: str = "F32", tokenizer: dict | None = None,
               template: str | None = TEMPLATE, arch: str | None = None,
               output_kind: str | None = None) -> Path:
    """`hf_model` (llama or qwen2) as a GGUF file whose 2D weights are `kind` (F32, F16, BF16,
    Q8_0, Q4_0; norms and biases stay F32, as llama.cpp keeps them; Q4_K: random blocks). `tokenizer`: the
    tokenizer.ggml.* values (tokenizer_values below). `output_kind`: the untied LM head's own
    type (llama-quantize gives a Q4_0 file's output Q6_K, which gguf.quants cannot write)."""
    config = hf_model.config
    arch = arch or config.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if tokenizer:
        add_tokenizer(writer, tokenizer)
    if template:
        writer.add_chat_template(template)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor_kind = output_kind if name == "lm_head.weight" and output_kind else kind
        qtype = GGMLQuantizationType[tensor_kind]
        data = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if tensor_kind == "Q4_K" and data.ndim == 2:  # no gguf.quants quantizer: random blocks
            writer.add_tensor(gguf_name(name), random_q4_k(*data.shape), raw_dtype=qtype)
        elif data.ndim == 1:
            writer.add_tensor(gguf_name(name), data.astype(np.float32))
        elif tensor_kind in ("F32", "F16") or data.shape[1] % block:
            # llama.cpp falls back too when a row is no whole number of blocks
            writer.add_tensor(gguf_name(name), data.astype(np.float32 if tensor_kind == "F32"
                                                           else np.float16))
        else:
            writer.add_tensor(gguf_name(name), quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K blocks of random bits (256 weights in 144 bytes) whose two fp16 scales, d and dmin,
    are small finite numbers."""
    blocks = np.random.default_rng(seed + rows * cols).integers(
        0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., :4] = np.random.default_rng(seed).uniform(
        1e-4, 1e-3, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def add_tokenizer(writer: GGUFWriter, values: dict) -> None:
    writer.add_tokenizer_model(values["model"])
    if "pre" in values:
        writer.add_tokenizer_pre(values["pre"])
    writer.add_token_list(values["tokens"])
    writer.add_token_types(values["token_type"])
    if "scores" in values:
        writer.add_token_scores(values["scores"])
    if "merges" in values:
        writer.add_token_merges(values["merges"])
    for key in ("bos", "eos", "unk"):
        if f"{key}_id" in values:
            getattr(writer, f"add_{key}_token_id")(values[f"{key}_id"])
    if "add_bos" in values:
        writer.add_add_bos_token(values["add_bos"])


def byte_level_values(tokenizer) -> dict:
    """A tokenizers byte-level BPE (tetrad's BPETokenizer.tokenizer) as llama.cpp's "gpt2"
    tokenizer metadata: tokens by id, merges, end-of-text as eos and control token."""
    import json

    state = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["content"] for added in state["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    eos = next(iter(special))
    return {"model": "gpt2", "pre": "gpt-2", "tokens": tokens, "merges": merges,
            "token_type": [3 if token in special else 1 for token in tokens],
            "eos_id": vocab[eos], "bos_id": vocab[eos], "add_bos": False}


def sentencepiece_values(tokenizer) -> dict:
    """A tokenizers BPE with byte fallback over '▁'-spaced text (SentencePiece's shape) as
    llama.cpp's "llama" tokenizer metadata: no merges, scores that rank each token by its id (the
    order its merge was learned), <0xNN> byte tokens, <unk>, <s> and </s>."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else
             6 if t.startswith("<0x") and len(t) == 6 else 1 for t in tokens]
    return {"model": "llama", "tokens": tokens, "token_type": types,
            "scores": [-float(index) for index in range(len(tokens))],
            "unk_id": vocab["<unk>"], "bos_id": vocab["<s>"], "eos_id": vocab["</s>"],
            "add_bos": True}


def train_sentencepiece_bpe(texts: list[str], vocab_size: int):
    """A SentencePiece-shaped BPE trained here: '▁' for spaces (one in front), byte fallback."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                       split=False)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def hf_llama(vocab: int, seed: int = 0, model_type: str = "llama", **overrides):
    """A tiny HF llama/qwen2 with random weights (norms and biases too, so a swapped or dropped
    tensor shows)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                 rms_norm_eps=1e-5, max_position_embeddings=128)
    shape.update(overrides)
    config = (LlamaConfig if model_type == "llama" else Qwen2Config)(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise)
    return model.eval()
