"""A training job is prepared once (model, layout, tokenizer, checkpoint lookup: tetrad.train.job)
by the launcher, or under torchrun by rank 0, and handed to the ranks, which read none of those
inputs again; the device is resolved once per process. Checked by counting the calls, and by
taking away from the ranks the inputs they must not read."""

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tetrad.parallel import launch as process_launch
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.tokenizer import BPETokenizer
from tetrad.train import job as train_job
from tetrad.train import launch
from tetrad.train.trainer import train

RUN = dict(model="tiny", steps=2, batch_size=4, seq_len=32, warmup_steps=1, sample_tokens=0)
ARGS = ["--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
        "--warmup-steps", "1", "--sample-tokens", "0"]


def count_calls(patch) -> Counter:
    """From now on, this process's calls of the job's preparation (tetrad.train.job: resolve_run
    reads the model's config, prepare the tokenizer, --hardware and the checkpoint) and of
    local_device, under every name a tetrad module imported it by."""
    counts: Counter = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    originals = {"prepare": train_job.prepare, "resolve_run": train_job.resolve_run,
                 "local_device": process_launch.local_device}
    for module in [module for name, module in sys.modules.items() if name.startswith("tetrad")]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                patch(module, name, counted(name, original))
    return counts


def counting_rank(rank, world_size, fn, job):
    """A rank that runs `fn` as the launcher asked and says what it called meanwhile."""
    counts = count_calls(setattr)
    return fn(rank, world_size, job), dict(counts)


def losses(result) -> list[float]:
    return [step["loss"] for step in result.report["steps"]]


@pytest.fixture(scope="module")
def one_process_losses(corpus_file) -> list[float]:
    return losses(train(TrainConfig(**RUN, data=corpus_file), show_progress=False))


def test_the_launcher_prepares_once_and_its_ranks_never_read_the_inputs(
        monkeypatch, tmp_path, corpus_file):
    tokenizer_file = tmp_path / "tokenizer.json"
    BPETokenizer.train([Path(corpus_file).read_text()], vocab_size=320).save_json(tokenizer_file)
    config = TrainConfig(**RUN, data=corpus_file, tokenizer=str(tokenizer_file),
                         model_overrides={"vocab_size": 320})
    expected = losses(train(config, show_progress=False))

    launcher = count_calls(monkeypatch.setattr)
    ranks = []

    def spawn_without_the_tokenizer(fn, nprocs, args, **kwargs):
        tokenizer_file.unlink()  # a rank that prepared the job again would fail to read it
        ranks.extend(process_launch.spawn(counting_rank, nprocs, (fn, *args), **kwargs))
        return [result for result, _ in ranks]

    monkeypatch.setattr(launch, "spawn", spawn_without_the_tokenizer)
    result = launch.launch_training(TrainConfig(**{**config.to_dict(), "nproc": 2,
                                                   "parallel": ParallelConfig(dp=2)}))
    assert dict(launcher) == {"resolve_run": 1, "prepare": 1, "local_device": 1}
    assert [counts for _, counts in ranks] == [{}, {}]
    assert losses(result) == pytest.approx(expected, rel=1e-5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for a worker process (tetrad.parallel.launch.torchrun_ranks)."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def test_a_torchrun_process_resolves_its_device_once(monkeypatch, corpus_file,
                                                    one_process_losses):
    for key, value in torchrun_environment(0, 1, free_port()).items():
        monkeypatch.setenv(key, value)
    counts = count_calls(monkeypatch.setattr)
    threads = torch.get_num_threads()
    try:
        result = launch.launch_training(TrainConfig(**RUN, data=corpus_file))
    finally:
        torch.set_num_threads(threads)
    assert dict(counts) == {"resolve_run": 1, "prepare": 1, "local_device": 1}
    assert losses(result) == pytest.approx(one_process_losses, rel=1e-5)


def run_torchrun_ranks(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    port = free_port()
    processes = [subprocess.Popen([sys.executable, "-m", "tetrad", "train", *command],
                                  env=torchrun_environment(rank, len(commands), port),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, command in enumerate(commands)]
    finished = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=240)
        finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                                    stderr))
    return finished


def test_torchrun_ranks_train_the_job_rank_zero_prepared(tmp_path, corpus_file,
                                                        one_process_losses):
    """Rank 1 is given a tokenizer that does not exist: it never reads it, training rank 0's
    job; and a bad input on rank 0 stops every rank with rank 0's one line."""
    report = tmp_path / "report.json"
    common = [*ARGS, "--data", corpus_file, "--dp", "2", "--report", str(report)]
    ranks = run_torchrun_ranks([common, [*common, "--tokenizer", str(tmp_path / "none.json")]])
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr for rank in ranks]
    assert [step["loss"] for step in json.loads(report.read_text())["steps"]] == \
        pytest.approx(one_process_losses, rel=1e-5)

    ranks = run_torchrun_ranks([[*common, "--seq-len", "4096"], common])
    for rank in ranks:
        lines = rank.stderr.strip().splitlines()
        assert rank.returncode == 2 and "Traceback" not in rank.stderr, rank.stderr
        assert "max_seq_len 128" in lines[-1], rank.stderr
