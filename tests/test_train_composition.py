"""Every parallel strategy composed in the trainer: `tetrad train --nproc N` layouts mixing data,
tensor (+ sequence), pipeline (every schedule family), context and expert parallelism, ZeRO and
recomputation give the single-process losses, gradient norms, final parameters, validation loss
and sampled text (fp32, 1e-5 relative), report every rank, and resume from one another's
checkpoints. Each world size is one spawn running its cases in turn through the very function
`tetrad train --nproc` runs on each worker (launch.train_worker). Bad layouts stop with one line
before any process starts."""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from dist import run_ranks
from tetrad.cli.main import main
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.hf import load_pretrained
from tetrad.train import checkpoint as ckpt
from tetrad.train import launch
from tetrad.train.trainer import train

COMMON = dict(steps=5, batch_size=8, seq_len=32, warmup_steps=2, sample_tokens=12)
FOUR_LAYERS = {"num_layers": 4}

# name -> (model, model overrides, layout, the reference's grad_accum). MoE load-balance losses
# are per microbatch, so the reference splits the batch as the layout does (dp x microbatches).
CASES_8 = {
    "dp2.tp2.pp2": ("tiny", FOUR_LAYERS, dict(dp=2, tp=2, pp=2), 1),
    "dp2.pp2.cp2 gpipe tied": ("tiny", {"tie_embeddings": True},
                               dict(dp=2, pp=2, cp=2, schedule="gpipe"), 1),
    "tp2.pp2.cp2.ep2 moe": ("tiny-moe", {}, dict(tp=2, pp=2, cp=2, ep=2), 2),
    # ZeRO-3 per (stage, microbatch) over two chunks per pipeline rank, SP's sums per unit.
    "dp2.pp2.tp2 zero3 interleaved sp": ("tiny", FOUR_LAYERS, dict(
        dp=2, pp=2, tp=2, zero=3, schedule="interleaved", vpp=2, microbatches=4,
        sequence_parallel=True), 1),
}
CASES_4 = {
    "dp2.tp2.ep2 moe": ("tiny-moe", {}, dict(dp=2, tp=2, ep=2), 2),
    "dp2.tp2 zero3": ("tiny", {}, dict(dp=2, tp=2, zero=3), 1),
    "pp2.tp2 interleaved": ("tiny", FOUR_LAYERS,
                            dict(pp=2, tp=2, schedule="interleaved", vpp=2, microbatches=4), 1),
    "pp2.tp2 zb": ("tiny", {}, dict(pp=2, tp=2, schedule="zb", microbatches=4), 1),
    "pp2.dp2 zero1": ("tiny", FOUR_LAYERS, dict(pp=2, dp=2, zero=1, stage_layers=(1, 3)), 1),
    "dp2.tp2 sp": ("tiny", {}, dict(dp=2, tp=2, sequence_parallel=True), 1),
    "dp2.tp2 recompute": ("tiny", {}, dict(dp=2, tp=2, recompute="full"), 1),
    # kv heads (2) < tp: replicated kv rows, and SP's norms, summed inside ZeRO's buckets.
    "tp4 zero2 sp": ("tiny", {}, dict(tp=4, zero=2, sequence_parallel=True), 1),
    "dp4.ep2 zero1 moe": ("tiny-moe", {}, dict(dp=4, ep=2, zero=1), 4),
    "dp2.cp2 zero3 recompute": ("tiny", {}, dict(dp=2, cp=2, zero=3, recompute="full"), 1),
    # ZeRO-2/3 under pipelines: tied embeddings' shards summed over their two ranks; zero bubble
    # reduces after W (ZeRO-3 gathers the units again for it); unused experts reduce zeros.
    "pp2.dp2 zero2 tied": ("tiny", {"tie_embeddings": True}, dict(pp=2, dp=2, zero=2), 1),
    "pp2.dp2 zero3 gpipe": ("tiny", {}, dict(pp=2, dp=2, zero=3, schedule="gpipe"), 1),
    "pp2.dp2 zero3 zb tied recompute": ("tiny", {"tie_embeddings": True}, dict(
        pp=2, dp=2, zero=3, schedule="zb", microbatches=4, recompute="full"), 1),
    "pp2.dp2.ep2 zero2 zb moe": ("tiny-moe", {}, dict(
        pp=2, dp=2, ep=2, zero=2, schedule="zb", microbatches=4), 8),
    # DDP over an MoE model: a rank whose tokens chose no token for an expert still reduces it.
    "dp4 moe": ("tiny-moe", {}, dict(dp=4), 4),
    # SP around expert-parallel MoE layers: their router gradients are whole, not partial.
    "dp2.tp2.ep2 sp moe": ("tiny-moe", {}, dict(dp=2, tp=2, ep=2, sequence_parallel=True), 2),
    # Gradient accumulation over pipeline steps: the tied copies are summed once per step.
    "pp2.dp2 tied accum2": ("tiny", {"tie_embeddings": True}, dict(pp=2, dp=2, grad_accum=2), 1),
    "pp2.dp2 zero1 tied accum2": ("tiny", {"tie_embeddings": True},
                                  dict(pp=2, dp=2, zero=1, grad_accum=2), 1),
}
# Resumed from their step 3 under other layouts, and in one process.
SAVES_AT_3 = {"pp2.dp2 zero1", "dp2.tp2.pp2"}


