"""`tetrad plan`: bad input stops with one line on stderr and exit status 2; what the planner
allows and reports that the runtime does not (experts over tensor ranks, KV capacity, ZeRO-3's
two model-state figures, training stacks)."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main

TRAIN = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"]
SERVE = ["plan", "serve", "--model", "llama3-70b", "--gpu", "h100", "--num-gpus", "4"]


def _refused(capsys, argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("tetrad plan: error: ") and words in err, err


@pytest.fixture
def bad_model_files(tmp_path):
    (tmp_path / "broken.json").write_text('{"hidden_size": 64,')
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return tmp_path / "broken.json", hf


def test_malformed_model_files(capsys, bad_model_files):
    broken, hf = bad_model_files
    _refused(capsys, ["plan", "train", "--model", str(broken), "--gpu", "h100", "--num-gpus",
                      "8"], "is not valid JSON")
    _refused(capsys, ["plan", "train", "--model", str(hf), "--gpu", "h100", "--num-gpus", "8"],
             "lacks the required key 'vocab_size'")


@pytest.mark.parametrize("extra, words", [
    (["--tokens=-1e12"], "--tokens must be at least 0, got -1e+12"),
    (["--tokens", "-1e12"], "--tokens must be at least 0"),  # a value, not an option
    (["--num-gpus", "16", "--nic-gbps=-100"], "--nic-gbps must be at least 1, got -100"),
    (["--num-gpus", "16", "--nic-gbps", "0"], "--nic-gbps must be at least 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be at least 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--global-batch", "0"], "--global-batch must be at least 1"),
    (["--micro-batch", "0"], "--micro-batch must be at least 1"),
    (["--tp", "0"], "--tp must be at least 1"),
    (["--pp", "2", "--vpp", "4", "--schedule", "1f1b"], "--vpp 4 needs --schedule interleaved"),
    (["--zero", "3", "--dp", "1", "--tp", "8"], "--zero 3 shards over dp*cp ranks, and --dp 1"),
    (["--zero", "3", "--tp", "8"], "and tp*pp = 8 of 8 GPUs leaves one"),
    (["--zero", "1", "--tp", "4", "--pp", "2"], "and tp*pp = 8 of 8 GPUs leaves one"),
    (["--stack", "megatron", "--dp", "8", "--ep", "2"], "needs a mixture-of-experts model"),
])
def test_training_input_refused(capsys, extra, words):
    argv = TRAIN + extra
    if "--num-gpus" in extra:  # the later --num-gpus wins
        argv = TRAIN[:-2] + extra
    _refused(capsys, argv, words)


@pytest.mark.parametrize("extra, words", [
    (["--zero", "5"], "argument --zero: invalid choice: 5"),
    (["--tp"], "argument --tp: expected one argument"),
    (["--num-gpus", "eight"], "argument --num-gpus: invalid int value: 'eight'"),
])
def test_what_argparse_refuses_is_one_line_too(capsys, extra, words):
    with pytest.raises(SystemExit) as stopped:
        main(TRAIN + extra)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("tetrad plan train: error: ") and words in err, err
    assert err.strip().endswith("(--help lists the options)"), err


def test_fp8_needs_fp8_tensor_cores(capsys):
    _refused(capsys, ["plan", "train", "--model", "llama3-8b", "--gpu", "a100", "--num-gpus",
                      "8", "--dtype", "fp8"], "a100-80gb has no fp8 tensor cores")
    # Serving fp8 weights on an A100 dequantizes them into 16-bit GEMMs: allowed.
    assert main(["plan", "serve", "--model", "llama3-8b", "--gpu", "a100", "--num-gpus", "1",
                 "--dtype", "fp8"]) == 0


@pytest.mark.parametrize("extra, words", [
    (["--batch", "-5"], "--batch must be a number of concurrent sequences"),
    (["--prompt-len", "0"], "--prompt-len must be at least 1"),
    (["--context-len", "100", "--prompt-len", "128", "--output-len", "128"],
     "--context-len 100 cannot hold"),
])
def test_serving_input_refused(capsys, extra, words):
    _refused(capsys, SERVE + extra, words)


def test_serve_batch_beyond_kv_capacity_does_not_fit(capsys):
    args = SERVE + ["--tp", "4", "--dtype", "fp8", "--prompt-len", "1024", "--output-len",
                    "1024", "--json"]
    assert main(args) == 0
    fitting = json.loads(capsys.readouterr().out)["configs"][0]
    capacity = fitting["max_concurrent_sequences"]
    assert fitting["fits"] and fitting["batch"] <= capacity
    assert main(args + ["--batch", str(capacity)]) == 0
    assert json.loads(capsys.readouterr().out)["configs"][0]["fits"]
    assert main(args + ["--batch", str(capacity + 1)]) == 1
    over = json.loads(capsys.readouterr().out)["configs"][0]
    assert not over["fits"]
    assert over["memory_gib"]["total"] > over["memory_gib"]["usable"]
    assert main(args[:-1] + ["--batch", str(capacity + 1)]) == 1
    assert f"at most {capacity} sequences" in capsys.readouterr().out


def test_experts_over_tensor_and_data_ranks(capsys):
    """NVIDIA's DeepSeek-V3 recipe: ep 64 over tp 2 x dp 32 (ep does not divide dp)."""
    args = ["plan", "train", "--model", "deepseek-v3", "--gpu", "h100", "--num-gpus", "1024",
            "--tp", "2", "--pp", "16", "--dp", "32", "--ep", "64", "--dtype", "fp8",
            "--seq-len", "4096", "--global-batch", "8192", "--recompute", "full",
            "--schedule", "1f1b", "--micro-batch", "1", "--zero", "1", "--top", "1", "--json"]
    assert main(args + ["--stack", "megatron"]) == 0
    wide = json.loads(capsys.readouterr().out)["configs"][0]
    assert wide["parallel"]["ep"] == 64 and wide["fits"]
    # The same experts folded over dp only (ep 32, each expert split over tp 2) hold the same
    # expert bytes per GPU: 256 / 64 whole experts against 256 / 32 half experts.
    narrow_args = [a if a != "64" else "32" for a in args]
    assert main(narrow_args + ["--stack", "megatron"]) == 0
    narrow = json.loads(capsys.readouterr().out)["configs"][0]
    assert wide["memory_gib"]["params"] == pytest.approx(narrow["memory_gib"]["params"],
                                                         rel=1e-3)
    _refused(capsys, args + ["--stack", "tetrad"], "tetrad's runtime spreads experts")


