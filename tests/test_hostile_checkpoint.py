"""Damaged and hostile checkpoints: each `tetrad train --resume` from one stops before training
with one line (exit 2) naming what is wrong; nothing is opened outside the checkpoint, nothing is
silently loaded, and no run starts again from step 1 over the saved step folders. A save killed
midway leaves the previous checkpoint loadable."""

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tetrad.cli.main import main
from tetrad.store.safetensors_subset import read_header
from tetrad.train import checkpoint as ckpt

REPO = Path(__file__).resolve().parent.parent
STEP = ckpt.step_folder_name(2)
SHARD = "shard_00000.safetensors"


def train_args(corpus_file, root, *extra):
    return ["train", "--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--sample-tokens", "0", "--data", corpus_file, "--checkpoint-dir", str(root), *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus_file):
    """A checkpoint root holding step 2 of a tiny run."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    assert main(train_args(corpus_file, root, "--steps", "2")) == 0
    return root


@pytest.fixture
def root(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def expect_refused(capsys, corpus_file, root, fragment):
    before = sorted(path.name for path in root.iterdir())
    code = main(train_args(corpus_file, root, "--resume"))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err
    assert sorted(path.name for path in root.iterdir()) == before  # nothing overwritten


def flip_tensor_byte(shard: Path, key_prefix: str = "model/") -> None:
    header, data_start = read_header(shard)
    key = next(key for key in header if key.startswith(key_prefix))
    begin, end = header[key]["data_offsets"]
    data = bytearray(shard.read_bytes())
    data[data_start + (begin + end) // 2] ^= 0x40
    shard.write_bytes(bytes(data))


def edit_index(folder: Path, change) -> None:
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def first_piece(kind, **fields):
    def change(index):
        entry = next(entry for entry in index["pieces"] if entry["kind"] == kind)
        entry.update(fields)
    return change


def test_flipped_bytes_in_a_shards_tensor_data_are_refused_naming_the_file(capsys, corpus_file,
                                                                          root):
    flip_tensor_byte(root / STEP / SHARD)
    expect_refused(capsys, corpus_file, root, f"{SHARD}: the bytes of model/")


def test_flipped_bytes_in_the_adamw_moments_are_refused(capsys, corpus_file, root):
    flip_tensor_byte(root / STEP / SHARD, "exp_avg_sq/")
    expect_refused(capsys, corpus_file, root, f"{SHARD}: the bytes of exp_avg_sq/")


@pytest.mark.parametrize("damage, fragment", [
    (lambda shard: shard.write_bytes(shard.read_bytes()[:-1000]), SHARD),
    (lambda shard: shard.write_bytes(shard.read_bytes()[:6]), SHARD),
    (lambda shard: shard.unlink(), f"{SHARD}: No such file"),
    (lambda shard: shutil.copy(shard, shard.with_name("shard_00001.safetensors")),
     "shard_00001.safetensors is not in its index.json"),
], ids=["truncated", "header-only", "deleted", "extra-shard"])
def test_truncated_missing_and_extra_shards(capsys, corpus_file, root, damage, fragment):
    damage(root / STEP / SHARD)
    expect_refused(capsys, corpus_file, root, fragment)


def swap_offsets(header):
    first, second = [key for key in header if key.startswith("exp_avg/")
                     and header[key]["shape"] == header["exp_avg/embed.weight"]["shape"]][:2]
    header[first]["data_offsets"], header[second]["data_offsets"] = (
        header[second]["data_offsets"], header[first]["data_offsets"])


def overflow_offsets(header):
    header["exp_avg/embed.weight"]["data_offsets"] = [0, 10**9]


@pytest.mark.parametrize("change, fragment", [
    (swap_offsets, f"{SHARD}: the bytes of exp_avg/"),
    (overflow_offsets, f"{SHARD}: Error while deserializing header"),
], ids=["swapped", "beyond-the-file"])
def test_wrong_offsets_in_a_shards_header(capsys, corpus_file, root, change, fragment):
    shard = root / STEP / SHARD
    header, data_start = read_header(shard)
    data = shard.read_bytes()[data_start:]
    change(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    expect_refused(capsys, corpus_file, root, fragment)


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../etc/passwd", "../other/" + SHARD,
                                  ".hidden"])
def test_an_index_naming_files_outside_its_folder_opens_nothing(capsys, corpus_file, root,
                                                                 monkeypatch, name):
    opened = []
    real_open = ckpt.ShardedReader._read
    monkeypatch.setattr(ckpt.ShardedReader, "_read",
                        lambda self, entry: opened.append(entry["file"]) or real_open(self, entry))
    edit_index(root / STEP, first_piece("model", file=name))
    (root / STEP / SHARD).unlink()  # the other pieces' file must not be what fails
    expect_refused(capsys, corpus_file, root, f"names {name!r}, a file outside the checkpoint")
    assert opened == []


def test_another_runs_shard_by_absolute_path_is_refused(capsys, corpus_file, root, tmp_path):
    other = tmp_path / "other_run"
    shutil.copytree(root / STEP, other)
    edit_index(root / STEP, lambda index: [entry.update(file=str(other / SHARD))
                                           for entry in index["pieces"]])
    (root / STEP / SHARD).unlink()
    expect_refused(capsys, corpus_file, root, "a file outside the checkpoint folder")


def test_a_shard_linking_outside_the_folder_is_refused(capsys, corpus_file, root, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(root / STEP / SHARD, outside)
    (root / STEP / SHARD).symlink_to(outside)
    expect_refused(capsys, corpus_file, root, f"{SHARD} is a link to {outside}")


@pytest.mark.parametrize("change, fragment", [
    (first_piece("model", flat=[0, 10**9]), "flat range [0, 1000000000] outside"),
    (first_piece("model", flat=[0, 3]), "the index places 3 elements"),
    (first_piece("model", dim=0, rows=[[0, 10**6]]), "rows [[0, 1000000]] outside"),
    (first_piece("model", dim=7, rows=[[0, 1]]), "dim 7"),
    (first_piece("model", shape="big"), "shape is 'big'"),
    (first_piece("model", shape=[-4, 2]), "shape is [-4, 2]"),
    (first_piece("model", file=None), "file is None"),
    (lambda index: index["pieces"].append(7), "not an object"),
    (lambda index: index.update(pieces={"a": 1}), "not an object with a list of pieces"),
], ids=["flat-beyond", "flat-short", "rows-beyond", "dim-beyond", "shape-string",
        "shape-negative", "file-null", "entry-number", "pieces-dict"])
def test_wrong_index_entries_are_named(capsys, corpus_file, root, change, fragment):
    edit_index(root / STEP, change)
    expect_refused(capsys, corpus_file, root, fragment)


@pytest.mark.parametrize("text, fragment", [
    ("{ truncated", "index.json: Expecting"),
    ("[1, 2]", "index.json is not an object"),
    ("[" * 100_000, "index.json"),
], ids=["not-json", "a-list", "deep"])
def test_an_index_that_is_not_one_is_named(capsys, corpus_file, root, text, fragment):
    (root / STEP / "index.json").write_text(text)
    expect_refused(capsys, corpus_file, root, fragment)


@pytest.mark.parametrize("content, fragment", [
    (b"", "latest holds ''"),
    (b"\xff\xfe\x00\x9c", "latest is not readable text"),
    (b"step_00000009", "step_00000009 named by"),
    (b"step_-0000001", "latest holds 'step_-0000001', not a step folder name"),
    (b"../../etc", "latest holds '../../etc'"),
], ids=["empty", "binary", "missing-target", "negative", "outside"])
def test_a_bad_latest_never_restarts_from_step_1(capsys, corpus_file, root, content, fragment):
    (root / ckpt.LATEST).write_bytes(content)
    expect_refused(capsys, corpus_file, root, fragment)


def test_step_folders_without_latest_are_not_overwritten(capsys, corpus_file, root):
    (root / ckpt.LATEST).unlink()
    expect_refused(capsys, corpus_file, root, f"holds {STEP} but no latest file")


@pytest.mark.parametrize("file, content, fragment", [
    ("run.json", "garbage", "run.json: Expecting value"),
    ("run.json", '{"step": -3}', "run.json's step is -3"),
    ("run.json", '{"step": 7}', "run.json's step is 7, not the step of its folder"),
    ("run.json", "[2]", "run.json's step is None"),
    ("training_state.pt", "garbage", "training_state.pt does not match its checksum"),
    ("model.json", "[1, 2]", "model.json does not match its checksum"),
], ids=["run-garbage", "run-negative", "run-other-step", "run-list", "state-garbage",
        "model-list"])
def test_damaged_small_files_are_named(capsys, corpus_file, root, file, content, fragment):
    (root / STEP / file).write_text(content)
    expect_refused(capsys, corpus_file, root, fragment)


def test_flipped_bytes_in_the_training_state_fail_its_checksum(capsys, corpus_file, root):
    state = root / STEP / "training_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the generator states: torch.load alone reads it
    state.write_bytes(bytes(data))
    expect_refused(capsys, corpus_file, root, "training_state.pt does not match its checksum")


@pytest.mark.parametrize("file, content, fragment", [
    ("training_state.pt", b"PK\x03\x04 garbage", "training_state.pt: "),
    ("model.json", b"[1, 2]", "model.json holds a list"),
    ("model.json", b"\xff\xfe", "model.json: 'utf-8' codec can't decode"),
], ids=["state-garbage", "model-list", "model-binary"])
def test_damaged_files_without_checksums_are_named(capsys, corpus_file, root, file, content,
                                                    fragment):
    """Checkpoints of an older tetrad have no checksums: loading still checks what it reads."""
    run = json.loads((root / STEP / "run.json").read_text())
    del run["sha256"]
    (root / STEP / "run.json").write_text(json.dumps(run))
    (root / STEP / file).write_bytes(content)
    expect_refused(capsys, corpus_file, root, fragment)


def test_a_training_state_without_generator_states_is_named(capsys, corpus_file, root):
    state = root / STEP / "training_state.pt"
    torch.save({"optimizer": {"step": 2}, "rng": [torch.zeros(3)]}, state)
    run = json.loads((root / STEP / "run.json").read_text())
    run["sha256"]["training_state.pt"] = ckpt.file_digest(state)  # a consistent forgery
    (root / STEP / "run.json").write_text(json.dumps(run))
    expect_refused(capsys, corpus_file, root, "lacks the optimizer step or the ranks' generator")


def test_a_checkpoint_past_the_requested_steps_is_not_relabelled(capsys, corpus_file, root):
    code = main(train_args(corpus_file, root, "--resume", "--steps", "1"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "at step 2, past --steps 1" in err, err
    assert (root / ckpt.LATEST).read_text() == STEP


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    from tetrad.spec.presets import preset
    from tetrad.sharded_tensors import whole_pieces
    from tetrad.train import checkpoint as ckpt

    def save(step):
        pieces = whole_pieces("model", {"w": torch.full((4,), float(step))})
        state = {"optimizer": {"step": step}, "rng": [torch.get_rng_state()]}
        ckpt.save_checkpoint(sys.argv[1], step, 0, pieces, lambda value: [value], state,
                             preset("tiny"), {})

    save(2)
    def killed(*args, **kwargs):  # the process dies with its shard written, mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.torch.save = killed
    save(4)
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    child = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(root)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    assert (root / ckpt.LATEST).read_text() == STEP
    assert (root / f".tmp-{ckpt.step_folder_name(4)}").is_dir()
    folder = ckpt.find_checkpoint(root)
    step, state = ckpt.load_checkpoint(folder, ckpt.read_model_config(folder))
    assert step == 2 and torch.equal(state["model"]["w"], torch.full((4,), 2.0))