def run_config(data: str, model: str, overrides: dict, checkpoint_dir: Path, save_every=0,
               resume=False, grad_accum=1, **parallel) -> TrainConfig:
    layout = ParallelConfig(**parallel)
    return TrainConfig(model=model, data=data, model_overrides=overrides, nproc=layout.world_size,
                       parallel=layout, checkpoint_dir=str(checkpoint_dir), grad_accum=grad_accum,
                       save_every=save_every, resume=resume, **COMMON)


def job(rank: int, world_size: int, runs: list) -> list | None:
    """Each run's TrainResult (rank 0). A run may first copy a checkpoint folder and rewind it."""
    results = []
    for config, rewind in runs:
        if rewind is not None and rank == 0:
            rewound_copy(rewind[0], Path(config.checkpoint_dir), rewind[1])
        dist.barrier()
        results.append(launch.train_worker(rank, world_size, config))
    return results if rank == 0 else None


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    return dict(ckpt.load_checkpoint(folder, ckpt.read_model_config(folder))[1]["model"])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def reference(data: str, model: str, overrides: dict, grad_accum: int, folder: Path,
              save_every: int = 0, resume: bool = False):
    return train(TrainConfig(model=model, data=data, model_overrides=overrides,
                             grad_accum=grad_accum, checkpoint_dir=str(folder),
                             save_every=save_every, resume=resume, **COMMON),
                 show_progress=False)


def rewound_copy(source: Path, target: Path, step: int) -> None:
    shutil.copytree(source, target)
    (target / "latest").write_text(ckpt.step_folder_name(step))


