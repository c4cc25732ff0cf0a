"""Whole-request serving figures: a static batch's prefill, then its decode steps, and the
output and total tokens per second they give (what published serving tables report)."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main
from tetrad.hardware.profile import cluster
from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
from tetrad.spec.presets import preset

LLAMA = preset("llama2-7b")
H100 = cluster("h100-sxm", 8)


def _estimate(layout, prompt, output, batch):
    return evaluate_serving(LLAMA, H100, layout, ServeWorkload(
        context_len=prompt + output, prompt_len=prompt, output_len=output, batch=batch))


@pytest.mark.parametrize("layout", [ServeLayout(dp=8), ServeLayout(tp=2, dp=4),
                                    ServeLayout(tp=2, pp=2, dp=2)])
@pytest.mark.parametrize("prompt,output,batch", [(128, 2048, 64), (2048, 128, 8), (512, 1, 3)])
def test_a_request_is_the_batch_prefill_then_one_decode_step_per_further_token(
        layout, prompt, output, batch):
    estimate = _estimate(layout, prompt, output, batch)
    assert estimate.request_s == pytest.approx(estimate.batch_ttft_s
                                               + (output - 1) * estimate.tpot_s)
    sequences = layout.dp * batch
    assert estimate.output_tokens_per_s == pytest.approx(sequences * output / estimate.request_s)
    assert estimate.total_tokens_per_s == pytest.approx(
        sequences * (prompt + output) / estimate.request_s)
    assert estimate.output_tokens_per_s < estimate.decode_tokens_per_s


@pytest.mark.parametrize("layout", [ServeLayout(), ServeLayout(pp=2), ServeLayout(tp=2, pp=4)])
def test_one_sequence_prefill_is_the_time_to_first_token(layout):
    world = cluster("h100-sxm", layout.tp * layout.pp)
    workload = ServeWorkload(context_len=1100, prompt_len=1000, output_len=100, batch=1)
    estimate = evaluate_serving(LLAMA, world, layout, workload)
    assert estimate.batch_ttft_s == estimate.ttft_s > 0


def test_a_compute_bound_batch_prefill_grows_with_its_tokens():
    one, eight, sixteen = (_estimate(ServeLayout(dp=8), 2048, 16, batch).batch_ttft_s
                           for batch in (1, 8, 16))
    assert 7 < eight / one <= 8.5 and 1.8 < sixteen / eight < 2.2


def test_pipeline_prefill_overlaps_its_microbatches():
    """Two stages and a batch of two: the second half starts one stage after the first, so the
    batch takes three stage-times, less than two whole passes."""
    flat, piped = (_estimate(layout, 2048, 16, 2).batch_ttft_s
                   for layout in (ServeLayout(dp=8), ServeLayout(pp=2, dp=4)))
    half = _estimate(ServeLayout(pp=2, dp=4), 2048, 16, 1).batch_ttft_s
    assert piped < flat
    assert piped == pytest.approx(1.5 * half, rel=0.05)


def test_long_outputs_approach_the_decode_rate():
    estimate = _estimate(ServeLayout(dp=8), 64, 8192, 32)
    assert 0.97 < estimate.output_tokens_per_s / estimate.decode_tokens_per_s < 1


def test_cli_prints_the_whole_request_figures(capsys):
    args = ["plan", "serve", "--model", "llama2-7b", "--gpu", "h100-sxm", "--num-gpus", "1",
            "--prompt-len", "128", "--output-len", "2048", "--batch", "16", "--json"]
    assert main(args) == 0
    config = json.loads(capsys.readouterr().out)["configs"][0]
    assert config["request_s"] == pytest.approx(config["batch_ttft_s"] + 2047 * config["tpot_s"],
                                                rel=1e-3)
    assert config["output_tokens_per_s"] == pytest.approx(16 * 2048 / config["request_s"],
                                                          rel=1e-3)
    assert config["total_tokens_per_s"] == pytest.approx(16 * 2176 / config["request_s"],
                                                         rel=1e-3)
