"""Tensor-parallel decoding (tp=2) against the tp=1 engine on tiny random models.

One spawn of 2 ranks (tests/dist.py: the LLM on rank 0, ServingWorker on rank 1, in the
harness's process group) carries the exactness, KV and communication checks for three models:
kv heads = heads (MHA), kv heads = tp (GQA) and one kv head replicated on both ranks (MQA). For
each, greedy outputs equal the tp=1 engine token for token for prompts of different lengths, with
prefix caching (generated twice), under forced preemption by recompute and by swap; each rank's
KV pool holds exactly the bytes of its own kv heads; in every step both ranks count the same
collectives (rank 1 also its logits), and in a prefill step and a decode step the bytes each
rank's Comm counts equal the formula below, computed here from the prompts and the config alone.

A second test starts the engine as users do (LLM(folder, tp=2) spawns its own rank; `tetrad
generate --tp 2`) and checks that a crashed or failing rank stops the engine with its error, in
seconds, instead of a hang.
"""

import math
import multiprocessing
import os
import signal
import time
from fractions import Fraction

import pytest
import torch
from dist import run_ranks
from test_engine import GREEDY, PROMPTS, random_model

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.inference.engine import LLM
from tetrad.inference.worker.runner import StepPlan
from tetrad.inference.ranks.driver import STEP, ServingRankError, ServingWorker
from tetrad.inference.worker.config import serving_device
from tetrad.models.hf import save_hf
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer

TP = 2
MODELS = {"mha": dict(num_kv_heads=4), "gqa": dict(num_kv_heads=2), "mqa": dict(num_kv_heads=1)}
ENGINES = {
    # Generated twice: the second time from the prefix cache, with 2 greedy samples per prompt
    # (forked sequences copy their shared partial block before writing).
    "cached": dict(kv_memory="256KiB"),
    "recompute": dict(num_blocks=12, max_num_batched_tokens=16),  # 48 slots for ~100 tokens
    "swap": dict(num_blocks=12, preemption="swap", swap_memory="64KiB", attention="tiled"),
    # Two steps: a prefill of every prompt, then a decode of every sequence.
    "comm": dict(enable_prefix_caching=False, num_blocks=64),
}
COMM_PARAMS = GREEDY.replace(max_tokens=2)
RUNS = {"cached": [GREEDY, GREEDY.replace(n=2)], "comm": [COMM_PARAMS]}
BLOCK_SIZE = 4


def engine_config(name: str, tp: int) -> dict:
    return {"block_size": BLOCK_SIZE, "tp": tp, "device": "cpu", **ENGINES[name]}


def snapshot(counter) -> dict:
    """Bytes counted so far by (tag, kind)."""
    return {(tag, kind): value for tag in counter.tags()
            for kind, value in counter.totals((tag,)).items() if value}


def difference(after: dict, before: dict) -> dict:
    return {key: value - before.get(key, 0) for key, value in after.items()
            if value != before.get(key, 0)}


def run_engine(llm: LLM, params) -> tuple[list, list[dict]]:
    """The samples of PROMPTS, and the bytes rank 0 counted in each step that ran the model."""
    counter = llm.driver.ranks.comm.counter
    ids = [llm.add_request(prompt, params) for prompt in PROMPTS]
    done, steps = {}, []
    while len(done) < len(ids):
        before = snapshot(counter)
        for output in llm.step():
            if output.finished:
                done[output.request_id] = [c.token_ids for c in output.outputs]
        if step := difference(snapshot(counter), before):
            steps.append(step)
    return [done[request_id] for request_id in ids], steps


def pool_bytes(llm_or_worker) -> int:
    pool = llm_or_worker.runner.kv_cache.pool
    return pool.numel() * pool.element_size()


def split_parameter_count(model) -> int:
    """Parameters outside the norms (which every rank keeps whole)."""
    return sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)


