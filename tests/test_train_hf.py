"""`tetrad train --model HF_FOLDER` starts from the folder's weights, not a random init."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tetrad.spec.model import TrainConfig
from tetrad.tokenizer import ByteTokenizer
from tetrad.train.data import Dataset
from tetrad.train.trainer import train


def test_training_from_an_hf_folder_starts_from_its_weights(corpus_file, tmp_path):
    torch.manual_seed(3)
    hf_config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, tie_word_embeddings=False,
                            initializer_range=0.3)  # far from uniform: a distinctive loss
    hf_model = LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path / "llama")

    config = TrainConfig(model=str(tmp_path / "llama"), data=corpus_file, steps=1, batch_size=4,
                         seq_len=32, lr=0.0, sample_tokens=0)
    first_loss = train(config, show_progress=False).report["steps"][0]["loss"]

    batch = Dataset(corpus_file, ByteTokenizer(), 32, config.seed).train.batch(0, 4)
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert first_loss == pytest.approx(expected, abs=1e-4)
