"""--offload params / nvme (ZeRO-3's shards in host memory or in files) on 2 gloo ranks against
the single-process run: losses and final parameters, the bytes each rank counts on the device,
in host memory and on disk against the planner's (tetrad.planner.eager_state), the files
(their bytes while the run lasts, gone after unless kept), the fetch ahead of use and the release
after, and the rules and one-line errors of the flags."""

import os

import pytest
import torch
from dist import run_ranks
from zero_harness import (BATCH, BUCKET_BYTES, CPU, LR, SEQ, tiny_model, train_steps,
                          whole_parameters)

from tetrad.cli.main import main
from tetrad.errors import ConfigError, TetradError
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.fsdp import GATHERED, GATHERING
from tetrad.parallel.mesh import build_mesh
from tetrad.planner import predict_training
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import resolve_model
from tetrad.train.stop import check_cap
from tetrad.train.strategy import LocalStrategy, MeshStrategy

# (offload mode, dtype, gradient accumulation)
CASES = [("params", "fp32", 1), ("params", "fp32", 2), ("nvme", "fp32", 1),
         ("params", "bf16", 1), ("nvme", "bf16", 2)]


def config(mode: str, dtype: str, grad_accum: int, folder: str = "", dp: int = 2,
           keep: bool = False) -> TrainConfig:
    parallel = (ParallelConfig(dp=dp, zero=3, offload_mode=mode, offload_keep=keep,
                               offload_dir=folder if mode == "nvme" else "")
                if dp > 1 else ParallelConfig())
    return TrainConfig(model="tiny", batch_size=BATCH, seq_len=SEQ, lr=LR, dtype=dtype,
                       grad_accum=grad_accum, parallel=parallel)


def file_bytes(folder: str) -> dict[str, int]:
    return {os.path.join(root, name): os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(folder) for name in names}


def run_case(mesh, rank: int, case: tuple, folder: str, keep: bool = False) -> dict:
    strategy = MeshStrategy(tiny_model(), config(*case, folder=folder, keep=keep), CPU, mesh,
                            Comm(CommCounter()), bucket_bytes=BUCKET_BYTES)
    run = train_steps(strategy, case[2])
    files = strategy.engine.offload.files
    mine = file_bytes(files.folder) if files else {}
    params = whole_parameters(strategy)
    if files:
        files.close()
    return {**run, "params": params if rank == 0 else None, "files": sum(mine.values()),
            "file_count": len(mine)}


def fetched_ahead(mesh) -> dict:
    """What layer 0's forward sees of the units after it: layer 1 gathered; layer 2's shard
    copied into the device staging buffer (not an alias of the host shard) and its gather on the
    wire; layer 1's whole parameters released right after its forward; one staging buffer a
    side, as large as the largest unit shard, for the whole run."""
    strategy = MeshStrategy(tiny_model(), config("params", "fp32", 1), CPU, mesh,
                            Comm(CommCounter()), bucket_bytes=BUCKET_BYTES)
    engine = strategy.engine
    units = engine.units  # embedding, layer 0, layer 1, head
    staging = engine.staging
    buffers = (staging.on_device.data_ptr(), staging.on_host.data_ptr())
    seen = []

    def before(module, args):
        copied = staging.on_device[:units[2].param_shard.numel()]
        seen.append((units[1].state, staging.holder is units[2], units[2].state,
                     copied.data_ptr() != units[2].param_shard.data_ptr()
                     and torch.equal(copied, units[2].param_shard)))

    strategy.model.layers[0].register_forward_pre_hook(before)
    strategy.model.layers[0].register_forward_hook(
        lambda module, args, out: seen.append(units[1].full.untyped_storage().nbytes()))
    train_steps(strategy, 1)
    largest = max(unit.param_shard.numel() for unit in units)
    return {"seen": seen[:2], "host_shards": all(not u.param_shard.is_cuda for u in units),
            "staging": (staging.on_device.numel() == staging.on_host.numel() == largest
                        and buffers == (staging.on_device.data_ptr(),
                                        staging.on_host.data_ptr()))}


