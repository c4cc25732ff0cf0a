"""Serving under pipeline, expert and data parallelism (tetrad.inference.ranks.layout) against the
one-process engine, in fp32, on the tiny random DeepSeek-V3 (MLA, 8 routed experts and a shared
one, a dense first layer) and the tiny dense model.

Two spawned jobs (tests/dist.py; the LLM on rank 0, ServingWorker on the others) run ep2·dp2,
pp2, tp2·ep2 (a MoE model with plain attention) and tp2 (MLA split by heads, every expert whole
on each rank), then ep4·dp4, ep2·dp4 and tp2·pp2, each with
chunked prefill (7 tokens a step) and a pool of 12 blocks, which forces preemptions by recompute.
For each: greedy outputs equal one process token for token; each rank holds exactly the weight
bytes and KV bytes per token the planner predicts for its place in the layout
(ranks.layout.planned_bytes, the planner's formulas; rank_share.held_bytes counts the parameters
and the pool); under data parallelism every rank's pool was written (the requests were spread),
and with experts over dp ranks every rank sent tokens to the others' experts."""

import pytest
from dist import run_ranks
from test_engine import GREEDY, PROMPTS, random_model

from tetrad.errors import ConfigError
from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.ranks.data_parallel import DataParallelScheduler
from tetrad.inference.engine import LLM
from tetrad.inference.ranks.layout import planned_bytes
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.ranks.rank_share import held_bytes
from tetrad.inference.ranks.driver import ServingWorker
from tetrad.inference.core.scheduler import SchedulerConfig
from tetrad.spec.presets import resolve_model
from tetrad.spec.serving import ServeLayout
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
transformers = pytest.importorskip("transformers")
from deepseek_models import hf_model  # noqa: E402

# A MoE model with plain attention.
MOE = dict(num_experts=4, num_experts_per_token=2, num_shared_experts=1, moe_ffn_hidden_size=64)
LAYOUTS = {  # name -> (model, layout); grouped by world size into one job each
    2: {"ep2-dp2": ("deepseek", ServeLayout(ep=2, dp=2)),
        "pp2": ("deepseek", ServeLayout(pp=2)),
        "tp2-ep2": ("moe", ServeLayout(tp=2, ep=2)),
        # MLA split by heads, each rank's pool the whole latent; routed experts whole per rank
        "tp2": ("deepseek", ServeLayout(tp=2))},
    4: {"ep4-dp4": ("deepseek", ServeLayout(ep=4, dp=4)),
        "ep2-dp4": ("deepseek", ServeLayout(ep=2, dp=4)),  # two expert groups of two ranks
        "tp2-pp2": ("dense", ServeLayout(tp=2, pp=2))},
}


def engine_config(layout: ServeLayout = ServeLayout()) -> dict:
    return dict(block_size=4, num_blocks=12, max_num_batched_tokens=7, device="cpu",
                dtype="fp32", log=None, tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.dp)


def model_object(model: str):
    return random_model(**(MOE if model == "moe" else {}))


def engine(model: str, folder: str, **config) -> LLM:
    if model == "deepseek":
        return LLM(folder, **config)
    return LLM(model_object(model), ByteTokenizer(), **config)


def rank_counts(runner) -> dict:
    """What this rank holds, counted, and whether its pool was written."""
    return {**held_bytes(runner), "pool_written": bool(runner.kv_cache.pool.count_nonzero())}


