"""Faults in a real `tetrad train --nproc 2` job: a worker SIGKILLed mid-run takes the launcher
down promptly with an error naming the dead rank, and `--resume` from the last complete
checkpoint continues with exactly the losses of the run that was never interrupted."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tetrad.train import checkpoint as ckpt

REPO = Path(__file__).resolve().parent.parent
STEPS = 40
EXIT_BOUND_S = 60.0  # the launcher notices a dead child itself; no collective timeout needed


def command(corpus_file, root, report, *extra):
    return [sys.executable, "-m", "tetrad", "train", "--model", "tiny", "--nproc", "2",
            "--dp", "2", "--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32",
            "--save-every", "2", "--checkpoint-dir", str(root), "--sample-tokens", "0",
            "--data", corpus_file, "--report", str(report), *extra]


def children(pid):
    """The child processes of `pid`, from /proc (psutil is not a dependency)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # The fields after the parenthesized name: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), cmdline))
    return found


def workers(launcher_pid):
    """The launcher's worker processes in rank order (started one after the other); the
    multiprocessing resource tracker is a child too, but not a worker."""
    return sorted(pid for pid, cmdline in children(launcher_pid) if "spawn_main" in cmdline)


def latest_step(root):
    try:
        name = (root / ckpt.LATEST).read_text().strip()
    except OSError:
        return 0
    return int(name.removeprefix("step_")) if name.startswith("step_") else 0


def losses(report):
    return {step["step"]: step["loss"] for step in json.loads(report.read_text())["steps"]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_stops_the_job_naming_its_rank_and_resume_matches(corpus_file,
                                                                         tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    root = tmp_path / "ckpt"
    killed_report = tmp_path / "killed.json"
    launcher = subprocess.Popen(command(corpus_file, root, killed_report), cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while latest_step(root) < 2:
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint of step >= 2 within 30 s"
            time.sleep(0.005)
        ranks = workers(launcher.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=EXIT_BOUND_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert time.monotonic() - killed_at < EXIT_BOUND_S
    assert launcher.returncode != 0, stderr
    assert re.search(r"rank 1 died with exit code -9", stderr), stderr
    last = latest_step(root)
    assert 2 <= last < STEPS

    resumed_report = tmp_path / "resumed.json"
    resumed = subprocess.run(command(corpus_file, root, resumed_report, "--resume"), cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=EXIT_BOUND_S)
    assert resumed.returncode == 0, resumed.stderr
    whole_report = tmp_path / "whole.json"
    whole = subprocess.run(command(corpus_file, tmp_path / "whole", whole_report), cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=EXIT_BOUND_S)
    assert whole.returncode == 0, whole.stderr

    resumed_losses, whole_losses = losses(resumed_report), losses(whole_report)
    assert min(resumed_losses) == last + 1
    assert sorted(resumed_losses) == list(range(last + 1, STEPS + 1))
    assert [resumed_losses[step] for step in sorted(resumed_losses)] == pytest.approx(
        [whole_losses[step] for step in sorted(resumed_losses)], rel=1e-5)