def job(rank: int, world_size: int, folder: str, kept: str) -> dict:
    mesh = build_mesh(ParallelConfig(dp=world_size), rank, world_size)
    return {"cases": [run_case(mesh, rank, case, folder) for case in CASES],
            "kept": run_case(mesh, rank, ("nvme", "fp32", 1), kept, keep=True)["files"],
            "ahead": fetched_ahead(mesh)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder, kept = tmp_path_factory.mktemp("offload"), tmp_path_factory.mktemp("kept")
    ranks = run_ranks(job, 2, str(folder), str(kept))
    return {"ranks": ranks, "folder": folder, "kept": kept}


@pytest.fixture(scope="module")
def references() -> dict:
    runs = {}
    for dtype, grad_accum in {(dtype, accum) for _, dtype, accum in CASES}:
        strategy = LocalStrategy(tiny_model(), config("none", dtype, grad_accum, dp=1), CPU)
        runs[dtype, grad_accum] = {**train_steps(strategy, grad_accum),
                                   "params": whole_parameters(strategy)}
    return runs


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_offload_trains_as_one_process_and_counts_what_the_planner_predicts(
        results, references, index):
    mode, dtype, grad_accum = case = CASES[index]
    reference = references[dtype, grad_accum]
    rank0 = results["ranks"][0]["cases"][index]
    if dtype == "fp32":
        assert rank0["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=0), case
        for name, value in reference["params"].items():
            torch.testing.assert_close(rank0["params"][name], value, rtol=0, atol=1e-5,
                                       msg=lambda m: f"{case} {name}: {m}")
    else:  # the same model to bf16's precision
        assert rank0["losses"] == pytest.approx(reference["losses"], rel=2e-2), case
    predicted = predict_training(resolve_model("tiny"), config(*case).parallel,
                                 BATCH // 2 // grad_accum, SEQ, num_microbatches=grad_accum,
                                 dtype=dtype)["bytes"]
    predicted.pop("activations_peak")
    for rank, result in enumerate(results["ranks"]):
        run = result["cases"][index]
        assert run["held"] == predicted, (case, rank)
        # Nothing of the model state stays on the device but the units being computed.
        assert run["held"]["params"] == run["held"]["grads"] == run["held"]["optimizer"] == 0
        if mode == "nvme":
            # one file per shard of the parameters, masters (bf16) and moments: their bytes
            assert run["files"] == predicted["disk_params"] + predicted["disk_optimizer"] > 0
            assert run["file_count"] == 4 * (3 + (dtype != "fp32"))  # 4 units
        else:
            assert run["files"] == 0 and predicted["host_params"] > 0


def test_offload_files_are_removed_at_the_end_unless_kept(results):
    assert file_bytes(str(results["folder"])) == {}
    assert os.listdir(results["folder"]) == []
    kept = sum(file_bytes(str(results["kept"])).values())
    assert kept == sum(result["kept"] for result in results["ranks"]) > 0


def test_each_shard_is_fetched_one_layer_ahead_and_released_after(results):
    for result in results["ranks"]:
        ahead = result["ahead"]
        (layer1, layer2_holds_staging, layer2, layer2_copied), layer1_after = ahead["seen"]
        assert layer1 == GATHERED and layer2_holds_staging
        assert layer2 in (GATHERING, GATHERED) and layer2_copied
        assert layer1_after == 0
        assert ahead["host_shards"] and ahead["staging"]


def test_offload_flag_modes_and_their_rules(tmp_path):
    assert ParallelConfig(dp=2, zero=1, offload=True).offload_mode == "optimizer"
    assert ParallelConfig(dp=2, zero=3, offload_mode="params").offload
    assert not ParallelConfig(dp=2, zero=3).offload
    with pytest.raises(ConfigError, match="--zero 3"):
        ParallelConfig(dp=2, zero=2, offload_mode="params")
    with pytest.raises(ConfigError, match="for --offload nvme"):
        ParallelConfig(dp=2, zero=3, offload_mode="params", offload_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="needs --offload-dir"):
        ParallelConfig(dp=2, zero=3, offload_mode="nvme").check_offload_dir()
    with pytest.raises(ConfigError, match="not a folder"):
        ParallelConfig(dp=2, zero=3, offload_mode="nvme",
                       offload_dir=str(tmp_path / "missing")).check_offload_dir()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere
        with pytest.raises(ConfigError, match="not writable"):
            ParallelConfig(dp=2, zero=3, offload_mode="nvme",
                           offload_dir=str(locked)).check_offload_dir()


@pytest.mark.parametrize("flags, message", [
    (["--offload", "nvme", "--zero", "3"], "--offload nvme needs --offload-dir PATH"),
    (["--offload", "nvme", "--zero", "3", "--offload-dir", "/nonexistent/dir"],
     "--offload-dir /nonexistent/dir is not a folder"),
    (["--offload", "params", "--zero", "2"], "use --zero 3, or --offload optimizer"),
    (["--offload"], "--offload needs a ZeRO stage"),
])
def test_the_cli_refuses_in_one_line(flags, message, capsys):
    assert main(["train", "--model", "tiny", "--nproc", "2", "--dp", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_rank_over_the_device_memory_cap_stops():
    held = {"params": 100, "params_gathered_peak": 50, "grads": 0, "optimizer": 0,
            "host_params": 10**9, "disk_optimizer": 10**9}
    check_cap(held, 50, 200, 3)  # host and disk bytes are not device memory
    check_cap(held, 51, 0, 3)  # no cap
    with pytest.raises(TetradError, match="step 3: this rank holds 201 bytes"):
        check_cap(held, 51, 200, 3)
