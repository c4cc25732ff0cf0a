"""Single-process training: determinism, exact resume, atomic checkpoints, the run report."""

import json

import pytest
import torch

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.errors import TetradError
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import preset, resolve_model
from tetrad.sharded_tensors import whole_pieces, write_pieces
from tetrad.train import checkpoint as ckpt
from tetrad.train.trainer import train


def tiny_config(corpus_file, **changes):
    values = dict(model="tiny", data=corpus_file, steps=6, batch_size=4, seq_len=32,
                  warmup_steps=2, sample_tokens=0, log_every=1)
    return TrainConfig(**{**values, **changes})


def losses(result):
    return [step["loss"] for step in result.report["steps"]]


def test_fp32_runs_are_bit_identical_and_seed_matters(corpus_file):
    first = losses(train(tiny_config(corpus_file), show_progress=False))
    second = losses(train(tiny_config(corpus_file), show_progress=False))
    other_seed = losses(train(tiny_config(corpus_file, seed=1), show_progress=False))
    assert first == second
    assert first != other_seed


def test_loss_falls(corpus_file):
    result = train(tiny_config(corpus_file, steps=40, batch_size=8, lr=1e-2),
                   show_progress=False)
    steps = result.report["steps"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0


def test_gradient_accumulation_matches_one_big_batch(corpus_file):
    whole = losses(train(tiny_config(corpus_file, batch_size=8), show_progress=False))
    accumulated = losses(train(tiny_config(corpus_file, batch_size=8, grad_accum=4),
                               show_progress=False))
    assert accumulated == pytest.approx(whole, rel=1e-5)


def test_resume_continues_with_the_uninterrupted_losses(corpus_file, tmp_path):
    uninterrupted = losses(train(tiny_config(corpus_file), show_progress=False))
    root = tmp_path / "ckpt"
    train(tiny_config(corpus_file, checkpoint_dir=str(root), save_every=3), show_progress=False)
    # Make the run look as if it was killed after step 3: drop the later checkpoint.
    (root / "latest").write_text(ckpt.step_folder_name(3))
    resumed = train(tiny_config(corpus_file, checkpoint_dir=str(root), resume=True),
                    show_progress=False)
    assert [s["step"] for s in resumed.report["steps"]] == [4, 5, 6]
    assert losses(resumed) == uninterrupted[3:]


def test_a_save_killed_midway_leaves_the_previous_checkpoint_valid(corpus_file, tmp_path,
                                                                   monkeypatch):
    root = tmp_path / "ckpt"
    train(tiny_config(corpus_file, steps=3, checkpoint_dir=str(root)), show_progress=False)
    real_save = torch.save

    def crash_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(torch, "save", crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(corpus_file, steps=5, checkpoint_dir=str(root), resume=True),
              show_progress=False)
    monkeypatch.undo()
    assert (root / "latest").read_text() == ckpt.step_folder_name(3)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        ckpt.step_folder_name(3)]
    resumed = train(tiny_config(corpus_file, steps=5, checkpoint_dir=str(root), resume=True),
                    show_progress=False)
    assert [s["step"] for s in resumed.report["steps"]] == [4, 5]
    assert not any(p.name.startswith(".tmp") for p in root.iterdir())


def test_run_report_counts_bytes(corpus_file, tmp_path):
    report_path = tmp_path / "report.json"
    result = train(tiny_config(corpus_file, report=str(report_path)), show_progress=False)
    report = json.loads(report_path.read_text())
    assert report["schema"] == 1 and report["config"]["model"] == "tiny"
    assert {"step", "loss", "grad_norm", "time_s", "tokens"} <= set(report["steps"][0])
    rank = report["ranks"][0]
    num_params = result.report["num_parameters"]
    assert rank["bytes"]["params"] == rank["bytes"]["grads"] == 4 * num_params
    # AdamW keeps two fp32 moments per parameter plus one scalar step counter per tensor.
    num_tensors = len(list(Transformer(resolve_model("tiny")).parameters()))
    assert rank["bytes"]["optimizer"] == 8 * num_params + 4 * num_tensors
    assert all(value == 0 for value in rank["comm_bytes"].values())


