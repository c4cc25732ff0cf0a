"""The engine on a GPU decodes what full recompute on that GPU decodes: through whatever auto picks
there (the Triton kernels where triton runs), flash-attention's paged varlen kernel over 256-token
blocks with decode steps replayed from CUDA graphs (where this torch's flash-attention takes block
tables: 2.13), and the gathering kernels (`sdpa`). Skipped without CUDA. The model and the
reference are tests/test_engine.py's (weights drawn large, so no argmax is a near-tie that the two
orders of summation could break differently)."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_engine import GREEDY, random_model, reference_greedy

from tetrad.inference.worker.attention import flash_takes_block_tables, resolve_backend
from tetrad.inference.engine import LLM
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11, 12, 13, 14],  # different lengths, a shared start
           [5, 17, 99, 3, 42, 7, 8, 250, 66],
           [200],
           [(7 * index) % 256 for index in range(300)]]  # longer than one 256-token block


@pytest.mark.parametrize("attention, block_size, enforce_eager",
                         [("auto", 256, False), ("auto", 16, False), ("auto", 256, True),
                          ("varlen", 256, False), ("sdpa", 16, False)])
def test_gpu_decoding_equals_full_recompute(attention, block_size, enforce_eager):
    if attention == "varlen" and not flash_takes_block_tables():
        pytest.skip("this torch's flash-attention takes no block tables")
    model = random_model(max_seq_len=512).cuda()  # tests/test_engine.py's, on the GPU
    expected = [reference_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gathering fallback says so
        llm = LLM(model, ByteTokenizer(), log=None, device="cuda", block_size=block_size,
                  kv_memory="64MiB", enforce_eager=enforce_eager, attention=attention)
        backend = resolve_backend(attention, torch.device("cuda"), block_size)
    assert llm.runner.backend == backend
    assert (llm.runner.graphs is not None) == (llm.runner.attention.capturable
                                               and not enforce_eager)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == expected