def rank_main(rank: int, world_size: int) -> list[dict]:
    """Every (model, engine) case in turn: the LLM on rank 0, a worker on rank 1."""
    results = []
    for overrides in MODELS.values():
        for name in ENGINES:
            model = random_model(**overrides)  # the same weights on both ranks: same seed
            if rank == 0:
                llm = LLM(model, ByteTokenizer(), log=None, **engine_config(name, world_size))
                runs = [run_engine(llm, params) for params in RUNS.get(name, [GREEDY])]
                results.append({"outputs": [outputs for outputs, _ in runs],
                                "steps": [step for _, steps in runs for step in steps],
                                "preemptions": llm.scheduler.num_preemptions,
                                "prefix_hits": llm.block_manager.num_prefix_hits,
                                "used_blocks": llm.block_manager.num_used_blocks,
                                "num_blocks": llm.kv_plan.num_blocks,
                                "bytes_per_token": llm.kv_plan.bytes_per_token,
                                "pool_bytes": pool_bytes(llm),
                                "params": split_parameter_count(llm.model)})
                llm.close()
            else:
                worker = ServingWorker(model)
                steps, counter = [], worker.ranks.comm.counter
                before = snapshot(counter)
                while worker.step():
                    steps.append(difference(snapshot(counter), before))
                    before = snapshot(counter)
                results.append({"steps": steps, "pool_bytes": pool_bytes(worker),
                                "params": split_parameter_count(worker.runner.model)})
    return results


def expected_step_bytes(config, rank: int, starts: list[int], num_tokens: list[int]) -> dict:
    """What one rank sends in a step computing num_tokens[i] tokens of sequence i from position
    starts[i], every sequence sampling (fp32, tp=2; ring volumes: all-reduce 2(tp-1)/tp * S,
    broadcast (tp-1)/tp * S):
      activations  an all-reduce of [tokens, hidden] after the embedding and after each layer's
                   attention and MLP
      step         rank 0's broadcast: a header of 7 int64, then token ids, starts, token counts,
                   sample flags and the block table entries covering each sequence (int64)
      logits       ranks > 0 send rank 0 their [samples, vocab / tp] slice."""
    tokens, seqs = sum(num_tokens), len(starts)
    entries = sum(math.ceil((start + num) / BLOCK_SIZE) for start, num in zip(starts, num_tokens))
    expected = {("activations", "all_reduce"): Fraction(2 * (TP - 1), TP) * (
                    (2 * config.num_layers + 1) * tokens * config.hidden_size * 4),
                ("step", "broadcast"): Fraction(TP - 1, TP) * 8 * (7 + tokens + 3 * seqs
                                                                   + entries)}
    if rank:
        expected["logits", "p2p"] = seqs * config.vocab_size // TP * 4
    return expected