def test_activation_bytes_grow_linearly_with_the_batch(corpus_file):
    def peak(batch_size):
        report = train(tiny_config(corpus_file, steps=1, batch_size=batch_size),
                       show_progress=False).report
        return report["ranks"][0]["bytes"]["activations_peak"]

    # Linear, not proportional: the rotary cos/sin tables do not depend on the batch.
    assert peak(4) + peak(12) == 2 * peak(8)
    assert peak(8) - peak(4) > 1_000_000


def test_bf16_and_fp16_train(corpus_file):
    for dtype in ("bf16", "fp16"):
        result = train(tiny_config(corpus_file, steps=20, batch_size=8, lr=1e-2, dtype=dtype),
                       show_progress=False)
        steps = result.report["steps"]
        assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, dtype


def test_a_non_finite_gradient_stops_the_run_naming_step_and_parameter(corpus_file, monkeypatch):
    from tetrad.errors import TetradError
    from tetrad.train import trainer

    real_build = trainer.build_model

    def build_with_a_poisoned_gradient(model_config, config):
        model = real_build(model_config, config)
        model.layers[1].mlp.down.weight.register_hook(lambda grad: grad * float("inf"))
        return model

    monkeypatch.setattr(trainer, "build_model", build_with_a_poisoned_gradient)
    with pytest.raises(TetradError, match=r"at step 1, first non-finite gradient in "
                                          r"layers\.1\.mlp\.down\.weight"):
        train(tiny_config(corpus_file), show_progress=False)


def test_recompute_in_one_process_keeps_the_losses_and_saves_activations(corpus_file):
    def run(mode):
        config = tiny_config(corpus_file, parallel=ParallelConfig(recompute=mode))
        result = train(config, show_progress=False)
        return losses(result), result.report["ranks"][0]["bytes"]["activations_peak"]

    (none_losses, none_bytes), (full_losses, full_bytes) = run("none"), run("full")
    assert full_losses == none_losses
    assert full_bytes < none_bytes / 2


def test_keep_leaves_only_the_newest_checkpoints_and_still_resumes(corpus_file, tmp_path):
    uninterrupted = losses(train(tiny_config(corpus_file, steps=5), show_progress=False))
    root = tmp_path / "ckpt"
    train(tiny_config(corpus_file, steps=5, checkpoint_dir=str(root), save_every=1, keep=2),
          show_progress=False)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        ckpt.step_folder_name(4), ckpt.step_folder_name(5)]
    assert (root / "latest").read_text() == ckpt.step_folder_name(5)
    # Make the run look as if it was killed after step 4: resume from the older kept folder.
    (root / "latest").write_text(ckpt.step_folder_name(4))
    resumed = train(tiny_config(corpus_file, steps=5, checkpoint_dir=str(root), save_every=1,
                                keep=2, resume=True), show_progress=False)
    assert [s["step"] for s in resumed.report["steps"]] == [5]
    assert losses(resumed) == uninterrupted[4:]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        ckpt.step_folder_name(4), ckpt.step_folder_name(5)]


def test_a_checkpoint_folder_not_shared_by_every_rank_is_named(tmp_path):
    """Ranks on another machine write into a folder rank 0 cannot see: the save stops naming the
    rank and the fix, and `latest` never points at the incomplete folder."""
    config = preset("tiny")
    piece = whole_pieces("model", {"w": torch.zeros(2)})

    def elsewhere(value):  # rank 1's shard went to its own machine's disk
        entries = write_pieces(tmp_path / "other machine", 1, piece) if value else None
        return [value, entries]

    (tmp_path / "other machine").mkdir()
    with pytest.raises(TetradError, match="rank 1 cannot write into rank 0's checkpoint folder"):
        ckpt.save_checkpoint(tmp_path / "ckpt", 3, 0, piece, elsewhere, {}, config, {})
    assert not (tmp_path / "ckpt" / "latest").exists()
    with pytest.raises(TetradError, match="rank 2 cannot write"):
        ckpt.save_checkpoint(tmp_path / "not here", 3, 2, piece, lambda value: [value], {},
                             config, {})
    # A rank with nothing to write (a parameter server's other workers) need not see it.
    assert ckpt.save_checkpoint(tmp_path / "not here", 3, 2, [], lambda value: [value], {},
                                config, {}) is None
