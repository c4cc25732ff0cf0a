"""--recompute sqrt through the trainer on several ranks: pp2 x dp2 (1F1B, each stage cut into its
own segments) and tp2 x dp2 (sequence parallel, ZeRO-3) in one spawned job, against one process
without recomputation (losses to 1e-5 relative, final parameters to 1e-5 absolute: 2 steps
leave AdamW's rounding on near-zero gradients below that), and every rank's counted bytes (what
the forward keeps, what a segment's rerun saves, ZeRO-3's gathered units) and collective bytes
equal the planner's."""

import pytest
import torch
from dist import run_ranks

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import resolve_model
from tetrad.train import checkpoint as ckpt
from tetrad.train.launch import train_worker
from tetrad.train.trainer import train

LAYERS = 5  # segments of 3 and 2 blocks in one process; 2 + 1 and 1 + 1 on the pp stages
RUN = dict(model="tiny", model_overrides={"num_layers": LAYERS}, lr=3e-3, steps=2,
           batch_size=4, seq_len=32, warmup_steps=1, sample_tokens=0)
LAYOUTS = [dict(pp=2, dp=2, schedule="1f1b", microbatches=2, stage_layers=(3, 2)),
           dict(tp=2, dp=2, sequence_parallel=True, zero=3)]


def run_config(corpus_file: str, parallel: ParallelConfig, folder) -> TrainConfig:
    return TrainConfig(**{**RUN, "data": corpus_file, "nproc": parallel.world_size,
                          "parallel": parallel, "checkpoint_dir": str(folder)})


def assert_counted_is_predicted(report) -> None:
    predicted = report["predicted"]
    for entry in report["ranks"]:
        expected = (predicted["stages"][entry["coords"]["pp"]] if "stages" in predicted
                    else predicted)
        assert entry["bytes"] == expected["bytes"], (entry["coords"], expected["bytes"])
        assert entry["bytes"]["recompute_peak"] > 0
        assert entry["comm_bytes"] == {kind: round(value) for kind, value
                                       in expected["comm_bytes"].items()}, entry["coords"]


def layouts_job(rank: int, world_size: int, configs: list[TrainConfig]):
    reports = []
    for config in configs:  # every rank trains; rank 0 returns the reports
        result = train_worker(rank, world_size, config)
        reports.append(result.report if rank == 0 else None)
    return reports


def final_parameters(folder) -> dict[str, torch.Tensor]:
    config = resolve_model("tiny").replace(num_layers=LAYERS)
    _, state = ckpt.load_checkpoint(folder / ckpt.step_folder_name(RUN["steps"]), config)
    return state["model"]


def test_sqrt_under_pp_and_tp_dp_equals_one_process_and_the_planner(corpus_file, tmp_path):
    plain = train(run_config(corpus_file, ParallelConfig(), tmp_path / "plain"),
                  show_progress=False).report
    one = train(run_config(corpus_file, ParallelConfig(recompute="sqrt"), tmp_path / "one"),
                show_progress=False).report
    expected = [step["loss"] for step in plain["steps"]]
    assert [step["loss"] for step in one["steps"]] == expected
    assert_counted_is_predicted(one)
    configs = [run_config(corpus_file, ParallelConfig(**layout, recompute="sqrt"),
                          tmp_path / f"layout{index}") for index, layout in enumerate(LAYOUTS)]
    reports = run_ranks(layouts_job, 4, configs, timeout_s=600)[0]
    reference = final_parameters(tmp_path / "plain")
    for index, report in enumerate(reports):
        assert [step["loss"] for step in report["steps"]] == pytest.approx(expected, rel=1e-5)
        finals = final_parameters(tmp_path / f"layout{index}")
        assert set(finals) == set(reference)
        for name, value in reference.items():
            torch.testing.assert_close(finals[name], value, rtol=0, atol=1e-5,
                                       msg=lambda m: f"{LAYOUTS[index]} {name}: {m}")
        assert_counted_is_predicted(report)
