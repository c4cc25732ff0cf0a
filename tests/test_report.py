"""Predicted vs measured: real short trainings, whose run reports must carry the planner's
prediction of every byte field and collective kind, equal to the measurement (the planner counts
tetrad's own runtime tensor by tensor: tetrad.planner.eager); and `tetrad report`, which prints
and draws the comparison."""

import json

import pytest

from tetrad.cli.main import main
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.planner import predict_training
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import ActivationOptions, training_memory
from tetrad.planner.precision import training_precision
from tetrad.spec.presets import preset
from tetrad.train.launch import train_worker
from tetrad.train.trainer import train
from tetrad.viz.report import comparison, format_report, rank_kinds
from dist import run_ranks

RUN = dict(steps=2, batch_size=4, seq_len=32, warmup_steps=1, sample_tokens=0)


def run_one(corpus_file, **overrides):
    config = TrainConfig(**{"model": "tiny", "data": corpus_file, **RUN, **overrides})
    return train(config, show_progress=False).report


def assert_bytes_equal(report, ids_slack=0):
    """Every byte field the rank measured is predicted, exactly; activations may exceed the
    prediction by `ids_slack`."""
    predicted = report["predicted"]["bytes"]
    for entry in report["ranks"]:
        measured = entry["bytes"]
        assert set(measured) == set(predicted)
        for field, value in measured.items():
            if field == "activations_peak":
                assert 0 <= value - predicted[field] <= ids_slack, (field, value, predicted)
                assert predicted[field] == pytest.approx(value, rel=0.05)
            else:
                assert predicted[field] == value, (field, value, predicted[field])


@pytest.mark.parametrize("overrides", [
    dict(), dict(dtype="bf16"), dict(dtype="fp16", grad_accum=2), dict(model="tiny-moe"),
    dict(model="tiny-moe", dtype="bf16", model_overrides={"num_dense_layers": 1}),
    dict(dtype="fp8"), dict(model="tiny-moe", dtype="fp8"),
    dict(model="tiny-moe", dtype="fp8", fp8_recipe="tensor"),
    dict(model_overrides={"norm": "layernorm", "bias": True, "position": "learned",
                          "mlp": "gelu", "tie_embeddings": True}),
], ids=["fp32", "bf16", "fp16-accum", "moe", "moe-bf16", "fp8", "moe-fp8", "moe-fp8-tensor",
        "gpt2-style"])
def test_single_process_prediction_is_exact(corpus_file, overrides):
    report = run_one(corpus_file, **overrides)
    assert report["predicted"]["runtime"] == "tetrad"
    assert_bytes_equal(report)
    assert set(report["ranks"][0]["comm_bytes"].values()) == {0}
    assert set(report["predicted"]["comm_bytes"].values()) == {0}


ZERO_CASES = [dict(zero=0, grad_accum=2), dict(zero=1, dtype="bf16"),
              dict(zero=2, grad_accum=2, offload=True), dict(zero=3),
              dict(zero=3, dtype="bf16", offload=True, model="tiny-moe"),
              dict(zero=1, dtype="fp8", model="tiny-moe")]


def train_zero_cases(rank, world_size, corpus_file):
    reports = []
    for case in ZERO_CASES:
        case = dict(case)
        parallel = ParallelConfig(dp=2, zero=case.pop("zero"), offload=case.pop("offload", False))
        config = TrainConfig(**{"model": "tiny", "data": corpus_file, **RUN, **case,
                                "nproc": 2, "parallel": parallel})
        result = train_worker(rank, world_size, config)
        reports.append(result.report if rank == 0 else None)
    return reports


@pytest.fixture(scope="module")
def zero_reports(corpus_file):
    return run_ranks(train_zero_cases, 2, corpus_file)[0]


@pytest.mark.parametrize("index", range(len(ZERO_CASES)),
                         ids=[f"zero{c['zero']}" + "".join(f"-{k}" for k in c if k != "zero")
                              for c in ZERO_CASES])
