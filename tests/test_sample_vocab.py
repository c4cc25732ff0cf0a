"""A model whose vocabulary is larger than its tokenizer's (rounded up, as is common) trains, ends
with its text sample and serves, drawing only ids the tokenizer can decode."""

import torch
from torch import nn

from tetrad.cli.main import main
from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer
from tetrad.train.sample import sample_text


class FavoursUndecodableIds(nn.Module):
    """Logits that put almost all the mass on id 300, which no byte decodes to."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(vocab_size))
        with torch.no_grad():
            self.logits[300] = 20.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*ids.shape, -1)


def test_the_sample_draws_only_ids_the_tokenizer_decodes():
    text = sample_text(FavoursUndecodableIds(320), ByteTokenizer(), "\n", 50, 64, seed=1)
    assert len(text) >= 50 // 4, text  # 50 bytes decode to at least 13 characters


def test_a_run_with_a_larger_vocabulary_than_the_tokenizer_ends_with_its_sample(
        capsys, tmp_path, corpus_file):
    config = tmp_path / "run.toml"
    config.write_text("[model]\nvocab_size = 320\n")  # the tiny preset's vocabulary is 256
    code = main(["train", "--model", "tiny", "--config", str(config), "--data", corpus_file,
                 "--steps", "2",
                 "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "100"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "--- sample ---" in captured.out


def test_the_serving_engine_samples_only_ids_the_tokenizer_decodes():
    torch.manual_seed(0)
    model = Transformer(resolve_model("tiny").replace(vocab_size=320))
    with torch.no_grad():  # logits 0 for every byte, large (some positive) for ids 256..319
        model.lm_head.weight[:256] = 0
        model.lm_head.weight[256:].normal_(0, 10)
    llm = LLM(model, ByteTokenizer(), log=None, num_blocks=16)
    for params in (SamplingParams(temperature=0, max_tokens=8),
                   SamplingParams(temperature=1, max_tokens=8, seed=3)):
        output = llm.generate("To be", params)[0].outputs[0]
        assert len(output.token_ids) == 8 and max(output.token_ids) < 256, output.token_ids
