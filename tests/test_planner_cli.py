"""`tetrad plan`: runs without torch, prints the documented JSON fields, reads HF configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetrad.cli.main import main

TRAIN_FIELDS = {"parallel", "fits", "memory_gib", "fullest_stage", "step_time_s", "tokens_per_s",
                "tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "comm_bytes_per_step"}
SERVE_FIELDS = {"parallel", "fits", "memory_gib", "batch", "max_concurrent_sequences", "ttft_s",
                "tpot_s", "decode_tokens_per_s"}
MEMORY_FIELDS = {"params", "grads", "optimizer", "activations", "kv_cache", "total", "usable"}


def test_planner_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any torch import now fails
            "import tetrad.planner, tetrad.hardware.catalog, tetrad.planner.report\n"
            "from tetrad.cli.main import main\n"
            "assert main(['plan', 'train', '--model', 'llama3-8b', '--gpu', 'h100',"
            " '--num-gpus', '8', '--json']) == 0\n"
            "assert main(['plan', 'serve', '--model', 'llama3-8b', '--gpu', 'h100',"
            " '--num-gpus', '1', '--json']) == 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _json(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_train_json(capsys):
    data = _json(capsys, "train", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "16",
                 "--tokens", "1e12", "--top", "3")
    assert data["mode"] == "train" and data["num_gpus"] == 16 and len(data["configs"]) == 3
    for config in data["configs"]:
        assert TRAIN_FIELDS | {"days", "gpu_hours"} <= set(config)
        assert MEMORY_FIELDS <= set(config["memory_gib"])
        assert set(config["step_time_s"]) == {"total", "compute", "communication_exposed",
                                              "bubble"}
        assert {"tp", "pp", "dp", "cp", "ep", "vpp", "zero", "recompute", "schedule",
                "micro_batch"} <= set(config["parallel"])
        assert config["gpu_hours"] == pytest.approx(config["days"] * 24 * 16, rel=1e-3)
    assert data["total_flops"] > data["total_flops_6nd"] > 0


def test_serve_json(capsys):
    data = _json(capsys, "serve", "--model", "deepseek-r1", "--gpu", "h100-sxm", "--num-gpus",
                 "16", "--dtype", "fp8", "--tp", "8", "--pp", "2")
    assert data["mode"] == "serve"
    config = data["configs"][0]
    assert SERVE_FIELDS <= set(config) and MEMORY_FIELDS <= set(config["memory_gib"])
    assert (config["parallel"]["tp"], config["parallel"]["pp"]) == (8, 2)
    assert config["fits"]


def test_user_error_exits_with_status_2(capsys):
    assert main(["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8",
                 "--tp", "3"]) == 2
    assert "tp 3 does not divide num_heads 32" in capsys.readouterr().err


@pytest.mark.parametrize("hf", [
    {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
     "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008},
    {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
     "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944},
    {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
     "num_local_experts": 8, "num_experts_per_tok": 2},
    {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
     "n_positions": 1024},
])
def test_hf_config_json(tmp_path, capsys, hf):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    data = _json(capsys, "train", "--model", str(path), "--gpu", "a100-80gb", "--num-gpus", "16",
                 "--top", "1")
    assert data["configs"][0]["fits"]


def test_memory_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "memory.png"
    assert main(["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8",
                 "--png", str(picture)]) == 0
    assert picture.stat().st_size > 1000
    assert "layouts considered" in capsys.readouterr().out
