"""DeepSeek-V3 models (MLA, shared + routed experts with sigmoid, group-limited routing and
aux-loss-free balancing, a leading dense layer) under the training layouts: dp, ZeRO-1/2/3, tp
(MLA split by heads, with and without SP), pp, ep and their compositions (and DeepSeek's routing
without MLA under cp) give the single-process
losses, gradient norms, final parameters (the routing bias included), validation loss and sampled
text (fp32, 1e-5 relative), through the function `tetrad train --nproc` runs on each worker.

The HF folder sets router_aux_loss_coef = 0 (DeepSeek balances by the bias), so how a layout
splits the batch into microbatches changes no gradient: one single-process run is every case's
reference. Each rank's routing bias moves from the loads of every rank's tokens, as one process
moves it from the whole batch's. The run reports' predictions of every rank's bytes are checked
too."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from deepseek_models import hf_model  # noqa: E402
from dist import run_ranks  # noqa: E402
from test_train_composition import check_run, job, parameters, reference, run_config  # noqa: E402

from tetrad.viz.report import predicted_for  # noqa: E402

# name -> layout. 3 layers: the first dense (first_k_dense_replace), two MoE layers of 8 experts.
CASES = {
    "dp4.ep4 zero2": dict(dp=4, ep=4, zero=2),
    "tp4 zero1": dict(tp=4, zero=1),  # one head per rank, no SP
    "dp2.tp2 zero3 sp": dict(dp=2, tp=2, zero=3, sequence_parallel=True),
    "tp2.pp2": dict(tp=2, pp=2),
    # The dense layer and an MoE layer on the first stage, an MoE layer on the second.
    "pp2.dp2.ep2 zero1": dict(pp=2, dp=2, ep=2, zero=1, stage_layers=(2, 1)),
    # DDP; overlap hides the dispatch behind the tp-split shared expert; full recompute.
    "dp2.tp2.ep2 sp overlap full": dict(dp=2, tp=2, ep=2, sequence_parallel=True, overlap=True,
                                        recompute="full"),
}
# Sigmoid routing with a moving bias under ring attention (MHA: cp refuses MLA). It leaves some
# expert unused on one rank and not on another: ZeRO-1 must start that bucket after backward.
SIGMOID_MOE = {"router_score": "sigmoid", "router_bias_update_rate": 0.01,
               "router_aux_loss_coef": 0.0}
CP_LAYOUT = dict(dp=2, cp=2, zero=1)


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3")
    hf_model("v3").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def single_process(deepseek_folder, corpus_file, tmp_path_factory):
    return reference(corpus_file, deepseek_folder, {}, 1, tmp_path_factory.mktemp("single"))


def test_layouts_train_deepseek_as_one_process(deepseek_folder, corpus_file, single_process,
                                               tmp_path):
    """Every case on 4 ranks in one spawn."""
    start = hf_model("v3").model.layers[1].mlp.gate.e_score_correction_bias
    moved = parameters(single_process.checkpoint)["layers.1.mlp.router.bias"] - start
    assert float(moved.abs().max()) > 0  # balancing moved the bias the layouts must move alike
    runs = [(run_config(corpus_file, deepseek_folder, {}, tmp_path / name, **layout), None)
            for name, layout in CASES.items()]
    runs.append((run_config(corpus_file, "tiny-moe", SIGMOID_MOE, tmp_path / "cp", **CP_LAYOUT),
                 None))
    *results, under_cp = run_ranks(job, 4, runs, timeout_s=900)[0]
    expected = reference(corpus_file, "tiny-moe", SIGMOID_MOE, 1, tmp_path / "cp reference")
    check_run("dp2.cp2 zero1 sigmoid routing", under_cp, expected, CP_LAYOUT)
    bias = parameters(expected.checkpoint)["layers.1.mlp.router.bias"]
    assert bias.abs().max() > 0  # it moved, from zeros
    assert torch.equal(parameters(under_cp.checkpoint)["layers.1.mlp.router.bias"], bias)
    check_prediction("dp2.cp2 zero1 sigmoid routing", under_cp.report)
    for (name, layout), result in zip(CASES.items(), results):
        check_run(name, result, single_process, layout)
        assert torch.equal(parameters(result.checkpoint)["layers.2.mlp.router.bias"],
                           parameters(single_process.checkpoint)["layers.2.mlp.router.bias"])
        check_prediction(name, result.report)


def check_prediction(name: str, report: dict) -> None:
    """The planner's eager profile predicts every rank's parameter, gradient and optimizer bytes
    and its traffic exactly, except what routing decides (all-to-all: the profile assumes a
    balanced router) and MLA's activations, not modelled yet (docs/deepseek.md)."""
    for entry in report["ranks"]:
        predicted = predicted_for(report, entry)
        for field, value in entry["bytes"].items():
            if field != "activations_peak":
                assert value == round(predicted["bytes"][field]), (name, entry["rank"], field)
        for kind, value in entry["comm_bytes"].items():
            if kind != "all_to_all":
                assert value == round(predicted["comm_bytes"][kind]), (name, entry["rank"], kind)
