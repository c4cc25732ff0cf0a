"""`tetrad train --strategy ps` through the real CLI and launcher: sync mode reproduces the
single-process run, ssp trains, and bad layouts cost one line before any process starts."""

import json

import pytest

from tetrad.cli.main import main

COMMON = ["--model", "tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "32",
          "--warmup-steps", "2", "--sample-tokens", "0", "--log-every", "1"]


def train_report(tmp_path, corpus_file, name, *argv) -> dict:
    report = tmp_path / f"{name}.json"
    assert main(["train", *COMMON, "--data", corpus_file, "--report", str(report), *argv]) == 0
    return json.loads(report.read_text())


def losses(report: dict) -> list[float]:
    return [step["loss"] for step in report["steps"]]


def test_sync_ps_equals_one_process_and_ssp_trains(tmp_path, corpus_file):
    single = train_report(tmp_path, corpus_file, "single")
    # No --dp: the workers are the processes that are not servers.
    sync = train_report(tmp_path, corpus_file, "sync", "--strategy", "ps", "--nproc", "3",
                        "--servers", "1")
    assert len(losses(sync)) == 5
    for a, b in zip(losses(sync), losses(single)):
        assert abs(a - b) <= 1e-5 * abs(b), (losses(sync), losses(single))
    assert [(e["rank"], e["role"]) for e in sync["ranks"]] == [
        (0, "worker"), (1, "worker"), (2, "server")]
    summary = sync["parameter_server"]
    assert (summary["mode"], summary["num_workers"], summary["num_servers"]) == ("sync", 2, 1)
    assert summary["clocks"] == {"0": 5, "1": 5} and summary["update_lag"]["max"] == 0

    ssp = train_report(tmp_path, corpus_file, "ssp", "--strategy", "ps", "--nproc", "3",
                       "--dp", "2", "--servers", "1", "--ps-mode", "ssp", "--staleness", "1",
                       "--steps", "12")
    ssp_losses = losses(ssp)
    assert len(ssp_losses) == 12
    assert sum(ssp_losses[-3:]) / 3 < ssp_losses[0] - 0.3, ssp_losses
    assert ssp["parameter_server"]["staleness_bound"] == 1
    assert ssp["parameter_server"]["staleness"]["max"] <= 1


@pytest.mark.parametrize("argv, fragment", [
    (["--strategy", "ps", "--nproc", "2", "--dp", "2"], "needs --servers 1 or more"),
    (["--strategy", "ps", "--nproc", "4", "--dp", "2", "--servers", "1"],
     "make --nproc (or torchrun's world size) dp + servers, e.g. --dp 3"),
    (["--strategy", "ps", "--nproc", "3", "--tp", "2", "--servers", "1"],
     "data parallel only (--dp workers + --servers): drop --tp 2"),
    (["--strategy", "ps", "--nproc", "3", "--dp", "2", "--servers", "1", "--staleness", "2"],
     "--staleness bounds --ps-mode ssp only"),
    (["--servers", "1", "--nproc", "2", "--dp", "2"], "add --strategy ps"),
])
def test_bad_ps_layouts_cost_one_line(capsys, corpus_file, argv, fragment):
    code = main(["train", *COMMON, "--data", corpus_file, *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err


@pytest.mark.parametrize("argv, dp", [
    (["--strategy", "ps", "--nproc", "4", "--servers", "1"], 3),
    (["--strategy", "ps", "--nproc", "5", "--servers", "2"], 3),
    (["--strategy", "ps", "--nproc", "4", "--servers", "1", "--dp", "2"], 2),  # as typed
    (["--nproc", "4", "--dp", "4"], 4),
])
def test_ps_workers_are_the_processes_that_are_not_servers(argv, dp):
    from tetrad.cli.main import build_parser
    from tetrad.spec.model import build_train_config

    args = vars(build_parser().parse_args(["train", *argv]))
    overrides = {k: v for k, v in args.items() if k not in ("command", "run", "config")}
    assert build_train_config(None, overrides).parallel.dp == dp