def check_run(name: str, result, expected, layout: dict, first_step: int = 1,
              param_rtol=lambda name: 1e-5) -> None:
    """The same numbers as the single-process run `expected`, and a report for every rank.
    `param_rtol`: each final parameter's tolerance, by name."""
    steps = result.report["steps"]
    offset = first_step - 1
    assert [s["step"] for s in steps] == list(range(first_step, 6)), name
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx(
            [s[key] for s in expected.report["steps"][offset:]], rel=1e-5), (name, key)
    assert result.report["validation_loss"] == pytest.approx(
        expected.report["validation_loss"], rel=1e-5), name
    assert result.sample == expected.sample and result.sample, name
    params, reference_params = parameters(result.checkpoint), parameters(expected.checkpoint)
    assert params.keys() == reference_params.keys(), name
    for key, value in reference_params.items():
        assert relative_error(params[key], value) < param_rtol(key), (name, key)

    dims = ParallelConfig(**{
        axis: value for axis, value in layout.items() if axis != "grad_accum"})
    ranks = result.report["ranks"]
    assert [entry["rank"] for entry in ranks] == list(range(dims.world_size)), name
    for entry in ranks:
        coords = dims.coords(entry["rank"])
        assert entry["coords"] == {axis: coords[axis] for axis in ("dp", "pp", "cp", "tp", "ep")}
        assert min(entry["bytes"][k] for k in ("params", "grads", "activations_peak")) > 0, name
        assert set(entry["comm_bytes"]) == {"all_reduce", "reduce_scatter", "all_gather",
                                            "all_to_all", "broadcast", "reduce", "gather",
                                            "scatter", "p2p"}, name
        # The pipeline's measured bubble; no pipeline, no idle time.
        assert (0 < entry["idle_fraction"] < 1) if dims.pp > 1 else \
            entry["idle_fraction"] == 0, name
        assert (entry["comm_bytes"]["p2p"] > 0) == (dims.pp > 1 or dims.cp > 1), name
        assert (entry["comm_bytes"]["all_to_all"] > 0) == (dims.ep > 1), name
    predicted = result.report["predicted"]
    assert "bytes" in predicted or "error" in predicted, name


def run_cases(cases: dict, world_size: int, data: str, tmp_path: Path, extra=()) -> list:
    """Every case on `world_size` ranks in one spawn, checked against its single-process run;
    returns the results of the `extra` runs that follow them."""
    runs = [(run_config(data, model, overrides, tmp_path / name,
                        save_every=3 if name in SAVES_AT_3 else 0, **layout), None)
            for name, (model, overrides, layout, _) in cases.items()]
    results = run_ranks(job, world_size, runs + list(extra), timeout_s=900)[0]
    for (name, (model, overrides, layout, grad_accum)), result in zip(cases.items(), results):
        expected = reference(data, model, overrides, grad_accum, tmp_path / f"{name} reference")
        check_run(name, result, expected, layout)
    return results[len(cases):]


def shard_elements(folder: Path, kind: str) -> dict[str, int]:
    """Elements of `kind` in each shard file of a checkpoint, by file name."""
    counts: dict[str, int] = {}
    for tensors_file in sorted(folder.glob("shard_*.safetensors")):
        with safe_open(str(tensors_file), "pt") as handle:
            counts[tensors_file.name] = sum(math.prod(handle.get_slice(key).get_shape())
                                            for key in handle.keys() if key.startswith(kind + "/"))
    return counts


