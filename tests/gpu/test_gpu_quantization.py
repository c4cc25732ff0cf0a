"""`--quantization int8|int4` and `--kv-cache-dtype fp8` on a GPU, and a closed engine's memory
free for the next one's KV pool (a many-model server unloads one model, then sizes the next).
Skipped without CUDA.

On the GPU each layer takes its CUDA kernels (int8: tetrad.models.int8_triton's for decode rows;
int4: torch's `_weight_int4pack_mm` on `_convert_weight_to_int4pack`'s tiles), which the CPU suite
never runs: their product must be the dequantized weight's (read back through the kernel, bit for
bit the reference's), and the engine's greedy tokens the argmaxes of a full forward of the same
quantized model on the same GPU."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from test_quantization import (FAMILIES, GREEDY, PROMPTS, assert_fp8_pool_is_the_bf16_pool_rounded,
                               random_model)
from test_quantization_layers import product_error

from tetrad.inference.engine import LLM
from tetrad.inference.ranks.rank_share import held_bytes
from tetrad.models.fp8_weights import weight_bytes
from tetrad.models.quant import INT4_GROUP, Int4Linear, Int8Linear
from tetrad.models.quant_model import quantize_model
from tetrad.planner.serving import weight_bytes_per_gpu
from tetrad.spec.serving import ServeLayout
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_LOGIT_SLACK = 2.0 ** -5  # as tests/test_quantization.py: bf16 roundings of a logit


@pytest.mark.parametrize("rows", [1, 5, 40, 100])  # the kernel's two tilings, then cuBLAS
def test_int8_cuda_kernel_is_the_dequantized_product(rows):
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(72, 264, generator=generator), torch.randn(72, generator=generator)
    x = torch.randn(rows, 264, generator=generator).bfloat16().cuda()
    packed = Int8Linear.quantize(weight.cuda(), bias.cuda())
    reference = Int8Linear.quantize(weight.cuda(), bias.cuda(), packed=False)
    assert packed.packed and packed.values.is_cuda
    assert torch.equal(packed.weight, reference.weight)
    for layer in (packed, reference):
        error, allowed = product_error(layer, x, layer.bias.float())
        assert (error <= allowed).all()
    # The same values quantized on the CPU: the device does not change the rounding.
    assert torch.equal(packed.values.cpu(), Int8Linear.quantize(weight, bias).values)


def test_int4_cuda_kernel_reads_back_the_reference_weight():
    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 512, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(2, 3, 512, generator=generator).bfloat16().cuda()
    packed = Int4Linear.quantize(weight.cuda(), bias.cuda(), INT4_GROUP)
    reference = Int4Linear.quantize(weight.cuda(), bias.cuda(), INT4_GROUP, packed=False)
    assert packed.kernel == "cuda" and reference.kernel == "reference"
    assert torch.equal(packed.weight, reference.weight)
    for layer in (packed, reference):
        error, allowed = product_error(layer, x, layer.bias.float())
        assert (error <= allowed).all()


def assert_greedy_on(model, prompt: list[int], tokens: list[int]) -> None:
    """tests/test_quantization.py's assert_greedy on the model's device."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device))
    logits = logits[0, len(prompt) - 1:-1].float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    assert (chosen >= best - BF16_LOGIT_SLACK * best.abs()).all(), (chosen, best)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gpu_engine_greedy_tokens_are_the_quantized_models_argmaxes(family, method):
    """Through the GPU's own attention (auto: varlen, Triton or gathering, whichever this torch
    and block size take) and, where it captures them, CUDA graphs."""
    config = FAMILIES[family]
    model = random_model(config)
    llm = LLM(model, ByteTokenizer(), quantization=method, device="cuda", block_size=16,
              kv_memory="64MiB", log=None)
    try:
        kinds = {type(m) for m in llm.model.modules()} & {Int8Linear, Int4Linear}
        assert kinds == {Int8Linear if method == "int8" else Int4Linear}
        if method == "int4":
            assert {m.kernel for m in llm.model.modules() if isinstance(m, Int4Linear)} == {
                "cuda"}
        assert weight_bytes(llm.model) == held_bytes(llm.runner)["weights"] == \
            weight_bytes_per_gpu(config, ServeLayout(), method, 0)
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()
    reference = quantize_model(copy.deepcopy(model).cuda(), method)
    for prompt, tokens in zip(PROMPTS, outputs):
        assert_greedy_on(reference, prompt, tokens)


def test_an_fp8_kv_pool_on_the_gpu_holds_the_bf16_values_rounded():
    # One backend for both (fp8 takes the gathering one): another's kernels would round the
    # later layers' K/V differently before the pool's own rounding.
    assert_fp8_pool_is_the_bf16_pool_rounded(FAMILIES["llama"], device="cuda", block_size=16,
                                             attention="sdpa")


def test_a_closed_engines_memory_is_free_for_the_next_ones_kv_pool():
    """The KV pool takes what the device has free: after one engine closes (a server's unload:
    the engine is dropped, nothing else), the next sizes its pool with that engine's memory
    counted free, though an engine on a GPU holds reference cycles and torch's allocator caches
    what is freed."""
    model = random_model(FAMILIES["llama"])
    gc.collect()
    base = torch.cuda.memory_allocated()
    blocks = []
    for _ in range(2):
        llm = LLM(model, ByteTokenizer(), device="cuda", block_size=16, log=None)
        blocks.append(llm.kv_plan.num_blocks)
        llm.generate([PROMPTS[0]], GREEDY)
        llm.close()
        del llm
    # The second pool is the first's, give or take what the driver's own bookkeeping moved.
    assert blocks[1] >= 0.99 * blocks[0], blocks
    gc.collect()
    assert torch.cuda.memory_allocated() == base
