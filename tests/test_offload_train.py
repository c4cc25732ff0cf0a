"""--offload params / nvme through the trainer: a model whose parameters, gradients and optimizer
state do not fit a device-memory cap trains under it with parameter offload (the run report
gives the cap, the planner's device bytes and the counted ones, every byte field equal to the
planner's), the same layout without offload is refused; and offload under tensor and pipeline
parallelism (pp2 x dp2 1F1B, tp2 x dp2) ends with the single process's losses and parameters."""

import dataclasses

import pytest
import torch
from dist import run_ranks

from tetrad.errors import ConfigError
from tetrad.models.transformer import Transformer, count_parameters
from tetrad.planner import predict_training
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import resolve_model
from tetrad.train import checkpoint as ckpt
from tetrad.train.launch import train_worker
from tetrad.train.stop import check_fits, device_bytes
from tetrad.train.trainer import train

RUN_LR = 3e-3
RUN = dict(model="tiny", lr=RUN_LR, steps=3, batch_size=4, seq_len=32, warmup_steps=1,
           sample_tokens=0)
# Pipelines and tensor parallelism: the layouts with their offload mode.
LAYOUTS = [dict(dp=2, pp=2, zero=3, offload_mode="params", schedule="1f1b", microbatches=2),
           dict(dp=2, tp=2, zero=3, offload_mode="nvme")]


def run_config(corpus_file: str, parallel: ParallelConfig, **extra) -> TrainConfig:
    return TrainConfig(**{**RUN, "data": corpus_file, "nproc": parallel.world_size,
                          "parallel": parallel, **extra})


def predicted_device(config: TrainConfig) -> int:
    predicted = predict_training(resolve_model("tiny"), config.parallel,
                                 config.batch_size // config.parallel.dp, config.seq_len)
    return device_bytes(predicted["bytes"])


def the_cap(corpus_file: str) -> tuple[int, dict]:
    """A cap the offloaded run fits under (its planner's device bytes plus the token ids a CPU
    rank's embedding keeps of the whole batch: tests/test_report.py) and what it excludes."""
    offloaded = run_config(corpus_file, ParallelConfig(dp=2, zero=3, offload_mode="params"))
    ids = offloaded.batch_size * (offloaded.seq_len + 1) * 8
    cap = int(predicted_device(offloaded)) + ids
    state = 16 * count_parameters(Transformer(resolve_model("tiny")))
    without = dataclasses.replace(offloaded, parallel=ParallelConfig(dp=2, zero=3))
    return cap, {"model_state": state, "zero3": predicted_device(without),
                 "offloaded": offloaded}


def capped_job(rank: int, world_size: int, config: TrainConfig):
    result = train_worker(rank, world_size, config)
    return result.report if rank == 0 else None


def test_a_model_over_the_cap_trains_with_parameter_offload(corpus_file):
    cap, facts = the_cap(corpus_file)
    # fp32 parameters, gradients and AdamW's two moments: 16 bytes a parameter, over the cap;
    # ZeRO-3 without offload over it too.
    assert facts["model_state"] > cap and facts["zero3"] > cap
    without = run_config(corpus_file, ParallelConfig(dp=2, zero=3), device_memory_cap=cap)
    predicted = predict_training(resolve_model("tiny"), without.parallel, 2, without.seq_len)
    with pytest.raises(ConfigError, match="over --device-memory-cap"):
        check_fits(predicted, without, torch.device("cpu"), 2)
    config = dataclasses.replace(facts["offloaded"], device_memory_cap=cap)
    report = run_ranks(capped_job, 2, config)[0]
    memory = report["device_memory"]
    assert memory["cap"] == cap and 0 < memory["predicted"] <= memory["counted"] <= cap
    predicted = report["predicted"]["bytes"]
    for entry in report["ranks"]:
        held = entry["bytes"]
        assert set(held) == set(predicted)
        assert {k: v for k, v in held.items() if k != "activations_peak"} == {
            k: v for k, v in predicted.items() if k != "activations_peak"}
        assert held["host_params"] > 0 and held["params"] == held["grads"] == 0


def layouts_job(rank: int, world_size: int, configs: list[TrainConfig]):
    reports = []
    for config in configs:
        result = train_worker(rank, world_size, config)
        reports.append(result.report["steps"] if rank == 0 else None)
    return reports


def final_parameters(folder) -> dict[str, torch.Tensor]:
    _, state = ckpt.load_checkpoint(folder, resolve_model("tiny"))
    return {name: state["model"][name] for name in state["model"]}


def test_offload_under_tensor_and_pipeline_parallelism_equals_one_process(corpus_file,
                                                                          tmp_path):
    """Offload changes where the shards live, not one bit of the result: the final parameters
    equal the same layout's without offload exactly. Against one process the losses agree to
    1e-5 and the parameters as every tp / pp layout's do (AdamW turns a summation-order rounding
    on a near-zero gradient into up to ~lr/200 on that weight: tests/test_zero.py's tolerance)."""
    single = train(run_config(corpus_file, ParallelConfig(),
                              checkpoint_dir=str(tmp_path / "single")), show_progress=False)
    files = tmp_path / "files"
    files.mkdir()
    layouts = [(layout, offloaded) for layout in LAYOUTS for offloaded in (True, False)]
    configs = [run_config(corpus_file, ParallelConfig(
        **{**layout, "offload_mode": layout["offload_mode"] if offloaded else "none"},
        offload_dir=str(files) if offloaded and layout["offload_mode"] == "nvme" else ""),
        checkpoint_dir=str(tmp_path / f"layout{index}"))
        for index, (layout, offloaded) in enumerate(layouts)]
    steps = run_ranks(layouts_job, 4, configs)[0]
    expected = [step["loss"] for step in single.report["steps"]]
    last = ckpt.step_folder_name(RUN["steps"])
    reference = final_parameters(tmp_path / "single" / last)
    finals = [final_parameters(tmp_path / f"layout{index}" / last) for index in range(len(layouts))]
    for index, (layout, offloaded) in enumerate(layouts):
        assert [step["loss"] for step in steps[index]] == pytest.approx(expected, rel=1e-5)
        assert set(finals[index]) == set(reference)
        for name, value in reference.items():
            torch.testing.assert_close(finals[index][name], value, rtol=1e-4,
                                       atol=RUN_LR / 30, msg=lambda m: f"{layout} {name}: {m}")
            if offloaded:
                assert torch.equal(finals[index][name], finals[index + 1][name]), (layout, name)
    assert list(files.iterdir()) == []  # nvme's files went with the ranks
