"""Faults in a real `tetrad train --nproc 2` job: a worker SIGKILLed mid-run takes the launcher
down promptly with an error naming the dead rank, and `--resume` from the last complete
checkpoint continues with exactly the losses of the run that was never interrupted; SIGTERM and
Ctrl-C save the step in flight, and resuming from it matches too."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tetrad.train import checkpoint as ckpt
from tetrad.train.stop import StopRequest

REPO = Path(__file__).resolve().parent.parent
STEPS = 16
EXIT_BOUND_S = 60.0  # the launcher notices a dead child itself; no collective timeout needed
RUN_BOUND_S = 600.0  # a whole run on a loaded 2-core machine


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


@pytest.fixture(scope="module")
def uninterrupted(corpus_file, tmp_path_factory):
    """The losses of the run nothing interrupts, by step."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    whole = subprocess.run(command(corpus_file, folder / "ckpt", folder / "whole.json"), cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                           text=True, timeout=RUN_BOUND_S)
    assert whole.returncode == 0, whole.stderr
    return losses(folder / "whole.json")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_stops_the_job_naming_its_rank_and_resume_matches(corpus_file,
                                                                         tmp_path, uninterrupted):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    root = tmp_path / "ckpt"
    killed_report = tmp_path / "killed.json"
    launcher = subprocess.Popen(command(corpus_file, root, killed_report), cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        while latest_step(root) < 2:
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint of step >= 2"
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
                             env=env, capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert resumed.returncode == 0, resumed.stderr

    resumed_losses = losses(resumed_report)
    assert sorted(resumed_losses) == list(range(last + 1, STEPS + 1))
    assert resumed_losses == {step: uninterrupted[step] for step in resumed_losses}


def signalled_run(argv, root, env, at_least, send):
    """Start `argv` in a session of its own, wait for a checkpoint of step >= `at_least`, `send`
    it a signal: (exit status, the step `latest` named when it was sent, stderr)."""
    launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        while latest_step(root) < at_least:
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, f"no checkpoint of step >= {at_least}"
            time.sleep(0.005)
        sent_at = latest_step(root)
        send(launcher.pid)
        _, stderr = launcher.communicate(timeout=RUN_BOUND_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return launcher.returncode, sent_at, stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_and_ctrl_c_save_the_step_in_flight_and_resume_exactly(corpus_file, tmp_path,
                                                                       uninterrupted):
    """SIGTERM to the launcher (a cluster's pre-emption), then Ctrl-C (SIGINT to the launcher
    and its ranks at once) on the resumed run: each stops both ranks after the same step, saves
    it and exits 143 / 130; a third run finishes. The three runs' losses are the uninterrupted
    run's, exactly."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    root = tmp_path / "ckpt"
    code, sent_at, stderr = signalled_run(
        command(corpus_file, root, tmp_path / "a.json"), root, env, 2,
        lambda pid: os.kill(pid, signal.SIGTERM))
    first = latest_step(root)
    assert code == 143, stderr
    # The step in flight when the signal came (the next save, 2 steps on, had not happened yet).
    assert sent_at <= first <= sent_at + 2 and first < STEPS
    assert stderr.strip().splitlines()[-1].startswith(f"stopped by SIGTERM after step {first};")
    assert sorted(losses(tmp_path / "a.json")) == list(range(1, first + 1))

    code, sent_at, stderr = signalled_run(
        command(corpus_file, root, tmp_path / "b.json", "--resume"), root,
        env, first + 2, lambda pid: os.killpg(pid, signal.SIGINT))
    second = latest_step(root)
    assert code == 130, stderr
    assert sent_at <= second <= sent_at + 2 and second < STEPS
    assert f"stopped by SIGINT after step {second};" in stderr
    assert sorted(losses(tmp_path / "b.json")) == list(range(first + 1, second + 1))

    last = subprocess.run(command(corpus_file, root, tmp_path / "c.json", "--resume"),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert last.returncode == 0, last.stderr
    pieced = {**losses(tmp_path / "a.json"), **losses(tmp_path / "b.json"),
              **losses(tmp_path / "c.json")}
    assert pieced == uninterrupted


SIGNALLED_LOOP = textwrap.dedent("""
    import os, signal, sys, time
    from tetrad.train.stop import StopRequest

    request = StopRequest()
    for step in request.steps(range(100), lambda received: 0):  # the ranks never agree to stop
        if step in (1, 2):  # the second within a second: the same Ctrl-C, forwarded
            os.kill(os.getpid(), signal.SIGTERM)
        if step == 3:
            time.sleep(1.5)
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    print("ran to the end")
""")


def test_a_second_signal_exits_at_once():
    child = subprocess.run([sys.executable, "-c", SIGNALLED_LOOP], cwd=REPO, capture_output=True,
                           text=True, timeout=EXIT_BOUND_S)
    assert child.returncode == -signal.SIGTERM, child.stderr
    assert "ran to the end" not in child.stdout


def test_the_steps_end_after_the_step_the_ranks_agree_on():
    request = StopRequest()
    done = []
    for step in request.steps(range(10), lambda received: received):
        done.append(step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
    assert done == [0, 1, 2, 3] and request.stopped_by == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again
