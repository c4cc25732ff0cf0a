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


@pytest.mark.parametrize("argv, fragment", [
    (["--lr", "nan"], "lr must be a finite number, got nan"),
    (["--lr", "inf"], "lr must be a finite number, got inf"),
    (["--lr", "-0.1"], "lr must be >= 0"),
    (["--grad-clip", "nan"], "grad_clip must be a finite number"),
    (["--seed", str(10**23)], "seed must be in [0, 2**63)"),
    (["--seed", "-1"], "seed must be in [0, 2**63)"),
    (["--steps", "0"], "steps must be > 0"),
    (["--steps", "-5"], "steps must be > 0"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_nonsense_numbers_on_the_command_line(capsys, argv, fragment):
    expect_error(capsys, fragment, "--model", "tiny", *argv)


@pytest.mark.parametrize("flag, value", [("--seed", "1e23"), ("--batch-size", "1e8")])
def test_counts_written_as_floats_are_refused_by_the_parser(capsys, flag, value):
    with pytest.raises(SystemExit) as stopped:
        main(["train", flag, value])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"invalid int value: '{value}'" in err


@pytest.mark.parametrize("line, fragment", [
    ("seed = 1e23", "seed must be an integer, got 1e+23"),
    ("warmup_steps = 2.5", "warmup_steps must be an integer, got 2.5"),
    ("lr = nan", "lr must be a finite number, got nan"),
    ("beta2 = 1.0", "beta2 must be in [0, 1)"),
    ('batch_size = "8"', "batch_size must be an integer, got '8'"),
    ("data = 5", "data must be a str, got 5"),
])
def test_nonsense_values_in_a_toml_config(capsys, tmp_path, line, fragment):
    config = tmp_path / "run.toml"
    config.write_text(f'model = "tiny"\n{line}\n')
    expect_error(capsys, fragment, "--config", str(config))


def test_a_batch_that_cannot_fit_is_refused_before_building_it(capsys, corpus_file):
    """10^8 sequences of 33 token ids alone are 26 GB: one line naming the estimate, at once."""
    err = expect_error(capsys, "--batch-size 100000000 x --seq-len 32 needs about", "--model",
                       "tiny", "--data", corpus_file, "--seq-len", "32",
                       "--batch-size", "100000000")
    assert "lower --batch-size" in err
