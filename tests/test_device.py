"""Which device a training rank computes on, and the run report's CUDA memory, checked without a
GPU: torch.cuda's answers are faked where the choice depends on them (the real GPU runs are in
tests/gpu/, skipped without CUDA)."""

import pytest
import torch

from tetrad.spec.model import TrainConfig
from tetrad.errors import ConfigError
from tetrad.parallel.launch import local_device
from tetrad.train import launch as train_launch
from tetrad.train.trainer import run_device, train
from tetrad.viz.report import comparison, device_bytes, draw_report, format_report, rank_kinds


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("gpus,ranks,requested,expected", [
    (0, 1, "auto", "cpu"), (2, 2, "auto", "cuda:1"), (1, 2, "auto", "cpu"),
    (2, 2, "cpu", "cpu"), (4, 2, "cuda", "cuda:1")])
def test_local_device_gives_each_local_rank_its_own_gpu_or_the_cpu_to_all(
        monkeypatch, gpus, ranks, requested, expected):
    fake_gpus(monkeypatch, gpus)
    assert str(local_device(ranks - 1, ranks, requested)) == expected


@pytest.mark.parametrize("gpus,ranks,message", [
    (0, 1, "torch sees none: use --device cpu"),
    (1, 2, "2 ranks on this machine but 1 GPUs: lower --nproc to 1")])
def test_device_cuda_without_a_gpu_per_rank_is_one_line(monkeypatch, gpus, ranks, message):
    fake_gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError, match=message):
        local_device(0, ranks, "cuda")


def test_the_launcher_decides_the_device_once_for_every_rank(monkeypatch, corpus_file):
    """NCCL and gloo cannot talk: every rank gets the launcher's one choice (cuda: rank r on
    cuda:r), and a missing GPU stops before any process starts."""
    chosen = []
    monkeypatch.setattr(train_launch, "spawn",
                        lambda *args, device_type, **kwargs: chosen.append(device_type) or [None])
    config = dict(model="tiny", data=corpus_file, steps=1, batch_size=4, seq_len=32, nproc=2,
                  parallel={"dp": 2})
    fake_gpus(monkeypatch, 2)
    train_launch.launch_training(TrainConfig(**config))
    train_launch.launch_training(TrainConfig(**config, device="cpu"))
    fake_gpus(monkeypatch, 1)
    train_launch.launch_training(TrainConfig(**config))
    assert chosen == ["cuda", "cpu", "cpu"]
    with pytest.raises(ConfigError, match="lower --nproc to 1"):
        train_launch.launch_training(TrainConfig(**config, device="cuda"))
    assert len(chosen) == 3


def device_of_a_gloo_rank(rank, world_size):
    """With GPUs in sight, a rank of a gloo job (spawned with device_type "cpu") still computes
    on the CPU: its tensors must be ones gloo can send."""
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: world_size)
    return str(run_device(TrainConfig(device="auto")))


def test_a_gloo_rank_computes_on_the_cpu_even_beside_gpus():
    from tetrad.parallel.launch import spawn

    assert spawn(device_of_a_gloo_rank, 2, device_type="cpu", timeout_s=120) == ["cpu", "cpu"]


def test_cuda_memory_is_null_on_cpu_and_shown_beside_the_counted_bytes(corpus_file, tmp_path):
    report = train(TrainConfig(model="tiny", data=corpus_file, steps=2, batch_size=4, seq_len=32,
                               sample_tokens=0), show_progress=False).report
    assert [entry["cuda_memory"] for entry in report["ranks"]] == [None]
    assert "cuda " not in format_report(report)
    # What a GPU run adds (numbers made up here: this machine has no allocator to ask): the
    # counted device bytes and the prediction's beside the allocator's peaks.
    counted = device_bytes(report["ranks"][0]["bytes"])
    predicted = device_bytes(report["predicted"]["bytes"])
    report["ranks"][0]["cuda_memory"] = {"allocated_peak": 2 * counted,
                                         "reserved_peak": 3 * counted}
    rows = {row["field"]: row for row in comparison(report, rank_kinds(report)[0][1])
            if row["section"] == "cuda"}
    assert rows["counted total"]["measured"] == counted == sum(
        report["ranks"][0]["bytes"].values())
    assert rows["counted total"]["predicted"] == predicted
    assert rows["allocated_peak"]["error"] == pytest.approx(
        (predicted - 2 * counted) / (2 * counted))
    assert rows["reserved_peak"]["measured"] == 3 * counted
    text = format_report(report)
    assert "cuda allocated_peak" in text and f"{3 * counted:,}" in text
    draw_report(report, tmp_path / "run.png")  # the peak: a dashed line on the measured bar
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_rings_of_two_post_each_send_with_its_receive_as_one_batch(monkeypatch):
    """On NCCL two ranks that each send to the other before receiving wait forever once the
    tensor outgrows NCCL's buffers (a pair's sends and receives run in order on one stream);
    tetrad's ring collectives and ring attention post each hop as one batch instead."""
    import torch.distributed as dist

    from tetrad.parallel.comm import Comm
    from tetrad.parallel.mesh import Group

    batches = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [])
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, group, group_peer:
                        (op.__name__, group_peer, tensor.numel()))
    pair = Group("cp", (3, 7), 0)
    comm = Comm(algorithm="ring")
    comm.exchange(torch.ones(5), 1, torch.empty(5), 1, pair, "kv").wait()
    assert batches == [[("isend", 1, 5), ("irecv", 1, 5)]]
    assert comm.counter.totals()["p2p"] == 5 * 4  # the send alone
    batches.clear()
    comm.all_reduce(torch.ones(8), pair, "grads")  # reduce-scatter hop, then all-gather hop
    assert batches == [[("isend", 1, 4), ("irecv", 1, 4)]] * 2


def test_overlap_unset_is_on_with_nccl_and_off_on_gloo():
    """Chunked TP/EP overlap pays on GPUs and costs on gloo, where the same cores compute and
    send; an explicit --overlap / --no-overlap is kept either way."""
    from tetrad.spec.model import ParallelConfig
    from tetrad.train.launch import with_overlap_decided

    unset = TrainConfig(model="tiny", nproc=2, parallel=ParallelConfig(tp=2))
    assert unset.parallel.overlap is None
    assert with_overlap_decided(unset, "cuda").parallel.overlap is True
    assert with_overlap_decided(unset, "cpu").parallel.overlap is False
    for explicit in (True, False):
        config = TrainConfig(model="tiny", nproc=2, parallel=ParallelConfig(tp=2, overlap=explicit))
        assert with_overlap_decided(config, "cpu").parallel.overlap is explicit
        assert with_overlap_decided(config, "cuda").parallel.overlap is explicit
