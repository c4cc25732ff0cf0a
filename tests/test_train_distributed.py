"""`tetrad train --nproc N`: the real trainer on spawned workers gives the single-process losses,
resumes from its own checkpoints, reports every rank; a failing worker stops the job with its
error; bad layouts stop with one line before any process starts."""

import json
import time

import pytest
import torch.distributed as dist

from tetrad.cli.main import main
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.train import checkpoint as ckpt
from tetrad.train import launch
from tetrad.train.trainer import train
from dist import run_ranks

COMMON = ["--model", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "32",
          "--warmup-steps", "2", "--sample-tokens", "0"]


def run_cli(capsys, *argv):
    code = main(["train", *COMMON, *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured


def losses(report):
    return [step["loss"] for step in report["steps"]]


@pytest.fixture(scope="module")
def reference(corpus_file):
    config = TrainConfig(model="tiny", data=corpus_file, steps=6, batch_size=4, seq_len=32,
                         warmup_steps=2, sample_tokens=0, grad_accum=2)
    return train(config, show_progress=False).report


def test_ddp_with_ring_collectives_and_accumulation(capsys, tmp_path, corpus_file, reference):
    report_path = tmp_path / "report.json"
    run_cli(capsys, "--data", corpus_file, "--nproc", "2", "--dp", "2", "--grad-accum", "2",
            "--collectives", "ring", "--report", str(report_path))
    report = json.loads(report_path.read_text())
    assert losses(report) == pytest.approx(losses(reference), rel=1e-5)
    assert [entry["coords"]["dp"] for entry in report["ranks"]] == [0, 1]
    num_params = reference["num_parameters"]
    for entry in report["ranks"]:
        assert entry["bytes"]["params"] == entry["bytes"]["grads"] == 4 * num_params
        # 2(N-1)/N * 4 bytes * params for the gradients; the 8-byte loss sum is reduced to the
        # rank that logs it: (N-1)/N of it.
        assert entry["comm_bytes"]["all_reduce"] == 4 * num_params
        assert entry["comm_bytes"]["reduce"] == 4


def test_zero3_offload_checkpoints_and_resumes(capsys, tmp_path, corpus_file, reference):
    root, report_path = tmp_path / "ckpt", tmp_path / "report.json"
    zero3 = ["--data", corpus_file, "--nproc", "2", "--dp", "2", "--zero", "3", "--offload"]
    run_cli(capsys, *zero3, "--checkpoint-dir", str(root), "--save-every", "3",
            "--report", str(report_path))
    report = json.loads(report_path.read_text())
    assert losses(report) == pytest.approx(losses(reference), rel=1e-5)
    num_params = reference["num_parameters"]
    for entry in report["ranks"]:
        held = entry["bytes"]
        assert (held["params"], held["grads"], held["optimizer"]) == (
            2 * num_params, 2 * num_params, 0)
        assert (held["host_optimizer"], held["host_grads"]) == (6 * num_params, 2 * num_params)
        # (N-1)/N * 4 bytes * params reduce-scattered, twice that all-gathered: 1.5x DDP.
        comm = entry["comm_bytes"]
        assert (comm["reduce_scatter"], comm["all_gather"]) == (2 * num_params, 4 * num_params)
    # The checkpoint holds whole tensors: resuming from step 3 gives the uninterrupted losses.
    (root / "latest").write_text(ckpt.step_folder_name(3))
    run_cli(capsys, *zero3, "--checkpoint-dir", str(root), "--resume",
            "--report", str(report_path))
    resumed = json.loads(report_path.read_text())
    assert [step["step"] for step in resumed["steps"]] == [4, 5, 6]
    assert losses(resumed) == pytest.approx(losses(reference)[3:], rel=1e-5)


def test_the_parallel_flags_train_a_pipelined_tensor_parallel_layout(capsys, tmp_path,
                                                                    corpus_file, reference):
    """Every new flag through argparse, the TOML merge and the launcher: zero-bubble pipeline
    with stages given by --stage-layers, tensor + sequence parallel, recomputation."""
    report_path = tmp_path / "report.json"
    run_cli(capsys, "--data", corpus_file, "--nproc", "4", "--tp", "2", "--pp", "2",
            "--schedule", "zb", "--microbatches", "2", "--stage-layers", "1,1",
            "--sequence-parallel", "--recompute", "selective", "--grad-accum", "2",
            "--report", str(report_path))
    report = json.loads(report_path.read_text())
    assert losses(report) == pytest.approx(losses(reference), rel=1e-5)
    parallel = report["config"]["parallel"]
    assert (parallel["tp"], parallel["pp"], parallel["schedule"], parallel["stage_layers"],
            parallel["sequence_parallel"], parallel["recompute"]) == (
        2, 2, "zb", [1, 1], True, "selective")
    assert [entry["coords"]["pp"] for entry in report["ranks"]] == [0, 0, 1, 1]
    assert all(entry["idle_fraction"] > 0 for entry in report["ranks"])


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank one breaks")
    dist.barrier()  # rank 0 would wait here forever without the launcher's teardown


def test_a_failing_worker_stops_the_job_with_its_error():
    started = time.monotonic()
    with pytest.raises(launch.WorkerFailed, match="rank 1 failed") as failure:
        run_ranks(fail_on_rank_one, 2)
    assert "rank one breaks" in str(failure.value) and "Traceback" in str(failure.value)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc", "3", "--dp", "2"], "3 processes but dp 2"),
    (["--nproc", "4", "--dp", "4", "--batch-size", "6"], "make it a multiple of 4"),
    (["--nproc", "2", "--dp", "2", "--offload"], "--offload needs a ZeRO stage"),
    (["--nproc", "2", "--dp", "2", "--zero", "4"], "invalid choice"),
    (["--nproc", "2", "--dp", "2", "--model", "tinny"], "did you mean tiny"),
])
def test_bad_layouts_fail_before_any_process_starts(capsys, monkeypatch, argv, fragment):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    try:
        code = main(["train", *COMMON, *argv])
    except SystemExit as exit:  # argparse rejects bad choices itself
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err


def test_layout_check_counts_pipeline_microbatches_in_the_batch_split():
    config = TrainConfig(model="tiny", batch_size=12, nproc=4,
                         parallel=ParallelConfig(dp=2, pp=2, microbatches=4))
    with pytest.raises(Exception, match="dp 2 x grad-accum 1 x microbatches 4 .* multiple of 8"):
        launch.check_layout(config, 4)
    launch.check_layout(TrainConfig(model="tiny", batch_size=16, nproc=4,
                                    parallel=ParallelConfig(dp=2, pp=2, microbatches=4)), 4)