def rank_main(rank: int, world_size: int, folder: str) -> list[dict]:
    results = []
    for model, layout in LAYOUTS[world_size].values():
        if rank == 0:
            llm = engine(model, folder, **engine_config(layout))
            outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            result = {"outputs": outputs, "preemptions": llm.scheduler.num_preemptions,
                      "used_blocks": llm.block_manager.num_used_blocks,
                      "ranks": llm.driver.ranks, **rank_counts(llm.runner)}
            llm.close()
        else:
            worker = ServingWorker(folder if model == "deepseek" else model_object(model))
            worker.serve()
            result = {"ranks": worker.ranks, **rank_counts(worker.runner)}
        ranks = result.pop("ranks")
        result.update(coords=ranks.coords,
                      expert_bytes=ranks.comm.counter.totals(("experts",)).get("all_to_all", 0))
        results.append(result)
    return results


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek")
    hf_model("v3").save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_equal_one_process_and_hold_the_planned_bytes(world_size, deepseek_folder):
    per_rank = run_ranks(rank_main, world_size, deepseek_folder, timeout_s=240)
    configs = {"deepseek": resolve_model(deepseek_folder), "dense": model_object("dense").config,
               "moe": model_object("moe").config}
    for case, (where, (model, layout)) in enumerate(LAYOUTS[world_size].items()):
        config = configs[model]
        on = [results[case] for results in per_rank]
        reference = [o.token_ids for o in engine(model, deepseek_folder, **engine_config())
                     .generate(PROMPTS, GREEDY)]
        assert on[0]["outputs"] == reference, where
        assert on[0]["used_blocks"] == 0, where
        if layout.dp < 4:  # spread over four pools, the prompts fit
            assert on[0]["preemptions"] > 0, where
        for rank, result in enumerate(on):
            planned = planned_bytes(layout, config, "fp32", result["coords"]["pp"])
            assert result["weights"] == planned["weights"], (where, rank)
            assert result["kv_per_token"] == planned["kv_per_token"], (where, rank)
            if layout.dp > 1:
                assert result["pool_written"], (where, rank)
            if layout.ep > 1 and layout.tp == 1:  # (inside a tp group no token travels)
                assert result["expert_bytes"] > 0, (where, rank)


def test_layouts_the_engine_cannot_run_are_refused_in_one_line(deepseek_folder):
    model = random_model()
    for degrees, message in [
            (dict(dp=2, tp=2), "data-parallel serving runs with tp 1 and pp 1"),
            (dict(ep=2), "--ep 2 needs --dp 2"),
            (dict(ep=2, dp=2), "needs a mixture-of-experts model"),
            (dict(ep=2, dp=3), r"--ep 2 needs --dp 2 \(or a multiple\)"),
            (dict(ep=2, tp=4), "experts spread inside a tensor-parallel group need --ep 4"),
            (dict(pp=3), "pp 3 is more than the model's 2 layers"),
            (dict(pp=0), "pp must be > 0")]:
        with pytest.raises(ConfigError, match=message):
            LLM(model, ByteTokenizer(), log=None, device="cpu", **degrees)
    with pytest.raises(ConfigError, match="ep 3 does not divide num_experts 8"):
        LLM(deepseek_folder, log=None, device="cpu", ep=3, dp=3)


def test_the_data_parallel_scheduler_keeps_each_request_on_one_rank():
    """Requests go to the least busy rank and stay there; rows of the merged batch are offset by
    the earlier ranks' samples; aborts and finishes reach the owner and free its blocks."""
    scheduler = DataParallelScheduler(SchedulerConfig(max_model_len=64),
                                      lambda: BlockManager(16, 4), dp=2)
    first, second = scheduler.schedulers
    params = SamplingParams(max_tokens=4)
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6])):
        scheduler.add_request(request_id, prompt, params)
    assert [s.request_id for s in first.waiting] == ["a", "c"]
    assert [s.request_id for s in second.waiting] == ["b"]
    batch = scheduler.schedule()
    assert [part.seqs for part in batch.parts] == [first.running, second.running]
    assert [seq.request_id for seq in batch.seqs] == ["a", "c", "b"]
    # Each rank numbers its own blocks from the same pool size.
    assert [plan.tables for plan in batch.plans(4)] == [[[0], [1]], [[0]]]
    assert [(seq.request_id, row) for seq, row in scheduler.advance(batch)] == [
        ("a", 0), ("c", 1), ("b", 2)]
    assert scheduler.block_manager.num_used_blocks == 3
    assert [s.request_id for s in scheduler.abort("c")] == ["c"]
    assert scheduler.abort("c") == []
    finished = scheduler.append_tokens([(second.running[0], 9)], eos_token_ids=(9,))
    assert [seq.request_id for seq in finished] == ["b"] and not second.has_unfinished()
    assert scheduler.block_manager.num_used_blocks == 1
    assert scheduler.owner.keys() == {"a"}