def test_eight_ranks(corpus_file, tmp_path):
    """Every 8-rank case; then the dp2.tp2.pp2 checkpoint of step 3, written in pieces by the
    ranks that hold them, resumes as dp8 ZeRO-3, dp2.tp4 and pp4.dp2 (and in one process) with
    the uninterrupted run's numbers."""
    source = tmp_path / "dp2.tp2.pp2"
    resumed = {"dp8 zero3 from dp2.tp2.pp2": dict(dp=8, zero=3),
               "dp2.tp4 from dp2.tp2.pp2": dict(dp=2, tp=4),
               "pp4.dp2 from dp2.tp2.pp2": dict(pp=4, dp=2)}
    runs = [(run_config(corpus_file, "tiny", FOUR_LAYERS, tmp_path / name, resume=True,
                        **layout), (source, 3)) for name, layout in resumed.items()]
    results = run_cases(CASES_8, 8, corpus_file, tmp_path, extra=runs)
    single = reference(corpus_file, "tiny", FOUR_LAYERS, 1, tmp_path / "single", save_every=3)
    for (name, layout), result in zip(resumed.items(), results):
        check_run(name, result, single, layout, first_step=4)
    rewound_copy(source, tmp_path / "one process", 3)
    in_one_process = reference(corpus_file, "tiny", FOUR_LAYERS, 1, tmp_path / "one process",
                               resume=True)
    check_run("one process from dp2.tp2.pp2", in_one_process, single, {}, first_step=4)

    # Counting the pieces: every parameter element (and each moment's) is written exactly once.
    num_parameters = in_one_process.report["num_parameters"]
    step_3 = source / ckpt.step_folder_name(3)
    model, moments = shard_elements(step_3, "model"), shard_elements(step_3, "exp_avg")
    dims = ParallelConfig(dp=2, tp=2, pp=2)
    writers = [rank for rank in range(8) if dims.coords(rank)["dp"] == 0]  # dp replicas skip
    assert sorted(model) == [f"shard_{rank:05d}.safetensors" for rank in writers]
    assert sum(model.values()) == sum(moments.values()) == num_parameters
    assert max(model.values()) < num_parameters / 2  # a tp2 x pp2 quarter, not the model
    # ZeRO-3 over dp8: each rank writes its eighth of every flat unit (7 padding elements at most
    # per unit: the embedding, 4 blocks, the final norm with the head).
    zero3 = shard_elements(results[0].checkpoint, "model")
    assert len(zero3) == 8 and sum(zero3.values()) == num_parameters
    assert max(zero3.values()) <= (num_parameters + 6 * 7) // 8 + 1

    # `tetrad export` of the 8-rank checkpoint: an HF folder holding the single-process weights.
    assert main(["export", str(source), "--out", str(tmp_path / "hf")]) == 0
    expected = parameters(single.checkpoint)
    for name, param in load_pretrained(tmp_path / "hf").named_parameters():
        assert relative_error(param.detach(), expected[name]) < 1e-5, name


