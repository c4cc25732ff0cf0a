"""The engine on a GPU decodes what full recompute on that GPU decodes: through flash-attention's
paged varlen kernel over 256-token blocks with decode steps replayed from CUDA graphs (where this
torch's flash-attention takes block tables: 2.13), and through the gathering kernels that auto
falls back to (16-token blocks, or a torch without paged flash-attention). Skipped without CUDA.
The model and the reference are tests/test_engine.py's (weights drawn large, so no argmax is a
near-tie that the two orders of summation could break differently)."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_engine import GREEDY, random_model, reference_greedy

from tetrad.inference.worker.attention import flash_takes_block_tables
from tetrad.inference.engine import LLM
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11, 12, 13, 14],  # different lengths, a shared start
           [5, 17, 99, 3, 42, 7, 8, 250, 66],
           [200],
           [(7 * index) % 256 for index in range(300)]]  # longer than one 256-token block


@pytest.mark.parametrize("block_size, enforce_eager", [(256, False), (16, False), (256, True)])
def test_gpu_decoding_equals_full_recompute(block_size, enforce_eager):
    paged_flash = block_size == 256 and flash_takes_block_tables()
    model = random_model(max_seq_len=512).cuda()  # tests/test_engine.py's, on the GPU
    expected = [reference_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gathering fallback says so
        llm = LLM(model, ByteTokenizer(), log=None, device="cuda", block_size=block_size,
                  kv_memory="64MiB", enforce_eager=enforce_eager)
    assert llm.runner.backend == ("varlen" if paged_flash else "auto")
    assert (llm.runner.graphs is not None) == (paged_flash and not enforce_eager)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == expected
