"""The serving settings (tetrad/spec/serving.py): whatever needs no weights is refused before any
weight is read or any rank starts; a failure after the ranks started leaves no process behind;
every default (the engine's and the server's) is declared once, and the command line's help
shows it."""

import argparse
import dataclasses
import multiprocessing

import pytest
from test_engine import random_model

from tetrad.cli.main import build_parser, main
from tetrad.errors import ConfigError
from tetrad.inference.core.scheduler import SchedulerConfig
from tetrad.inference.engine import LLM
from tetrad.models.hf import save_hf
from tetrad.spec.serving import ServeConfig, ServerConfig

ENGINE_COMMANDS = ("generate", "run", "serve")


@pytest.fixture(scope="module")
def unreadable_weights(tmp_path_factory):
    """A model folder whose config.json is sound and whose weights file is not safetensors."""
    folder = tmp_path_factory.mktemp("unreadable")
    save_hf(random_model(), folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    return folder


@pytest.fixture
def no_rank_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a serving rank was started")

    monkeypatch.setattr("tetrad.inference.ranks.driver.WorkerProcesses", refuse)


def test_what_needs_no_weights_is_refused_before_any_is_read(unreadable_weights, no_rank_starts):
    # The control: with sound settings the weights are read (--dtype auto reads the first
    # tensor's), and cannot be.
    with pytest.raises(Exception, match="deserializing header"):
        LLM(unreadable_weights, log=None, device="cpu")
    for settings, message in [
            (dict(preemption="sideways"), "preemption must be one of recompute, swap"),
            (dict(tp=2, preemption="sideways"), "preemption must be one of"),
            (dict(tp=2, dp=2), "data-parallel serving runs with tp 1 and pp 1"),
            (dict(tp=3), "tp 3 does not divide num_heads 4"),  # against the model's config.json
            (dict(pp=3), "pp 3 is more than the model's 2 layers"),
            (dict(ep=2, dp=2), "needs a mixture-of-experts model"),
            (dict(tp=0), "tp must be > 0"),
            (dict(attention="paged"), "attention must be one of"),
            (dict(dtype="fp8"), "dtype must be one of"),
            (dict(kv_memory="lots"), "cannot read 'lots' as a memory size"),
            (dict(swap_memory="some"), "cannot read 'some' as a memory size"),
            (dict(device="gpu"), "device must be auto, cpu, cuda or cuda:N"),
            (dict(tp=2, device="cuda:1"), "names one GPU"),
            (dict(max_num_seqs=0), "max_num_seqs must be > 0")]:
        with pytest.raises(ConfigError, match=message):
            LLM(unreadable_weights, log=None, device=settings.pop("device", "cpu"), **settings)
    assert not multiprocessing.active_children()


def test_the_command_line_refuses_them_in_one_line_before_loading(unreadable_weights, capsys):
    for flags, message in [(["--preemption", "sideways"], "preemption must be one of"),
                           (["--tp", "2", "--dp", "2"], "data-parallel serving runs with tp 1")]:
        assert main(["generate", str(unreadable_weights), "--prompt", "x", "--device", "cpu",
                     *flags]) == 2
        error = capsys.readouterr().err
        assert message in error and len(error.strip().splitlines()) == 1, error
    assert not multiprocessing.active_children()


def test_a_failure_after_the_ranks_started_stops_them(tmp_path, monkeypatch, capsys):
    save_hf(random_model(), tmp_path)

    def failing_log(line):
        raise RuntimeError(f"the log is full: {line}")

    # Rank 0 fails once the driver is up (its runner and pool built, the ranks serving).
    with pytest.raises(RuntimeError, match="the log is full: KV cache"):
        LLM(tmp_path, tp=2, device="cpu", block_size=4, log=failing_log)
    assert not multiprocessing.active_children()

    # `tetrad serve` fails after its engine started (making the app).
    def failing_app(llm, *args, **kwargs):
        assert llm.driver.workers and all(worker.is_alive() for worker in llm.driver.workers)
        raise ConfigError("no app today")

    monkeypatch.setattr("tetrad.inference.entrypoints.server.build_app", failing_app)
    assert main(["serve", str(tmp_path), "--tp", "2", "--device", "cpu", "--block-size",
                 "4"]) == 2
    assert "no app today" in capsys.readouterr().err
    assert not multiprocessing.active_children()


def test_every_default_is_the_dataclass_one(monkeypatch):
    limits = ("max_num_seqs", "max_num_batched_tokens", "preemption")
    served, scheduled = ServeConfig(), SchedulerConfig()
    assert all(getattr(served, name) == getattr(scheduled, name) for name in limits)

    # The help is made from the dataclasses: a changed default shows in every command's help.
    shown = {ServeConfig: ("block_size", "swap_memory", "max_num_seqs", "max_num_batched_tokens",
                           "preemption", "seed", "tp", "pp", "dp", "ep", "dtype", "device",
                           "attention"),
             ServerConfig: ("max_request_bytes", "max_sequences_per_request",
                            "max_stop_strings", "max_waiting_requests", "stream_interval")}
    changed = {}
    for config, names in shown.items():
        fields = {field.name: field for field in dataclasses.fields(config)}
        for name in names:
            changed[name] = f"<{name} default>"
            monkeypatch.setattr(fields[name], "default", changed[name])
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    for command in ENGINE_COMMANDS:
        helps = {action.dest: action.help for action in subparsers.choices[command]._actions}
        for name, value in changed.items():
            if name in ServeConfig.__dataclass_fields__ or command == "serve":
                assert value in helps[name], (command, name, helps[name])


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_device_is_resolved_in_one_place(gpus, monkeypatch):
    import torch

    from tetrad.inference.worker.config import serving_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert serving_device("cpu", 1) == serving_device("cpu", 2) == torch.device("cpu")
    if gpus == 0:
        assert serving_device("auto", 1) == serving_device("auto", 4) == torch.device("cpu")
        for device, world, message in (("cuda", 1, "torch sees no GPU: use --device cpu"),
                                       ("cuda:0", 1, "torch sees no GPU"),
                                       ("cuda", 2, "needs 2 GPUs")):
            with pytest.raises(ConfigError, match=message):
                serving_device(device, world)
        return
    assert serving_device("auto", 1) == serving_device("cuda", 1) == torch.device("cuda")
    assert serving_device("cuda:1", 1) == torch.device("cuda", 1)
    # Rank 0 of several: cuda:0 (rank r runs on cuda:r), with a GPU for every rank.
    assert serving_device("auto", 2) == serving_device("cuda", 2) == torch.device("cuda", 0)
    for device in ("auto", "cuda"):
        with pytest.raises(ConfigError, match="3 ranks .* needs 3 GPUs .* torch sees 2"):
            serving_device(device, 3)
    with pytest.raises(ConfigError, match="names one GPU"):
        serving_device("cuda:1", 2)
