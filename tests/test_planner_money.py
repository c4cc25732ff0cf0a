"""Money and GPUs written inline (issue 32, items 2 and 4): a catalog price per GPU-hour for
every GPU that has a public one, cost = price x GPUs x hours, tokens per dollar, the
--price-per-gpu-hour override, and `--gpu h100,hbm=96GB,...` parsed with one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GB, GPUS, GiB, PRICES, TERA
from tetrad.hardware.profile import cluster, gpu_or_profile, load_profile, save_profile


def _plan(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "tetrad", "plan", *args], capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_every_catalog_gpu_but_the_h20_has_a_price():
    assert {name for name, gpu in GPUS.items() if gpu.price_per_hour > 0} == set(GPUS) - {"h20"}
    assert all(GPUS[name].price_per_hour == price for name, price in PRICES.items())


def test_training_cost_is_price_times_gpus_times_hours():
    code, out, _ = _plan("train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8",
                         "--tokens", "1e11", "--top", "2", "--json",
                         "--price-per-gpu-hour", "3")
    assert code == 0
    data = json.loads(out)
    assert data["price_per_gpu_hour"] == 3
    for config in data["configs"]:
        hours = 1e11 / config["tokens_per_s"] / 3600
        assert config["cost_usd"] == pytest.approx(3 * 8 * hours, rel=1e-3)
        assert config["tokens_per_dollar"] == pytest.approx(
            config["tokens_per_s"] * 3600 / (3 * 8), rel=1e-3)


def test_serving_output_tokens_per_dollar_and_a_gpu_without_a_price():
    code, out, _ = _plan("serve", "--model", "llama3-8b", "--gpu", "rtx-4090", "--num-gpus",
                         "2", "--json")
    data = json.loads(out)
    price = GPUS["rtx-4090"].price_per_hour
    for config in data["configs"]:
        assert config["output_tokens_per_dollar"] == pytest.approx(
            config["decode_tokens_per_s"] * 3600 / (2 * price), rel=1e-3)
    code, out, _ = _plan("serve", "--model", "llama3-8b", "--gpu", "h20", "--num-gpus", "1")
    assert code == 0 and "no price for h20: pass --price-per-gpu-hour" in out
    code, _, err = _plan("serve", "--model", "llama3-8b", "--gpu", "h20", "--num-gpus", "1",
                         "--price-per-gpu-hour", "-1")
    assert code == 2 and "--price-per-gpu-hour must be more than 0" in err


def test_inline_gpu_replaces_catalog_numbers():
    base = GPUS["h100-sxm"]
    custom = gpu_or_profile("h100,hbm=96GB,bw=2.4TB/s,bf16=800TF,nic=200,price=$2.5")
    assert custom.memory_bytes == 96 * GiB and custom.memory_bandwidth == 2.4e12
    assert custom.peak("bf16") == 800 * TERA == custom.peak("fp16")
    assert custom.peak("fp8") == base.peak("fp8")  # not given: the catalog's
    assert custom.nic_bandwidth == 200e9 / 8 and custom.price_per_hour == 2.5
    assert custom.efficiency == base.efficiency and custom.name == "h100-sxm*"
    assert cluster("h100,hbm=96GB", 16).gpu.memory_bytes == 96 * GiB


def test_inline_full_spec_and_a_profile_file_base(tmp_path):
    full = gpu_or_profile("custom,arch=ada,hbm=32GB,bw=1.79TB/s,bf16=209.5TF,pcie=64GB/s,"
                          "host=89.6GB/s,name=rtx-5090,price=0.9")
    assert (full.name, full.memory_bytes, full.pcie_bandwidth) == ("rtx-5090", 32 * GiB, 64 * GB)
    assert full.efficiency == GPUS["rtx-4090"].efficiency and full.nvlink_bandwidth == 0
    path = tmp_path / "measured.json"
    save_profile(full, path)
    assert load_profile(path).price_per_hour == 0.9  # prices travel in profile files
    assert gpu_or_profile(f"{path},price=1.5").price_per_hour == 1.5


@pytest.mark.parametrize("spec, words", [
    ("h100,hbm=lots", "write a number with one of the units gb, gib, tb"),
    ("h100,bw=2PB/s", "units gb/s, tb/s"),
    ("h100,hbm", "is not key=value"),
    ("h100,colour=red", "unknown key 'colour'"),
    ("h100,hbm=1GB,hbm=2GB", "hbm is given twice"),
    ("h100,arch=ada", "arch= is for a full spec"),
    ("custom,hbm=9GB", "needs arch, bw, bf16, pcie, host"),
    ("custom,arch=volta,hbm=1GB,bw=1TB/s,bf16=1TF,pcie=1GB/s,host=1GB/s", "known architectures"),
    ("h100,bw=0TB/s", "must be a positive finite number"),
    ("h1000,hbm=1GB", "unknown GPU 'h1000'"),
])
def test_inline_gpu_errors_say_what_to_write(spec, words):
    with pytest.raises(ConfigError, match=words):
        gpu_or_profile(spec)


def test_inline_gpu_errors_are_one_line_on_the_command_line():
    code, _, err = _plan("train", "--model", "tiny", "--gpu", "h100,hbm=lots", "--num-gpus", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "hbm=lots" in err
