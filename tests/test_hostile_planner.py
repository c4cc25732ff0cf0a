"""Hostile input to the torch-free commands (`tetrad plan`, `schedule`, `mesh`, `report`): every
case answers with one line on stderr and exit status 2, quickly, never a traceback, a hang or a
NaN; the counts that used to hang the search (a trillion GPUs, a batch of billions) answer in
seconds; and the bounded activation walk gives the peak of the full one."""

from __future__ import annotations

import json
import time

import pytest

from tetrad.cli.main import main

PLAN = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"]
SERVE = ["plan", "serve", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"]
HUGE = "1" + "0" * 30
# What used to take 20 s to hours now answers at once; a loaded 2-core machine needs slack.
QUICK_S = 5.0


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stopped:  # what argparse itself refuses
        return stopped.code


def _refused(capsys, argv: list[str], words: str) -> None:
    started = time.perf_counter()
    status = _run(argv)
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert status == 2, (status, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tetrad ") and " error: " in lines[0], \
        captured.err
    assert words in lines[0], lines[0]
    assert elapsed < QUICK_S, f"{elapsed:.1f} s"


def _with(base: list[str], flag: str, value: str) -> list[str]:
    """`base` with `flag` set to `value` (replacing the base's own value of it)."""
    if flag in base:
        at = base.index(flag)
        return base[:at] + [flag, value] + base[at + 2:]
    return base + [flag, value]


# (flag, value, words): the planner's counts at 0, negative, NaN, inf, 1e30, a 31-digit integer,
# an empty string and a non-number.
PLAN_COUNTS = ["--num-gpus", "--gpus-per-node", "--tp", "--pp", "--dp", "--cp", "--ep", "--vpp",
               "--micro-batch", "--global-batch", "--seq-len", "--top"]
COUNT_CASES = [(flag, value, words) for flag in PLAN_COUNTS for value, words in (
    ("0", f"{flag} must be at least 1, got 0"), ("-3", f"{flag} must be at least 1, got -3"),
    (HUGE, f"{flag} {HUGE} is more than"), ("nan", "invalid int value: 'nan'"),
    ("inf", "invalid int value: 'inf'"), ("1e30", "invalid int value: '1e30'"),
    ("", "invalid int value: ''"), ("eight", "invalid int value: 'eight'"))]


@pytest.mark.parametrize("flag, value, words", COUNT_CASES)
def test_plan_train_counts(capsys, flag, value, words):
    _refused(capsys, _with(PLAN, flag, value), words)


REAL_CASES = [
    ("--tokens", "nan", "--tokens must be a finite number, got nan"),
    ("--tokens", "inf", "--tokens must be a finite number, got inf"),
    ("--tokens=-inf", None, "--tokens must be a finite number"),
    ("--tokens", "-1", "--tokens must be at least 0, got -1"),
    ("--tokens", "1e30", "--tokens 1e+30 is more than 1e+18"),
    ("--tokens", "", "invalid float value: ''"),
    ("--tokens", "lots", "invalid float value: 'lots'"),
    ("--nic-gbps", "nan", "--nic-gbps must be a finite number, got nan"),
    ("--nic-gbps", "inf", "--nic-gbps must be a finite number, got inf"),
    ("--nic-gbps", "0", "--nic-gbps must be at least 1, got 0"),
    ("--nic-gbps", "-400", "--nic-gbps must be at least 1, got -400"),
    ("--nic-gbps", "1e30", "--nic-gbps 1e+30 is more than 100000"),
    ("--nic-gbps", "1e-300", "--nic-gbps must be at least 1"),
]


@pytest.mark.parametrize("flag, value, words", REAL_CASES)
def test_plan_train_reals(capsys, flag, value, words):
    _refused(capsys, PLAN + [flag] if value is None else _with(PLAN, flag, value), words)


@pytest.mark.parametrize("flag, value, words", [
    ("--prompt-len", "0", "--prompt-len must be at least 1"),
    ("--prompt-len", HUGE, "--prompt-len " + HUGE + " is more than 16,777,216"),
    ("--output-len", "-1", "--output-len at least 0, got 1024 and -1"),
    ("--output-len", HUGE, "--output-len " + HUGE + " is more than"),
    ("--context-len", "0", "--context-len must be at least 1"),
    ("--context-len", "16", "--context-len 16 cannot hold the prompt and the output"),
    ("--batch", "-1", "--batch must be a number of concurrent sequences"),
    ("--batch", HUGE, "--batch " + HUGE + " is more than"),
    ("--num-gpus", HUGE, "is more than 1,048,576, the largest cluster"),
    ("--nic-gbps", "nan", "--nic-gbps must be a finite number"),
    ("--tp", "nan", "invalid int value: 'nan'"),
])
def test_plan_serve_numbers(capsys, flag, value, words):
    _refused(capsys, _with(SERVE, flag, value), words)


@pytest.mark.parametrize("extra, words", [
    # These ran for 20 s to hours: the search walked every number up to the count.
    (["--num-gpus", "1099511627776"], "more than 1,048,576, the largest cluster"),
    (["--num-gpus", "100000000000000000000"], "more than 1,048,576"),
    (["--num-gpus", "1e20"], "invalid int value: '1e20'"),
    (["--global-batch", "1000000000000000"], "--global-batch 1000000000000000 is more than"),
    (["--global-batch", "1e15"], "invalid int value: '1e15'"),
    (["--global-batch", "2147483648", "--dp", "8"], "--global-batch 2147483648 is more than"),
])
def test_counts_that_used_to_hang_answer_at_once(capsys, extra, words):
    argv = PLAN
    for flag, value in zip(extra[::2], extra[1::2]):
        argv = _with(argv, flag, value)
    _refused(capsys, argv, words)


@pytest.mark.parametrize("argv", [
    # The largest allowed counts plan in seconds: the search's loops run over the divisors it
    # needs (up to the layer count, up to 16 sequences per microbatch), not up to the count.
    PLAN[:-1] + ["1048576", "--model", "llama3-405b"],
    _with(PLAN, "--global-batch", str(2**24)) + ["--dp", "8"],
    SERVE[:-1] + ["1048576"],
    # tetrad's runtime profile walks the schedule for the activation peak: 4M microbatches.
    _with(PLAN, "--global-batch", str(2**24)) + [
        "--stack", "tetrad", "--seq-len", "1024", "--pp", "2", "--dp", "4", "--tp", "1",
        "--micro-batch", "1", "--zero", "1", "--recompute", "none", "--schedule",
        "interleaved", "--vpp", "2", "--json"],
])
def test_the_largest_allowed_counts_plan_quickly(capsys, argv):
    started = time.perf_counter()
    assert _run(argv) in (0, 1)  # 1: nothing fits, which the plan says
    assert time.perf_counter() - started < 3 * QUICK_S
    out = capsys.readouterr().out
    assert "configs" in json.loads(out) if "--json" in argv else "tp" in out


def test_plan_json_has_no_nan_or_infinity(capsys):
    assert main(PLAN + ["--tokens", "1e18", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(name))
    assert plan["configs"][0]["days"] > 0


def _write(path, content: str | bytes):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


LLAMA = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=128, max_seq_len=128)
HF = dict(model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
          max_position_embeddings=128)
MODEL_FILES = [
    ("fields.json", json.dumps({**LLAMA, "hidden_size": 64.0}), "hidden_size must be an integer"),
    ("fields.json", json.dumps({**LLAMA, "hidden_size": "64"}), "hidden_size must be an integer"),
    ("fields.json", json.dumps({**LLAMA, "hidden_size": None}), "hidden_size must be an integer"),
    ("fields.json", json.dumps({**LLAMA, "num_layers": True}), "num_layers must be an integer"),
    ("fields.json", json.dumps({**LLAMA, "num_kv_heads": -2}), "num_kv_heads must be >= 0"),
    ("fields.json", json.dumps({**LLAMA, "num_kv_heads": 3}), "num_kv_heads 3 does not divide"),
    ("fields.json", json.dumps({**LLAMA, "num_heads": 5}), "not divisible by num_heads 5"),
    ("fields.json", json.dumps({**LLAMA, "num_layers": 0}), "num_layers must be > 0"),
    ("fields.json", json.dumps({**LLAMA, "num_layers": 10**12}), "num_layers 1000000000000 is"),
    ("fields.json", json.dumps({**LLAMA, "vocab_size": 10**40}), "vocab_size 1" + "0" * 40),
    ("fields.json", json.dumps({**LLAMA, "norm_eps": 0}), "norm_eps must be > 0"),
    ("fields.json", '{"hidden_size": 1e400}', "hidden_size must be an integer, got inf"),
    ("fields.json", '{"norm_eps": NaN}', "norm_eps must be a finite number, got nan"),
    ("fields.json", '{"hidden_size": 1' + "0" * 5000 + "}", "is not valid JSON: Exceeds"),
    ("fields.json", "[1, 2]", "must hold one JSON object of model fields, not a list"),
    ("fields.json", '"llama"', "must hold one JSON object of model fields, not a str"),
    ("fields.json", b"\xff\xfe\x00\x01binary", "is not valid JSON: not UTF-8 text (byte 0)"),
    ("fields.json", b'{"name": "\xc3\x28"}', "is not valid JSON: not UTF-8 text"),
    ("fields.json", "[" * 100_000, "is not valid JSON: nested too deeply"),
    ("fields.json", '{"a":' * 100_000, "is not valid JSON: nested too deeply"),
    ("fields.json", '{"hidden_size": 64,', "is not valid JSON"),
    ("fields.json", "", "is not valid JSON"),
    ("fields.toml", b"\xff\xfebinary", "is not valid TOML: not UTF-8 text"),
    ("fields.toml", "a = " + "[" * 100_000, "is not valid TOML: nested too deeply"),
    ("fields.toml", "hidden_size = 1e400", "hidden_size must be an integer, got inf"),
    ("fields.toml", "hidden_size = nan", "hidden_size must be an integer, got nan"),
    ("fields.toml", "num_layers = true", "num_layers must be an integer, got True"),
    ("fields.toml", "num_layers = 2.0", "num_layers must be an integer, got 2.0"),
    ("fields.toml", "layers = 2", "unknown ModelConfig field 'layers'"),
    ("config.json", json.dumps({**HF, "num_key_value_heads": 0}), "num_key_value_heads must be"),
    ("config.json", json.dumps({**HF, "num_hidden_layers": True}), "num_hidden_layers must be an"),
    ("config.json", json.dumps({**HF, "hidden_size": 64.5}), "hidden_size must be an integer"),
    ("config.json", json.dumps({**HF, "vocab_size": None}), "vocab_size must be an integer"),
    ("config.json", json.dumps({**HF, "rope_theta": "big"}), "rope_theta must be a finite"),
    ("config.json", json.dumps({**HF, "rms_norm_eps": [1]}), "rms_norm_eps must be a finite"),
    ("config.json", json.dumps({**HF, "sliding_window": "4k"}), "sliding_window must be an"),
    ("config.json", json.dumps({**HF, "tie_word_embeddings": "yes"}), "must be true or false"),
    ("config.json", json.dumps({**HF, "rope_scaling": [2]}), "rope_scaling must be a JSON obj"),
    ("config.json", json.dumps({**HF, "rope_scaling": {"rope_type": "yarn", "factor": "x"}}),
     "factor must be a finite number"),
    ("config.json", json.dumps({**HF, "model_type": ["llama"]}), "is not supported"),
]


@pytest.mark.parametrize("name, content, words", MODEL_FILES)
def test_bad_model_files(capsys, tmp_path, name, content, words):
    folder = tmp_path / "model"
    folder.mkdir()
    path = _write(folder / name, content)
    _refused(capsys, _with(PLAN, "--model", path), words)


def test_checkpoint_model_json_and_latest(capsys, tmp_path):
    step = tmp_path / "step_00000002"
    step.mkdir()
    _write(step / "model.json", "[1, 2, 3]")
    _refused(capsys, _with(PLAN, "--model", str(step)), "must hold one JSON object")
    _write(tmp_path / "latest", b"\xff\xfe\x00")
    _refused(capsys, _with(PLAN, "--model", str(tmp_path)), "latest names '', which is not")
    _write(tmp_path / "latest", "..")
    _refused(capsys, _with(PLAN, "--model", str(tmp_path)), "latest names '..', which is not")


PROFILE_CASES = [
    (b"\xff\xfe\x00binary", "invalid JSON"),
    ("[" * 100_000, "invalid JSON"),
    ('{"schema": 1, "n": 1' + "0" * 5000 + "}", "invalid JSON"),
    ("[1, 2]", "is not a schema-1 hardware profile"),
    ({"memory_bytes": "80GB"}, "memory_bytes must be a finite non-negative number"),
    ({"memory_bandwidth": float("nan")}, "needs positive peak_flops and memory_bandwidth"),
    ({"nic_bandwidth": -1}, "nic_bandwidth must be a finite non-negative number"),
    ({"peak_flops": {"bf16": "fast"}}, "is not a valid hardware profile"),
    ({"peak_flops": {"bf16": -1}}, "needs positive peak_flops"),
    ({"peak_flops": []}, "is not a valid hardware profile"),
    ({"name": None}, "name and aliases must be strings"),
    ({"efficiency": {"matmul": 0}}, "matmul must be a finite positive number"),
    ({"efficiency": {"intra_latency_s": None}}, "intra_latency_s must be a finite"),
    ({"efficiency": None}, "is not a valid hardware profile"),
]


@pytest.mark.parametrize("change, words", PROFILE_CASES)
def test_bad_gpu_profiles(capsys, tmp_path, change, words):
    from tetrad.hardware.catalog import gpu
    from tetrad.hardware.profile import profile_to_dict

    if isinstance(change, dict):
        profile = profile_to_dict(gpu("h100"))
        for key, value in change.items():
            if isinstance(value, dict) and isinstance(profile.get(key), dict):
                profile[key].update(value)
            else:
                profile[key] = value
        # NaN goes out as the bare token Python's reader takes back (a hand-edited file).
        change = json.dumps(profile)
    path = _write(tmp_path / "gpu.json", change)
    _refused(capsys, _with(PLAN, "--gpu", path), words)
    _refused(capsys, _with(SERVE, "--gpu", path), words)


@pytest.mark.parametrize("png, words", [
    ("/proc/x.png", "cannot write the picture to /proc/x.png"),
    ("{tmp}/missing/folder/x.png", "cannot write the picture to"),
    ("{tmp}/folder.png", "cannot write the picture to"),  # a folder of that name
    ("{tmp}/x.unknownformat", "cannot write the picture to"),
])
def test_unwritable_pictures(capsys, tmp_path, png, words):
    pytest.importorskip("matplotlib")
    (tmp_path / "folder.png").mkdir()
    png = png.format(tmp=tmp_path)
    _refused(capsys, PLAN + ["--png", png], words)
    _refused(capsys, ["schedule", "--pp", "2", "--microbatches", "2", "--png", png], words)


SCHEDULE = ["schedule", "--pp", "4", "--microbatches", "8"]


@pytest.mark.parametrize("flag, value, words", [
    ("--pp", "0", "--pp must be at least 1, got 0"),
    ("--pp", "-2", "--pp must be at least 1, got -2"),
    ("--pp", HUGE, "--pp " + HUGE + " is more than 4,096"),
    ("--pp", "nan", "invalid int value: 'nan'"),
    ("--microbatches", "0", "--microbatches must be at least 1"),
    ("--microbatches", HUGE, "is more than 4,096"),
    ("--microbatches", "2000", "pp x vpp x microbatches = 8,000 is more than 4,096"),
    ("--microbatches", "", "invalid int value: ''"),
    ("--vpp", "0", "--vpp must be at least 1"),
    ("--vpp", HUGE, "is more than 4,096"),
    ("--fb-ratio", "nan", "--fb-ratio must be a finite number, got nan"),
    ("--fb-ratio", "inf", "--fb-ratio must be a finite number, got inf"),
    ("--fb-ratio", "0", "--fb-ratio must be at least 0.0625, got 0"),
    ("--fb-ratio", "-1", "--fb-ratio must be at least 0.0625"),
    ("--fb-ratio", "1e30", "--fb-ratio 1e+30 is more than 16"),
    ("--fb-ratio", "fast", "invalid float value: 'fast'"),
])
def test_schedule_numbers(capsys, flag, value, words):
    _refused(capsys, _with(SCHEDULE, flag, value), words)


@pytest.mark.parametrize("flag, value, words", [
    ("--dp", "0", "--dp must be at least 1, got 0"),
    ("--tp", "-1", "--tp must be at least 1, got -1"),
    ("--pp", HUGE, "--pp " + HUGE + " is more than 4,096"),
    ("--dp", "4096", "dp x pp x cp x tp = 8,192 ranks is more than 4,096"),
    ("--ep", "nan", "invalid int value: 'nan'"),
    ("--cp", "", "invalid int value: ''"),
])
def test_mesh_numbers(capsys, flag, value, words):
    _refused(capsys, ["mesh", "--tp", "2", flag, value], words)


RANK = {"rank": 0, "coords": {"dp": 0, "pp": 0}, "bytes": {"params": 8}, "comm_bytes": {}}
STEP = {"step": 1, "loss": 5.5, "time_s": 0.1}


@pytest.mark.parametrize("content, words", [
    ([], "is not a schema-1 run report"),
    ({"schema": 1}, "is not a schema-1 run report"),
    ({"schema": 1, "ranks": 5}, "ranks must be a non-empty list"),
    ({"schema": 1, "ranks": []}, "ranks must be a non-empty list"),
    ({"schema": 1, "ranks": ["x"]}, "ranks[0] must be an object with an integer rank"),
    ({"schema": 1, "ranks": [{**RANK, "bytes": {"params": "8"}}]}, "ranks[0].bytes must be"),
    ({"schema": 1, "ranks": [{**RANK, "coords": None}]}, "ranks[0].coords must be"),
    ({"schema": 1, "ranks": [RANK], "steps": "x"}, "steps must be a list"),
    ({"schema": 1, "ranks": [RANK], "steps": [{"loss": 1}]}, "steps[0] must be an object"),
    ({"schema": 1, "ranks": [RANK], "steps": [{**STEP, "loss": float("nan")}]}, "steps[0]"),
    ({"schema": 1, "ranks": [RANK], "steps": [STEP], "config": [1]}, "config must be an obj"),
    (b"\xff\xfe", "invalid JSON"),
    ("[" * 100_000, "invalid JSON"),
])
def test_bad_run_reports(capsys, tmp_path, content, words):
    text = content if isinstance(content, (str, bytes)) else json.dumps(content)
    _refused(capsys, ["report", _write(tmp_path / "run.json", text)], words)


def test_bounded_activation_walk_gives_the_full_walks_peak(monkeypatch):
    """walked_microbatches cuts a long schedule's walk short: over every small shape of every
    schedule, the cut walk's peak equals the whole walk's."""
    from tetrad.planner import eager_activations
    from tetrad.planner.layout import TrainLayout
    from tetrad.planner.precision import training_precision
    from tetrad.spec.presets import preset

    config = preset("tiny").replace(num_layers=12, name="twelve")
    precision = training_precision("bf16")

    def peaks():
        eager_activations.activations_peak.cache_clear()
        found = {}
        for schedule, vpps in (("1f1b", (1,)), ("zb", (1,)), ("gpipe", (1,)),
                               ("interleaved", (2, 3))):
            for pp in (2, 3, 4):
                for vpp in vpps:
                    for m in range(1, 10 * pp + 1):
                        if schedule == "interleaved" and m % pp:
                            continue
                        layout = TrainLayout(pp=pp, vpp=vpp, schedule=schedule, microbatches=m)
                        for rank in range(pp):
                            found[schedule, pp, vpp, m, rank] = eager_activations.activations_peak(
                                config, layout, 64, precision, rank)
        return found

    bounded = peaks()
    monkeypatch.setattr(eager_activations, "walked_microbatches", lambda s, p, m: (m, 1))
    whole = peaks()
    eager_activations.activations_peak.cache_clear()
    assert bounded == pytest.approx(whole, rel=1e-12)
    assert any(m > 4 * pp + m % pp for (_, pp, _, m, _) in whole)  # some walks were cut


def test_a_picture_path_checked_early_leaves_no_file_behind(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "x.png"
    _refused(capsys, _with(PLAN, "--model", "no-such-model") + ["--png", str(picture)],
             "no-such-model")
    assert not picture.exists()  # the check opened it, then took back what it made
    picture.write_bytes(b"kept")
    _refused(capsys, _with(PLAN, "--model", "no-such-model") + ["--png", str(picture)],
             "no-such-model")
    assert picture.read_bytes() == b"kept"