def test_zero3_shows_gathered_blocks_and_formula(capsys):
    """ZeRO's example (7.5B-like llama on 64 GPUs): the CLI's params include two gathered
    blocks; the ZeRO formula's sharded states are printed beside them."""
    args = ["plan", "train", "--model", "llama2-7b", "--gpu", "a100", "--num-gpus", "64",
            "--dp", "64", "--zero", "3", "--micro-batch", "1", "--top", "1"]
    assert main(args + ["--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["configs"][0]["memory_gib"]
    sharded = memory["params"] + memory["grads"] + memory["optimizer"]
    assert memory["params_gathered"] > 0
    assert memory["model_states_formula"] == pytest.approx(
        sharded - memory["params_gathered"], abs=2e-3)
    assert main(args) == 0
    assert f"without them: {memory['model_states_formula']:.3f} GiB" in capsys.readouterr().out


def test_deepspeed_zero3_gathers_a_live_parameter_budget(capsys, tmp_path):
    """DeepSpeed keeps at most 1e9 parameters whole (stage3_max_live_parameters), FSDP two
    whole blocks: 530B on 640 A100s with micro batch 4 fits only the DeepSpeed way."""
    model = {"vocab_size": 51200, "hidden_size": 20480, "num_layers": 105, "num_heads": 128,
             "ffn_hidden_size": 81920, "max_seq_len": 2048, "norm": "layernorm",
             "position": "learned", "mlp": "gelu", "bias": True, "tie_embeddings": True}
    args = ["plan", "train", "--gpu", "a100-80gb", "--num-gpus", "640", "--tp", "1", "--pp",
            "1", "--zero", "3", "--recompute", "full", "--global-batch", "2560", "--seq-len",
            "2048", "--micro-batch", "4", "--offload", "none", "--top", "1", "--json"]
    path = tmp_path / "mt-nlg-530b.json"
    path.write_text(json.dumps(model))
    assert main(args + ["--model", str(path), "--stack", "deepspeed"]) == 0
    deepspeed = json.loads(capsys.readouterr().out)["configs"][0]
    assert main(args + ["--model", str(path), "--stack", "torchtitan", "--dropout",
                        "--no-flash-attention"]) == 1
    fsdp = json.loads(capsys.readouterr().out)["configs"][0]
    assert deepspeed["fits"] and not fsdp["fits"]
    assert deepspeed["memory_gib"]["params_gathered"] == pytest.approx(2e9 / 2**30, abs=1e-3)


def test_stack_and_overlap_flags(capsys):
    """A stack sets the overlaps; a single flag overrides one; both show in the JSON."""
    args = TRAIN[:-1] + ["16", "--tp", "2", "--pp", "2", "--dp", "4", "--zero", "1",
                         "--schedule", "1f1b", "--micro-batch", "1", "--global-batch", "64",
                         "--top", "1", "--json"]
    steps = {}
    for name, extra in (("megatron", ["--stack", "megatron"]),
                        ("2021", ["--stack", "megatron-2021"]),
                        ("2021+flash", ["--stack", "megatron-2021", "--flash-attention",
                                        "--no-dropout"]),
                        ("no-reduce-overlap", ["--stack", "megatron", "--no-flash-attention",
                                               "--dropout", "--no-overlap-grad-reduce",
                                               "--no-overlap-param-gather",
                                               "--no-overlap-tp-comm", "--no-overlap-p2p"])):
        assert main(args + extra) == 0
        data = json.loads(capsys.readouterr().out)
        steps[name] = data["configs"][0]["step_time_s"]["total"]
        if name == "megatron":
            assert data["stack"]["overlap_tp_comm"] and data["stack"]["flash_attention"]
        if name == "2021+flash":
            assert data["stack"]["flash_attention"] and not data["stack"]["overlap_p2p"]
    # Megatron-2021 hides nothing: slower than Megatron-Core; every flag turned off by hand
    # on top of the megatron stack gives the 2021 stack's time exactly.
    assert steps["2021"] > steps["megatron"]
    assert steps["2021+flash"] < steps["2021"]
    assert steps["no-reduce-overlap"] == pytest.approx(steps["2021"], rel=1e-9)


def test_serve_ep_skips_layouts_it_cannot_spread_over(capsys):
    """--tp 1 --ep 4 on 8 GPUs: the pipeline depths that leave dp 8 or 4 are planned, those that
    leave dp 2 or 1 (too few ranks for 4 expert groups) are skipped, not an error."""
    args = ["plan", "serve", "--model", "configs/deepseek-v3-tiny.toml", "--gpu", "h100",
            "--num-gpus", "8", "--tp", "1", "--ep", "4", "--top", "20", "--json"]
    assert main(args) == 0
    planned = {(c["parallel"]["pp"], c["parallel"]["dp"], c["parallel"]["ep"])
               for c in json.loads(capsys.readouterr().out)["configs"]}
    depths = [pp for pp in (1, 2, 4, 8) if (8 // pp) % 4 == 0]
    assert planned == {(pp, 8 // pp, 4) for pp in depths}
    _refused(capsys, args + ["--pp", "4"], "ep 4 cannot spread over any layout of the 8 GPUs")