def test_tensor_parallel_decoding_equals_tp1():
    rank0, rank1 = run_ranks(rank_main, TP, timeout_s=150)
    cases = iter(zip(rank0, rank1))
    for model_name, overrides in MODELS.items():
        config = resolve_model("tiny", overrides)
        for name in ENGINES:
            on0, on1 = next(cases)
            where = f"{model_name}/{name}"
            model = random_model(**overrides)
            reference = LLM(model, ByteTokenizer(), log=None, **engine_config(name, 1))
            for params, outputs in zip(RUNS.get(name, [GREEDY]), on0["outputs"], strict=True):
                expected = [[c.token_ids for c in o.outputs]
                            for o in reference.generate(PROMPTS, params)]
                assert outputs == expected, where
            assert on0["used_blocks"] == 0, where
            if name == "cached":
                assert on0["prefix_hits"] > 0, where
            if name in ("recompute", "swap"):
                assert on0["preemptions"] > 0, where
            # Each rank holds the K and V of its own kv heads: half of tp=1's, except one kv head,
            # which both ranks keep.
            share = 1 if config.num_kv_heads < TP else TP
            if name == "cached":  # a budget per rank buys twice the blocks when heads split
                assert on0["bytes_per_token"] * share == reference.kv_plan.bytes_per_token
                assert on0["num_blocks"] == reference.kv_plan.num_blocks * share, where
            else:
                assert on0["num_blocks"] == reference.kv_plan.num_blocks, where
                assert on0["pool_bytes"] * share == pool_bytes(reference), where
                assert on1["pool_bytes"] == on0["pool_bytes"], where
            if config.num_kv_heads >= TP:  # everything but the norms split in two
                assert on0["params"] * TP == on1["params"] * TP == split_parameter_count(model)
            # Both ranks ran the same steps and sent the same collectives; rank 1 also sent its
            # logits, one vocabulary half per sampled sequence.
            assert len(on0["steps"]) == len(on1["steps"]) > 0, where
            for step0, step1 in zip(on0["steps"], on1["steps"]):
                logits = step1.get(("logits", "p2p"), 0)
                assert {k: v for k, v in step1.items() if k != ("logits", "p2p")} == step0, where
                assert logits % (config.vocab_size // TP * 4) == 0, where
            if name == "comm":
                lengths = [len(prompt) for prompt in PROMPTS]
                starts = {"prefill": [0] * len(lengths), "decode": lengths}
                num_tokens = {"prefill": lengths, "decode": [1] * len(lengths)}
                for rank, steps in enumerate((on0["steps"], on1["steps"])):
                    assert steps == [expected_step_bytes(config, rank, starts[step],
                                                         num_tokens[step])
                                     for step in ("prefill", "decode")], (where, rank)


def test_llm_starts_its_own_ranks_and_fails_fast_when_one_dies(tmp_path, capsys):
    save_hf(random_model(), tmp_path)
    config = dict(block_size=BLOCK_SIZE, num_blocks=64, device="cpu", log=None)
    expected = [o.token_ids for o in LLM(tmp_path, **config).generate(PROMPTS, GREEDY)]

    # The command line: the same text as tp=1, and the spawned rank gone afterwards.
    flags = ["generate", str(tmp_path), "--prompt", "To be", "--temperature", "0",
             "--max-tokens", "8", "--ignore-eos", "--block-size", "4", "--num-blocks", "64",
             "--device", "cpu"]
    assert main(flags) == 0
    single = capsys.readouterr().out
    assert main(flags + ["--tp", "2"]) == 0
    assert capsys.readouterr().out == single
    assert not multiprocessing.active_children()

    # A rank killed between steps: the next step names it, at once.
    llm = LLM(tmp_path, tp=2, **config)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    os.kill(llm.driver.workers[0].pid, signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(ServingRankError, match="rank 1 died with exit code -9"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert time.perf_counter() - started < 15
    with pytest.raises(ServingRankError, match="stopped after an error"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()

    # A rank that raises: its traceback reaches rank 0. A step only rank 1 runs, whose block
    # copy names a block outside the pool, fails there before any collective.
    llm = LLM(tmp_path, tp=2, **config)
    bad = StepPlan([1], [0], [1], [1], [[0]], copies=[(10**6, 0)])
    llm.driver._send(STEP, bad.sizes(), bad.payload())
    started = time.perf_counter()
    with pytest.raises(ServingRankError, match=r"rank 1 failed: Traceback(.|\n)*IndexError"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert time.perf_counter() - started < 15
    assert not any(worker.is_alive() for worker in llm.driver.workers)
    llm.close()
    assert not multiprocessing.active_children()


def test_tensor_parallel_configuration_errors_name_the_fix():
    model = random_model()  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="tp 3 does not divide num_heads 4.*fit this model: 1, "
                                          "2, 4"):
        LLM(model, ByteTokenizer(), log=None, tp=3)
    assert not multiprocessing.active_children()  # checked before any rank started
    with pytest.raises(ConfigError, match="use --device cuda"):
        serving_device("cuda:1", 2)
    tp = torch.cuda.device_count() + 2
    with pytest.raises(ConfigError, match=f"needs {tp} GPUs.*lower --tp, --pp or --dp or use "
                                          f"--device cpu"):
        serving_device("cuda", tp)
    assert serving_device("cpu", 2).type == "cpu"
