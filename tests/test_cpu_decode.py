"""The fused CPU decode step (cpu_decode.py, decode_step.cpp): it runs the decode steps of a
Llama-family model on a CPU, gives the eager forward's greedy tokens in fp32 and bf16, and stays
off for models it does not cover; linear_rows equals torch's matmul."""

import pytest
import torch
import torch.nn.functional as F

from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.worker.cpu_decode import FusedCpuDecode, fused_decode_refusal
from tetrad.inference.worker.cpu_kernels import cpu_kernels_available
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [200], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def random_model(**overrides):
    torch.manual_seed(0)
    model = Transformer(resolve_model("tiny", overrides or None))
    with torch.no_grad():  # weights larger than init: logits far apart, no argmax near-ties
        for param in model.parameters():
            param.normal_(0, 0.15)
    return model.eval()


def counted_engine(model, monkeypatch, **config):
    """The engine and a list that gains one entry per fused step it runs."""
    calls, run = [], FusedCpuDecode.run

    def counting(self, plan):
        calls.append(len(plan.starts))
        return run(self, plan)

    monkeypatch.setattr(FusedCpuDecode, "run", counting)
    return LLM(model, ByteTokenizer(), log=None, block_size=4, **config), calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_decode_gives_the_eager_forwards_greedy_tokens(dtype, monkeypatch):
    model = random_model()
    eager = LLM(model, ByteTokenizer(), log=None, block_size=4, dtype=dtype, enforce_eager=True)
    assert eager.runner.fused is None
    expected = [out.token_ids for out in eager.generate(PROMPTS, GREEDY)]
    fused, calls = counted_engine(random_model(), monkeypatch, dtype=dtype)
    assert [out.token_ids for out in fused.generate(PROMPTS, GREEDY)] == expected
    # Every decode step ran fused, three sequences at once while all were running.
    assert len(calls) >= GREEDY.max_tokens - 1 and max(calls) == len(PROMPTS)


@pytest.mark.parametrize("sequences", [12, 20])
def test_many_sequences_give_the_eager_forwards_greedy_tokens(sequences, monkeypatch):
    """12 sequences: each weight streamed in three passes of 4 rows; 20: past the 16 rows fp32
    weights are streamed for, every projection is torch's own matmul on the step's buffers."""
    prompts = [[3 + 7 * i, 40 + i, 90 - i] for i in range(sequences)]
    eager = LLM(random_model(), ByteTokenizer(), log=None, block_size=4, enforce_eager=True)
    expected = [out.token_ids for out in eager.generate(prompts, GREEDY)]
    fused, calls = counted_engine(random_model(), monkeypatch)
    assert [out.token_ids for out in fused.generate(prompts, GREEDY)] == expected
    assert max(calls) == len(prompts)


def test_models_it_does_not_cover_run_their_own_forward(monkeypatch):
    for overrides in (dict(position="learned", norm="layernorm", mlp="gelu", bias=True),
                      dict(num_experts=4, num_experts_per_token=2, num_shared_experts=1)):
        model = random_model(**overrides)
        assert fused_decode_refusal(model, torch.float32) is not None
        llm, calls = counted_engine(model, monkeypatch)
        assert llm.runner.fused is None
        llm.generate(PROMPTS[:1], GREEDY)
        assert not calls
    # A KV pool of another dtype than the weights (an fp8 cache) is refused too.
    assert fused_decode_refusal(random_model(), torch.bfloat16) is not None
    assert fused_decode_refusal(random_model(), torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 12: three passes of 4 rows; 20: past fp32's streamed rows; 70: past every dtype's (torch's matmul)
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 20, 70])
@pytest.mark.parametrize("outputs", [37, 300])  # 300: several tiles of 64 output rows a thread
def test_linear_rows_equals_torchs_matmul(dtype, rows, outputs):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 75, dtype=dtype), torch.randn(outputs, 75, dtype=dtype)  # odd sizes
    bias = torch.randn(outputs, dtype=dtype)
    expected = F.linear(x.float(), w.float(), bias.float())
    got = torch.ops.tetrad.linear_rows(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows, outputs)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1,
                                                                               rtol=1e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)


def test_kernels_split_their_work_over_torchs_threads():
    """The kernels' at::parallel_for hands work to every thread torch has (a library built
    without OpenMP runs it all on the calling thread), and to one when torch has one."""
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.ops.tetrad.parallel_threads(64) == count
    finally:
        torch.set_num_threads(threads)
