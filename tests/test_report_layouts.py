"""Predicted vs measured beyond whole-model replicas: real short trainings under tensor (and
sequence), pipeline (1F1B, interleaved, zero bubble, GPipe; first, middle and last stages), context
and expert parallelism, recomputation and ZeRO 1-3 (under a pipeline too: per-stage buckets and
units, a tied embedding's shards summed once per step), alone and combined. Their run reports must
carry the
`tetrad` runtime profile's prediction (tetrad.planner.eager) of every byte field and collective
kind of every rank, and of its collective calls by kind, each pipeline stage its own, equal to
the measurement. What routing decides
(expert parallelism: each rank's share of the routed tokens) is predicted for a balanced router:
there the ep group's total is exact. Each world size is one spawn running its cases in turn."""

import pytest

from dist import run_ranks
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.train.launch import train_worker
from tetrad.viz.report import format_report, predicted_for

RUN = dict(steps=2, batch_size=4, seq_len=32, warmup_steps=1, sample_tokens=0)
FOUR_LAYERS = {"num_layers": 4}
TIED = {"tie_embeddings": True}
GPT2_STYLE = {"norm": "layernorm", "bias": True, "position": "learned", "mlp": "gelu",
              "tie_embeddings": True}

# world size -> name -> TrainConfig fields (model "tiny" unless given), "parallel" a ParallelConfig.
CASES = {
    2: {
        "tp2 sp bf16": dict(dtype="bf16", parallel=dict(tp=2, sequence_parallel=True)),
        "tp2 sp gpt2-style": dict(model_overrides=GPT2_STYLE,
                                  parallel=dict(tp=2, sequence_parallel=True)),
        "pp2 1f1b": dict(parallel=dict(pp=2)),
        "pp2 interleaved": dict(model_overrides=FOUR_LAYERS,
                                parallel=dict(pp=2, schedule="interleaved", vpp=2)),
        "cp2": dict(parallel=dict(cp=2)),
        "cp2 bf16 full": dict(dtype="bf16", parallel=dict(cp=2, recompute="full")),
        # FP8 linears on tp shards (the gathered sequence's FP8 copies) and after ring attention.
        "tp2 sp fp8": dict(dtype="fp8", parallel=dict(tp=2, sequence_parallel=True)),
        "tp2 fp8 tensor": dict(dtype="fp8", fp8_recipe="tensor", parallel=dict(tp=2)),
        "cp2 fp8": dict(dtype="fp8", parallel=dict(cp=2)),
        "dp2 full": dict(parallel=dict(dp=2, recompute="full")),
        "dp2 selective": dict(parallel=dict(dp=2, recompute="selective")),
        # One step, one microbatch: each rank's peak is one forward, so the ep group's sum of
        # peaks is the dropless total.
        "dp2 ep2 moe": dict(model="tiny-moe", steps=1, parallel=dict(dp=2, ep=2)),
    },
    4: {
        "pp2 tp2 zb full": dict(parallel=dict(pp=2, tp=2, schedule="zb", microbatches=4,
                                              recompute="full")),
        # W shares B's walk here: the backward's tp collectives run once (backward_walks).
        "pp2 tp2 zbv": dict(model_overrides={"num_layers": 4},
                            parallel=dict(pp=2, tp=2, schedule="zbv", vpp=2, microbatches=4)),
        "pp2 cp2 gpipe tied": dict(model_overrides={"tie_embeddings": True},
                                   parallel=dict(pp=2, cp=2, schedule="gpipe")),
        "pp2 dp2 zero1 bf16 uneven": dict(dtype="bf16", model_overrides=FOUR_LAYERS,
                                          parallel=dict(pp=2, dp=2, zero=1,
                                                        stage_layers=(1, 3))),
        # kv heads (2) < tp: replicated kv rows summed over tp with SP's norms, every microbatch.
        "tp4 zero2 sp accum": dict(grad_accum=2, parallel=dict(tp=4, zero=2,
                                                               sequence_parallel=True)),
        "dp2 tp2 zero3 bf16 gpt2-style": dict(dtype="bf16", model_overrides=GPT2_STYLE,
                                              parallel=dict(dp=2, tp=2, zero=3)),
        # ZeRO-2/3 under a pipeline: per (stage, microbatch) reduce-scatters, per-stage buckets
        # and units, the tied embedding's copies alone in a bucket / unit of their own.
        "pp2 dp2 zero2 1f1b tied": dict(model_overrides=TIED, parallel=dict(pp=2, dp=2, zero=2)),
        "pp2 dp2 zero2 interleaved tied bf16 offload": dict(
            dtype="bf16", model_overrides={**FOUR_LAYERS, **TIED},
            parallel=dict(pp=2, dp=2, zero=2, schedule="interleaved", vpp=2, offload=True)),
        "pp2 dp2 zero3 gpipe": dict(parallel=dict(pp=2, dp=2, zero=3, schedule="gpipe")),
        "pp2 dp2 zero3 gpipe fp8": dict(dtype="fp8",
                                        parallel=dict(pp=2, dp=2, zero=3, schedule="gpipe")),
        # Zero bubble's W gathers every unit again, but on the first stage (whose B is empty).
        "pp2 dp2 zero3 zb": dict(batch_size=8, parallel=dict(pp=2, dp=2, zero=3, schedule="zb",
                                                             microbatches=4)),
        "pp2 dp2 zero3 full gpt2-style": dict(model_overrides=GPT2_STYLE,
                                              parallel=dict(pp=2, dp=2, zero=3,
                                                            recompute="full")),
        # The last stage's tied copy is a root unit, gathered around its forwards and its W.
        "pp2 cp2 zero3 zb tied": dict(model_overrides=TIED,
                                      parallel=dict(pp=2, cp=2, zero=3, schedule="zb")),
        # Gradient accumulation: the tied gradient (ZeRO-2: its shards) summed once per step.
        "pp2 dp2 zero1 tied accum": dict(batch_size=8, grad_accum=2, model_overrides=TIED,
                                         parallel=dict(pp=2, dp=2, zero=1)),
        "pp2 dp2 zero2 zb tied fp16 accum": dict(batch_size=8, dtype="fp16", grad_accum=2,
                                                 model_overrides=TIED,
                                                 parallel=dict(pp=2, dp=2, zero=2,
                                                               schedule="zb")),
        # One step, one microbatch: the ep group's sum of peaks is the dropless total.
        "pp2 dp2 ep2 zero3 moe": dict(model="tiny-moe", steps=1,
                                      parallel=dict(pp=2, dp=2, ep=2, zero=3, schedule="gpipe",
                                                    microbatches=1)),
    },
    8: {
        "dp2 tp2 pp2": dict(parallel=dict(dp=2, tp=2, pp=2)),
        "dp2 tp2 sp pp2 interleaved zero1 bf16 selective": dict(
            dtype="bf16", model_overrides=FOUR_LAYERS,
            parallel=dict(dp=2, tp=2, pp=2, sequence_parallel=True, schedule="interleaved",
                          vpp=2, zero=1, recompute="selective")),
        "dp2 tp2 sp pp2 zb zero3 tied bf16": dict(
            batch_size=8, dtype="bf16", model_overrides=TIED,
            parallel=dict(dp=2, tp=2, pp=2, sequence_parallel=True, schedule="zb",
                          microbatches=4, zero=3)),
    },
}
NAMES = [(size, name) for size, cases in CASES.items() for name in cases]


