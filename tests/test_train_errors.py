"""Bad input stops `tetrad train` before any training, with one line saying what to change."""

import pytest

from tetrad.cli.main import main


def run_cli(capsys, *argv):
    code = main(["train", "--steps", "2", "--sample-tokens", "0", *argv])
    captured = capsys.readouterr()
    return code, captured.err.strip()


def expect_error(capsys, fragment, *argv):
    code, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err
    return err


def test_unknown_preset_names_close_matches(capsys):
    expect_error(capsys, "did you mean tiny", "--model", "tinny")


def test_missing_data_path(capsys, tmp_path):
    expect_error(capsys, str(tmp_path / "nope.txt"), "--model", "tiny",
                 "--data", str(tmp_path / "nope.txt"))


@pytest.mark.parametrize("fields, fragment", [
    ("hidden_size = 66\nnum_heads = 4", "not divisible by num_heads"),
    ("hidden_size = 64\nnum_heads = 4\nnum_kv_heads = 3", "does not divide num_heads"),
    ("hiden_size = 64", "did you mean hidden_size"),
])
def test_impossible_model_shapes(capsys, tmp_path, fields, fragment):
    model_file = tmp_path / "model.toml"
    model_file.write_text(fields + "\n")
    expect_error(capsys, fragment, "--model", str(model_file))


def test_sequence_longer_than_max_positions(capsys):
    expect_error(capsys, "max_seq_len 128", "--model", "tiny", "--seq-len", "4096")


def test_unknown_config_key(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\nstepz = 3\n')
    expect_error(capsys, "did you mean steps", "--config", str(config))


def test_corrupt_and_mismatched_checkpoints(capsys, tmp_path, corpus_file):
    root = tmp_path / "ckpt"
    code, _ = run_cli(capsys, "--model", "tiny", "--data", corpus_file, "--seq-len", "32",
                      "--batch-size", "2", "--checkpoint-dir", str(root))
    assert code == 0
    expect_error(capsys, "made for another model", "--model", "tiny-moe", "--data", corpus_file,
                 "--checkpoint-dir", str(root), "--resume")
    folder = root / "step_00000002"
    index = (folder / "index.json").read_text()
    (folder / "index.json").write_text(index.replace('"shard_00000', '"shard_00007'))
    expect_error(capsys, "shard_00000.safetensors is not in its index.json", "--model", "tiny", "--data",
                 corpus_file, "--seq-len", "32", "--checkpoint-dir", str(root), "--resume",
                 "--steps", "4")
    (folder / "index.json").write_text(index)
    (folder / "shard_00000.safetensors").write_bytes(b"not a safetensors file")
    expect_error(capsys, "is corrupt (shard_00000.safetensors", "--model", "tiny", "--data",
                 corpus_file, "--seq-len", "32", "--checkpoint-dir", str(root), "--resume",
                 "--steps", "4")
    (root / "step_00000002" / "model.json").write_text("{ truncated")
    expect_error(capsys, "is corrupt", "--model", "tiny", "--data", corpus_file,
                 "--checkpoint-dir", str(root), "--resume")