def test_two_ranks_prediction_matches(zero_reports, index):
    report = zero_reports[index]
    config = report["config"]
    # On CPU each rank's token ids are views of the whole global batch, which the embedding
    # keeps; the planner counts this rank's rows (what a GPU rank copies to its device).
    global_ids = config["batch_size"] * (config["seq_len"] + 1) * 8
    assert_bytes_equal(report, ids_slack=global_ids // 2)
    predicted = report["predicted"]["comm_bytes"]
    for entry in report["ranks"]:
        assert {kind: round(v) for kind, v in predicted.items()} == entry["comm_bytes"]
    assert predicted["all_reduce"] > 0  # the logged loss at least


def test_report_prints_the_table_and_draws(zero_reports, tmp_path, capsys):
    path, png = tmp_path / "run.json", tmp_path / "run.png"
    path.write_text(json.dumps(zero_reports[3]))  # ZeRO-3
    assert main(["report", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ranks 0, 1" in out and "dp 2, zero 3" in out
    for row in ("bytes params ", "bytes params_gathered_peak", "bytes activations_peak",
                "comm reduce_scatter", "comm all_gather", "idle_fraction"):
        assert row in out, row
    gathered = next(line for line in out.splitlines() if "params_gathered_peak" in line)
    assert gathered.split()[-1] == "exact"
    activations = next(line for line in out.splitlines() if "activations_peak" in line)
    assert activations.split()[-1].endswith("%")  # the CPU token-id slack, a fraction of 1%
    assert "loss: first" in out and "validation" in out and "no hardware profile" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_relative_errors_and_rank_kinds_of_a_pipeline_report():
    """Stages differ in what they hold: one kind each, and only the fullest stage (the one the
    planner predicts) is compared; a 10% miss reads +10.00%."""
    def entry(rank, pp, params):
        return {"rank": rank, "coords": {"dp": rank % 2, "pp": pp}, "idle_fraction": 0.1 * rank,
                "bytes": {"params": params, "activations_peak": 1000},
                "comm_bytes": {"p2p": 500, "all_reduce": 0}, "comm_exposed_s": 0.01 * rank}
    report = {"schema": 1, "config": {"parallel": {"dp": 2, "pp": 2}}, "steps": [],
              "ranks": [entry(0, 0, 100), entry(1, 0, 100), entry(2, 1, 80), entry(3, 1, 80)],
              "predicted": {"bytes": {"params": 110, "activations_peak": 1000},
                            "comm_bytes": {"p2p": 500}, "fullest_stage": 0,
                            "idle_fraction": 0.2, "comm_exposed_s": 0.005}}
    kinds = rank_kinds(report)
    assert [ranks for ranks, _ in kinds] == [[0, 1], [2, 3]]
    assert kinds[1][1]["idle_fraction"] == pytest.approx(0.3)  # the kind's slowest rank
    first = {row["field"]: row for row in comparison(report, kinds[0][1])}
    assert first["params"]["error"] == pytest.approx(0.1)
    # Exposed communication: the kind's longest wait (rank 1's) against the prediction.
    assert first["comm_exposed_s"]["measured"] == pytest.approx(0.01)
    assert first["comm_exposed_s"]["error"] == pytest.approx(-0.5)
    assert first["activations_peak"]["error"] == 0 and "all_reduce" not in first
    assert all(row["predicted"] is None for row in comparison(report, kinds[1][1]))
    text = format_report(report)
    assert "+10.00%" in text and "ranks 2, 3 (pp 1)" in text
    exposed = next(line for line in text.splitlines() if "comm_exposed_s" in line)
    assert exposed.split()[1:] == ["0.0050", "s", "0.0100", "s", "-50.0%"]
    refused = format_report({**report, "predicted": {"error": "pp 2 does not divide 3 layers"}})
    assert "prediction: none (the planner: pp 2 does not divide 3 layers)" in refused


def test_report_rejects_what_is_not_a_run_report(tmp_path, capsys):
    (tmp_path / "other.json").write_text('{"mode": "train"}')
    for path in (tmp_path / "missing.json", tmp_path / "other.json"):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tetrad report: error:") and "Traceback" not in err


def test_megatrons_accounting_on_request():
    """The profile covers every layout tetrad trains (tests/test_report_layouts.py);
    runtime="megatron" (the published runs' calibration, tests/test_planner_accuracy.py) takes
    Megatron's accounting instead, the fullest stage only."""
    small = preset("small")
    layout = dict(micro_batch=2, seq_len=64, num_microbatches=2)
    profiled = predict_training(small, ParallelConfig(tp=2, pp=2), **layout)
    asked = predict_training(small, ParallelConfig(tp=2, pp=2), **layout, runtime="megatron")
    assert profiled["runtime"] == "tetrad" and len(profiled["stages"]) == 2
    assert asked["runtime"] == "megatron" and "stages" not in asked
    memory, stage = training_memory(small, TrainLayout(tp=2, pp=2, micro_batch=2,
                                                       microbatches=2),
                                    training_precision("fp32"), 64, ActivationOptions())
    assert asked["fullest_stage"] == stage
    assert asked["bytes"]["activations_peak"] == memory.activations
    assert asked["bytes"] != profiled["bytes"]


def test_a_rank_kind_is_labelled_only_by_the_coordinates_its_ranks_share():
    from tetrad.viz.report import shared_coords

    report = {"config": {"parallel": {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1}},
              "ranks": [{"rank": rank, "coords": {"dp": (rank // 2) % 2, "pp": rank // 4,
                                                  "cp": 0, "tp": rank % 2, "ep": 0}}
                        for rank in range(8)]}
    assert shared_coords(report, [0, 1, 2, 3]) == {"pp": 0}
    assert shared_coords(report, [4, 6]) == {"pp": 1, "tp": 0}
    assert shared_coords(report, [4, 5]) == {"dp": 0, "pp": 1}
