"""`--quantization` under tensor parallelism: tp=2 against tp=1 quantized, on the model families
of test_quantization.py (and, in a second spawn, pipeline stages and experts over data-parallel
ranks: the bytes each rank holds and the greedy tokens). One spawn of 2 ranks (tests/dist.py; the LLM on rank 0, ServingWorker on
rank 1) serves each case. Each rank's quantized shard, dequantized, is exactly the rows (column-
parallel) or columns (row-parallel) of the one-process quantized weight: int8's scales shard with
the rows and a row-parallel shard keeps its whole rows' scales, int4's groups shard with the
columns. Each rank holds exactly the weight and KV bytes the planner predicts for tp=2, and the
greedy tokens are the one-process quantized model's argmaxes (up to bf16 rounding; with a 16-bit
KV cache)."""

import copy

import pytest
import torch
from dist import run_ranks
from test_quantization import FAMILIES, PROMPTS, GREEDY, assert_greedy, random_model

from tetrad.inference.engine import LLM
from tetrad.inference.ranks.driver import ServingWorker
from tetrad.inference.ranks.rank_share import held_bytes
from tetrad.models.hf import load_pretrained, save_hf
from tetrad.models.quant_store import quantize_folder
from tetrad.models.quant_model import quantize_model
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.precision import element_bytes
from tetrad.planner.serving import weight_bytes_per_gpu
from tetrad.spec.serving import ServeLayout
from tetrad.tokenizer import ByteTokenizer

TP = 2
# (family, quantization, KV dtype): int4 needs every shard's input a multiple of 128, which the
# MoE shapes' shared expert (128 / 2 = 64) is not.
CASES = [("llama", "int8", "auto"), ("llama", "int4", "fp8"), ("gpt2", "int4", "auto"),
         ("moe", "int8", "auto"), ("mla", "int8", "auto")]
# A model stored quantized (tetrad create --quantize): every rank cuts the stored values.
STORED = ("llama", "int4", "auto")


def shards(model: torch.nn.Module, rank: int) -> dict:
    """Each tensor-parallel shard's dequantized weight, with the dimension it was cut along and
    the rows or columns of the whole weight it holds."""
    return {name: (module.quantized.weight, module.dim, module.indices[rank])
            for name, module in model.named_modules() if hasattr(module, "quantized")}


def rank_main(rank: int, world_size: int, stored_folder: str) -> list[dict]:
    """CASES in order, then the model stored quantized in `stored_folder` (each rank loads it)."""
    results = []
    for (family, method, kv), model in [*((case, random_model(FAMILIES[case[0]]))
                                          for case in CASES),
                                         (STORED, stored_folder)]:
        if rank == 0:
            llm = LLM(model, ByteTokenizer(), tp=TP, quantization=method, kv_cache_dtype=kv,
                      attention="sdpa", device="cpu", block_size=4, log=None)
            result = {"outputs": [o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
                      **held_bytes(llm.runner), "shards": shards(llm.runner.model, rank)}
            llm.close()
        else:
            worker = ServingWorker(model)
            result = {**held_bytes(worker.runner), "shards": shards(worker.runner.model, rank)}
            while worker.step():
                pass
        results.append(result)
    return results


@pytest.fixture(scope="module")
def stored_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stored")
    save_hf(random_model(FAMILIES[STORED[0]]), folder / "bf16")
    (folder / "int4").mkdir()
    quantize_folder(folder / "bf16", folder / "int4", STORED[1])
    return folder / "int4"


@pytest.fixture(scope="module")
def per_rank(stored_folder):
    return run_ranks(rank_main, TP, str(stored_folder), timeout_s=300)


def one_process(case: int, stored_folder) -> torch.nn.Module:
    """The quantized model one process serves for the case."""
    if case < len(CASES):
        family, method, _ = CASES[case]
        return quantize_model(copy.deepcopy(random_model(FAMILIES[family])), method)
    model = load_pretrained(stored_folder, "cpu", torch.bfloat16)
    return quantize_model(model, STORED[1], model.stored_quantized)


@pytest.mark.parametrize("case", range(len(CASES) + 1),
                         ids=["-".join(c) for c in CASES] + ["stored-" + "-".join(STORED)])
def test_tp2_holds_the_one_process_quantized_weights_cut_and_the_planned_bytes(
        per_rank, stored_folder, case):
    family, method, kv = [*CASES, STORED][case]
    config = FAMILIES[family]
    reference = one_process(case, stored_folder)
    whole = dict(reference.named_modules())
    for rank, results in enumerate(per_rank):
        result = results[case]
        assert result["shards"], "no tensor-parallel shard was quantized"
        for name, (weight, dim, indices) in result["shards"].items():
            assert torch.equal(weight, whole[name].weight.index_select(dim, indices)), (rank,
                                                                                       name)
        assert result["weights"] == weight_bytes_per_gpu(config, ServeLayout(tp=TP), method, 0)
        element = "bf16" if kv == "auto" else kv
        assert result["kv_per_token"] == kv_bytes_per_token(config, element_bytes(element), TP)
    if kv == "fp8":  # K and V rounded to E4M3 move the logits past bf16's rounding
        return
    for prompt, tokens in zip(PROMPTS, per_rank[0][case]["outputs"]):
        assert_greedy(reference, prompt, tokens)


# Two more layouts of 2 ranks: pipeline stages (each its layers, quantized) and experts spread
# over attention data-parallel ranks (each its 2 of the 4 experts, quantized whole).
LAYOUTS = [("llama", "int4", ServeLayout(pp=2)), ("moe", "int8", ServeLayout(ep=2, dp=2))]


def layouts_main(rank: int, world_size: int) -> list[dict]:
    results = []
    for family, method, layout in LAYOUTS:
        model = random_model(FAMILIES[family])
        if rank == 0:
            llm = LLM(model, ByteTokenizer(), quantization=method, device="cpu", block_size=4,
                      log=None, **layout.to_dict())
            outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            results.append({"outputs": outputs, "stage": llm.driver.ranks.coords["pp"],
                            **held_bytes(llm.runner)})
            llm.close()
        else:
            worker = ServingWorker(model)
            results.append({"stage": worker.ranks.coords["pp"], **held_bytes(worker.runner)})
            while worker.step():
                pass
    return results


def test_pipeline_stages_and_spread_experts_hold_the_planned_quantized_bytes():
    per_rank = run_ranks(layouts_main, TP, timeout_s=300)
    for case, (family, method, layout) in enumerate(LAYOUTS):
        config = FAMILIES[family]
        for results in per_rank:
            result = results[case]
            assert result["weights"] == weight_bytes_per_gpu(config, layout, method,
                                                             result["stage"]), (family, layout)
        reference = quantize_model(copy.deepcopy(random_model(config)), method)
        for prompt, tokens in zip(PROMPTS, per_rank[0][case]["outputs"]):
            assert_greedy(reference, prompt, tokens)
