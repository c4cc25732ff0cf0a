"""`--compile` (regional torch.compile of each block, tetrad.parallel.compile) under the layouts it
composes with gives the single-process EAGER run's losses, gradient norms, final parameters,
validation loss and sampled text (fp32, 1e-5 relative), and its compile time is reported and kept
out of the step times.

Inductor fuses and reorders fp32 arithmetic (a norm's mean, the rotary products), which moves a
block's outputs by about 1e-7 relative: the losses stay within 1e-7 of the eager ones. One
parameter kind is looser: a routed expert's weights. An expert learns from the few tokens routed
to it, and AdamW's first steps move a weight by about lr * sign(gradient) whatever the gradient's
size, so where an expert's gradient entries are near zero the 1e-7 differences decide the
update: measured 1.7e-5 relative (eager under the same layout: 2.5e-6), so experts are checked
at 1e-4.

Inductor compiles on CPU are slow (seconds per graph), so the layouts share one spawn and are
chosen to compile few graphs: DDP and ZeRO-3 with full recomputation run blocks of one shape
(Dynamo reuses the graph), zero bubble the same block with its own backend (a backward that runs
twice), TP+SP and CP+EP their own pieces around their graph breaks."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from dist import run_ranks
from test_train_composition import (check_run, job, parameters, reference, relative_error,
                                    run_config)
from tetrad.cli.main import main
from tetrad.spec.model import ModelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.compile import CompileClock
from tetrad.train.strategy import build_strategy
from tetrad.train import checkpoint as ckpt

# name -> (model, layout, the reference's grad_accum): the per-rank microbatch of every dense
# layout but TP+SP is [4 rows, 32 tokens].
CASES = {
    "dp2": ("tiny", dict(dp=2), 1),
    "dp2 zero3 recompute": ("tiny", dict(dp=2, zero=3, recompute="full"), 1),
    "pp2 zb": ("tiny", dict(pp=2, schedule="zb", microbatches=2), 1),
    "tp2 sp": ("tiny", dict(tp=2, sequence_parallel=True), 1),
    # Ring attention (a graph break at its core) around expert-parallel MoE layers (eager).
    "cp2.ep2 moe": ("tiny-moe", dict(cp=2, ep=2), 1),
}


def param_rtol(name: str) -> float:
    """A routed expert's weights within 1e-4 (the module docstring says why), the rest 1e-5."""
    return 1e-4 if ".mlp.experts." in name else 1e-5


def test_compiled_layouts_equal_single_process_eager(corpus_file, tmp_path):
    runs = [(dataclasses.replace(run_config(corpus_file, model, {}, tmp_path / name, **layout),
                                 compile=True), None)
            for name, (model, layout, _) in CASES.items()]
    results = run_ranks(job, 2, runs, timeout_s=900)[0]
    for (name, (model, layout, grad_accum)), result in zip(CASES.items(), results):
        expected = reference(corpus_file, model, {}, grad_accum, tmp_path / f"{name} reference")
        check_run(name, result, expected, layout, param_rtol=param_rtol)
        assert "compile_time_s" not in expected.report, name
        # Every rank says what it compiled; the first layout pays for the shared block graph.
        assert all("compile_time_s" in rank for rank in result.report["ranks"]), name
    assert results[0].report["compile_time_s"] > 0


def test_single_process_compile_flag_and_compile_time(corpus_file, tmp_path, capsys):
    """`tetrad train --compile` (here with full recomputation around the compiled blocks): the
    eager run's numbers, the compile time in the report and printed once, and no step time
    holding it."""
    torch._dynamo.reset()  # a block graph compiled earlier in this process would be reused
    report_path = tmp_path / "report.json"
    assert main(["train", "--model", "tiny", "--data", corpus_file, "--steps", "5",
                 "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
                 "--sample-tokens", "12", "--recompute", "full", "--compile",
                 "--checkpoint-dir", str(tmp_path / "compiled"),
                 "--report", str(report_path)]) == 0
    assert capsys.readouterr().out.count("compiling took") == 1
    report = json.loads(report_path.read_text())
    assert report["config"]["compile"] is True
    expected = reference(corpus_file, "tiny", {}, 1, tmp_path / "eager")
    steps = report["steps"]
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx(
            [s[key] for s in expected.report["steps"]], rel=1e-5), key
    assert report["validation_loss"] == pytest.approx(expected.report["validation_loss"],
                                                      rel=1e-5)
    compiled = parameters(ckpt.find_checkpoint(tmp_path / "compiled"))
    for name, value in parameters(expected.checkpoint).items():
        assert relative_error(compiled[name], value) < 1e-5, name

    compile_time = report["compile_time_s"]
    assert compile_time > 0 and report["ranks"][0]["compile_time_s"] == compile_time
    # All of it is paid in the first step (one shape, no recompiles), and left out of its time.
    assert steps[0]["compile_s"] == compile_time
    assert all("compile_s" not in s for s in steps[1:])
    assert steps[0]["time_s"] < compile_time


def test_single_process_compiles_its_loss():
    """One process compiles its cross-entropy with the blocks (a CompiledForward in
    LocalStrategy): the compiler runs at the first loss with gradients, and the loss and the
    logits' gradient are eager's (fp32, 1e-6 relative)."""
    torch._dynamo.reset()
    config = ModelConfig(name="loss", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16)
    strategy = build_strategy(Transformer(config), TrainConfig(batch_size=4, seq_len=16,
                                                               compile=True), torch.device("cpu"))
    logits = torch.randn(4, 16, 64, requires_grad=True)
    targets = torch.randint(0, 64, (4, 16))
    clock = CompileClock()
    loss = strategy.loop.loss(logits, targets)
    loss.backward()
    clock.close()
    assert clock.seconds > 0
    eager_logits = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(eager_logits.flatten(0, 1), targets.flatten())
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert relative_error(logits.grad, eager_logits.grad) < 1e-6