def config_of(case: dict, world_size: int, corpus_file: str) -> TrainConfig:
    case = dict(case)
    parallel = ParallelConfig(**case.pop("parallel"))
    return TrainConfig(**{"model": "tiny", "data": corpus_file, **RUN, **case,
                          "nproc": world_size, "parallel": parallel})


def train_cases(rank, world_size, corpus_file):
    reports = {}
    for name, case in CASES[world_size].items():
        result = train_worker(rank, world_size, config_of(case, world_size, corpus_file))
        reports[name] = result.report if rank == 0 else None
    return reports


@pytest.fixture(scope="module")
def reports(corpus_file):
    """World size -> name -> run report, each world size spawned once, when first asked for."""
    spawned = {}

    def of(world_size):
        if world_size not in spawned:
            spawned[world_size] = run_ranks(train_cases, world_size, corpus_file,
                                            timeout_s=600)[0]
        return spawned[world_size]
    return of


def cpu_token_ids(report) -> int:
    """On CPU the embedding of a data-parallel rank without a pipeline, tensor or context
    parallelism keeps a view of the whole global batch's token ids; the profile counts the
    rank's rows (what a GPU rank copies to its device)."""
    config, parallel = report["config"], report["config"]["parallel"]
    if parallel["pp"] > 1 or parallel["tp"] > 1 or parallel["cp"] > 1:
        return 0
    whole = config["batch_size"] * (config["seq_len"] + 1) * 8
    return whole - whole // parallel["dp"]


@pytest.mark.parametrize("size, name", NAMES, ids=[name for _, name in NAMES])
def test_every_rank_is_predicted(reports, size, name):
    report = reports(size)[name]
    assert report["predicted"]["runtime"] == "tetrad"
    routed = report["config"]["parallel"]["ep"] > 1
    slack = cpu_token_ids(report)
    activations = []
    for entry in report["ranks"]:
        predicted = predicted_for(report, entry)
        measured = entry["bytes"]
        assert set(measured) == set(predicted["bytes"]), entry["rank"]
        for field, value in measured.items():
            if field == "activations_peak":
                activations.append((predicted["bytes"][field], value))
                if not routed:
                    assert value == round(predicted["bytes"][field]) + slack, entry["rank"]
            else:
                assert value == round(predicted["bytes"][field]), (entry["rank"], field)
        for kind, value in entry["comm_bytes"].items():
            expected = predicted["comm_bytes"][kind]
            if routed and kind == "all_to_all":
                # Which copies cross ranks is the router's: balanced here.
                assert value == pytest.approx(expected, rel=0.05), (entry["rank"], kind)
            else:
                assert value == round(expected), (entry["rank"], kind, value, expected)
        # Call by call, as the time model prices them (routing changes no call).
        assert entry["comm_calls"] == predicted["comm_calls"], entry["rank"]
    if routed:  # dropless: the group's routed copies add up, whatever each rank's share
        predicted_total = sum(round(predicted) + slack for predicted, _ in activations)
        assert sum(measured for _, measured in activations) == predicted_total


def test_the_report_compares_every_pipeline_stage_with_its_own_prediction(reports):
    report = reports(2)["pp2 1f1b"]
    text = format_report(report)
    assert "bytes of every pipeline stage" in text
    assert "rank 1 (pp 1)" in text
    table = text.split("rank 1 (pp 1)")[1]
    for row in ("bytes params ", "bytes activations_peak", "comm p2p", "comm all_reduce",
                "calls p2p", "calls all_reduce"):
        line = next(line for line in table.splitlines() if row in line)
        assert line.split()[-1] == "exact", line
    stages = report["predicted"]["stages"]
    assert stages[0]["bytes"] != stages[1]["bytes"]  # embedding and ids vs head and loss