def llama_folder(folder: Path) -> Path:
    """A small random Llama saved by transformers, with weights far from tetrad's init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.3)).save_pretrained(folder)
    return folder


def test_four_ranks_and_resuming_across_layouts(corpus_file, tmp_path):
    """Checkpoints are read in any layout: ZeRO-1 over pp2.dp2 resumes as DDP over dp2.tp2, tp4
    and pp4, a single-process run resumes as tp2.pp2, and the ZeRO-1 run resumes in one process;
    each finishes with the uninterrupted single-process numbers. An HF folder's weights train
    under tp2.pp2 as in one process."""
    model, overrides, _, _ = CASES_4["pp2.dp2 zero1"]
    single = reference(corpus_file, model, overrides, 1, tmp_path / "single", save_every=3)
    resumed = {"dp2.tp2 from zero1": (dict(dp=2, tp=2), tmp_path / "pp2.dp2 zero1"),
               "tp4 from zero1": (dict(tp=4), tmp_path / "pp2.dp2 zero1"),
               "pp4 from zero1": (dict(pp=4), tmp_path / "pp2.dp2 zero1"),
               "tp2.pp2 from one process": (dict(tp=2, pp=2), tmp_path / "single")}
    runs = [(run_config(corpus_file, model, overrides, tmp_path / name, resume=True, **layout),
             (source, 3)) for name, (layout, source) in resumed.items()]
    hf_folder = llama_folder(tmp_path / "llama")  # HF weights loaded into a tp2.pp2 layout
    runs.append((run_config(corpus_file, str(hf_folder), {}, tmp_path / "hf tp2.pp2", tp=2,
                            pp=2), None))
    results = run_cases(CASES_4, 4, corpus_file, tmp_path, extra=runs)
    for (name, (layout, _)), result in zip(resumed.items(), results):
        check_run(name, result, single, layout, first_step=4)
    check_run("hf tp2.pp2", results[-1],
              reference(corpus_file, str(hf_folder), {}, 1, tmp_path / "hf reference"),
              dict(tp=2, pp=2))
    rewound_copy(tmp_path / "pp2.dp2 zero1", tmp_path / "one process", 3)
    in_one_process = reference(corpus_file, model, overrides, 1, tmp_path / "one process",
                               resume=True)
    check_run("one process from zero1", in_one_process, single, {}, first_step=4)


def test_pipeline_activations_and_tied_copies_in_the_report(corpus_file, tmp_path):
    """Bytes that only a right composition gives: p2p per microbatch of the pipeline, and the
    tied embedding held twice over the pipeline but counted once in the gradient norm."""
    layout = dict(dp=2, pp=2, tp=2, sequence_parallel=True)
    config = run_config(corpus_file, "tiny", {"tie_embeddings": True}, tmp_path / "run", **layout)
    result = run_ranks(job, 8, [(config, None)], timeout_s=600)[0][0]
    expected = reference(corpus_file, "tiny", {"tie_embeddings": True}, 1, tmp_path / "ref")
    check_run("tied sp pipeline", result, expected, layout)
    ranks = result.report["ranks"]
    # Per step a first-stage rank sends 2 microbatches x [2 rows, 32/tp tokens, 64] fp32.
    assert ranks[0]["comm_bytes"]["p2p"] == 2 * 2 * (32 // 2) * 64 * 4
    # Both pipeline ranks hold the embedding's tp shard: together one tied model plus one copy.
    num_parameters = result.report["num_parameters"]
    first, last = ranks[0]["bytes"]["params"], ranks[4]["bytes"]["params"]
    norms_and_biases = 64 * (2 * 2 + 1)  # replicated on both tp ranks: 2 norms per layer + final
    assert 2 * (first + last) == 4 * (num_parameters + 256 * 64 + norms_and_biases)


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--pp", "2"], "4 processes but dp 2 x pp 2"),
    (["--tp", "2"], "1 processes but dp 1 x pp 1 x cp 1 x tp 2"),
    (["--nproc", "3", "--tp", "3"], "tp 3 does not divide num_heads 4"),
    (["--nproc", "4", "--tp", "4", "--config", "ffn.toml"], "does not divide ffn_hidden_size"),
    (["--nproc", "4", "--tp", "4", "--config", "vocab.toml"], "pad the vocabulary to 260"),
    (["--nproc", "3", "--cp", "3"], "does not split into 2*cp = 6 equal chunks"),
    (["--nproc", "2", "--dp", "2", "--ep", "2"], "needs a mixture-of-experts model"),
    (["--nproc", "3", "--dp", "3", "--ep", "3", "--model", "tiny-moe"],
     "ep 3 does not divide num_experts 4"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--vpp", "2",
      "--microbatches", "3"], "microbatches (3) to be a multiple of pp (2)"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "5"], "make it a multiple of 5"),
    (["--nproc", "4", "--pp", "4"], "at least one transformer layer each"),
    (["--nproc", "2", "--pp", "2", "--stage-layers", "1,2"], "sums to 3 but the model has 2"),
    (["--nproc", "2", "--pp", "2", "--stage-layers", "1,x"], "expected layer counts"),
    (["--nproc", "2", "--pp", "2", "--offload"], "--offload needs a ZeRO stage"),
    (["--nproc", "2", "--tp", "2", "--microbatches", "2"], "use --grad-accum"),
    (["--nproc", "2", "--dp", "2", "--sequence-parallel"], "but --tp is 1"),
    (["--nproc", "4", "--tp", "4", "--sequence-parallel", "--seq-len", "34"],
     "seq_len 34 is not a multiple of 4"),
])
def test_bad_layouts_stop_with_one_line_before_any_process_starts(
        capsys, monkeypatch, tmp_path, argv, fragment):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ffn.toml").write_text("[model]\nffn_hidden_size = 178\n")
    (tmp_path / "vocab.toml").write_text("[model]\nvocab_size = 258\n")
    try:
        code = main(["train", "--model", "tiny", "--steps", "2", "--batch-size", "12",
                     "--seq-len", "32", *argv])
    except SystemExit as exit:  # argparse rejects a malformed flag itself
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
