"""`tetrad train` under torchrun: one node with two workers, and two agents on this machine that
meet through the c10d rendezvous on 127.0.0.1 (the shape of a real two-node launch). Both must
give the single-process losses."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tetrad.spec.model import TrainConfig
from tetrad.train.trainer import train

TORCHRUN = Path(sys.executable).with_name("torchrun")
ARGS = ["--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
        "--warmup-steps", "2", "--sample-tokens", "0", "--dp", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def reference_losses(corpus_file):
    config = TrainConfig(model="tiny", data=corpus_file, steps=4, batch_size=4, seq_len=32,
                         warmup_steps=2, sample_tokens=0)
    return [step["loss"] for step in train(config, show_progress=False).report["steps"]]


def report_losses(path: Path):
    return [step["loss"] for step in json.loads(path.read_text())["steps"]]


def run(commands: list[list[str]]) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for command in commands]
    for process in processes:
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed in this venv")
def test_torchrun_one_node_and_two_agents_match_one_process(corpus_file, tmp_path):
    expected = reference_losses(corpus_file)
    one_node = tmp_path / "one_node.json"
    run([[str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "tetrad", "train",
          *ARGS, "--data", corpus_file, "--report", str(one_node)]])
    assert report_losses(one_node) == pytest.approx(expected, rel=1e-5)

    two_nodes = tmp_path / "two_nodes.json"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [[str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "tetrad-test",
               "-m", "tetrad", "train", *ARGS, "--data", corpus_file, "--report", str(two_nodes)]
              for node in (0, 1)]
    run(agents)
    assert report_losses(two_nodes) == pytest.approx(expected, rel=1e-5)
