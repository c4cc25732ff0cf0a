"""A GPU written inline on the command line: `--gpu h100,hbm=96GB,bw=2.4TB/s,price=2.1` is a
catalog entry (or a profile file) with some of its datasheet numbers replaced, and
`--gpu custom,arch=hopper,hbm=96GB,bw=4TB/s,bf16=148TF,pcie=64GB/s,host=77GB/s` a full spec whose
efficiency profile is its architecture's (tetrad.hardware.catalog). Torch-free, like the catalog.

Units are written with the value and follow the catalog: memory sizes in the marketed "GB" that
NVIDIA means as GiB (or GiB, TB), bandwidths per direction in GB/s or TB/s, the NIC in Gb/s as
--nic-gbps, peak dense tensor FLOP/s in TF (TFLOP/s), the price in dollars per GPU-hour.
"""

from __future__ import annotations

import dataclasses
import math
import re

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import ADA, AMPERE, BLACKWELL, GB, GiB, GPU, HOPPER, TERA

ARCHITECTURES = {"ampere": AMPERE, "ada": ADA, "hopper": HOPPER, "blackwell": BLACKWELL}
# key -> (GPU field, {unit: factor}); a bare number takes the first unit.
SIZE_UNITS = {"gb": GiB, "gib": GiB, "tb": 1024 * GiB}
BANDWIDTH_UNITS = {"gb/s": GB, "tb/s": 1000 * GB}
KEYS = {
    "hbm": ("memory_bytes", SIZE_UNITS),
    "bw": ("memory_bandwidth", BANDWIDTH_UNITS),
    "nvlink": ("nvlink_bandwidth", BANDWIDTH_UNITS),
    "pcie": ("pcie_bandwidth", BANDWIDTH_UNITS),
    "nic": ("nic_bandwidth", {"gb/s": GB / 8, "tb/s": 1000 * GB / 8}),
    "host": ("host_memory_bandwidth", BANDWIDTH_UNITS),
    "price": ("price_per_hour", {"$/h": 1.0}),
}
FLOPS_UNITS = {"tf": TERA, "pf": 1000 * TERA}
DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")
# What a full spec (base `custom`) must say: no catalog entry stands behind it.
FULL_SPEC = ("arch", "hbm", "bw", "bf16", "pcie", "host")


def is_inline_spec(name: str) -> bool:
    return "," in name


def _number(key: str, text: str, units: dict[str, float]) -> float:
    match = re.fullmatch(r"\$?\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/$]*)", text.lower())
    unit = match.group(2) if match else ""
    if not match or (unit and unit not in units):
        raise ConfigError(f"--gpu {key}={text}: write a number with one of the units "
                          f"{', '.join(units)} (e.g. {key}=2{next(iter(units))})")
    value = float(match.group(1)) * units[unit or next(iter(units))]
    if not math.isfinite(value) or (value <= 0 and key not in ("nvlink", "nic", "price")):
        raise ConfigError(f"--gpu {key}={text} must be a positive finite number")
    return value


def _pairs(spec: str) -> tuple[str, dict[str, str]]:
    base, *items = [part.strip() for part in spec.split(",")]
    values: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise ConfigError(f"--gpu {spec!r}: {item!r} is not key=value (e.g. hbm=96GB)")
        if key not in (*KEYS, *DTYPES, "arch", "name"):
            raise ConfigError(f"--gpu: unknown key {key!r} (known: "
                              f"{', '.join((*KEYS, *DTYPES, 'arch', 'name'))})")
        if key in values:
            raise ConfigError(f"--gpu: {key} is given twice")
        values[key] = value.strip()
    return base, values


def inline_gpu(spec: str, lookup) -> GPU:
    """The GPU `spec` describes; `lookup` turns the base name (a catalog name or a profile
    file) into the GPU whose fields the spec replaces."""
    base, values = _pairs(spec)
    if base.lower() == "custom":
        missing = [key for key in FULL_SPEC if key not in values]
        if missing:
            raise ConfigError(f"--gpu custom,... is a full spec and needs "
                              f"{', '.join(missing)} (or start from a catalog GPU: "
                              f"--gpu h100,hbm=96GB)")
        arch = values["arch"].lower()
        if arch not in ARCHITECTURES:
            raise ConfigError(f"--gpu arch={arch}: known architectures are "
                              f"{', '.join(ARCHITECTURES)}")
        device = GPU("custom", {}, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ARCHITECTURES[arch])
    else:
        if "arch" in values:
            raise ConfigError("--gpu arch= is for a full spec (custom,...); a catalog GPU keeps "
                              "its architecture's efficiency profile")
        device = lookup(base)
    changes = {KEYS[key][0]: _number(key, text, KEYS[key][1])
               for key, text in values.items() if key in KEYS}
    peaks = dict(device.peak_flops)
    peaks.update((key, _number(key, text, FLOPS_UNITS)) for key, text in values.items()
                 if key in DTYPES)
    if "bf16" in values and "fp16" not in values:
        peaks["fp16"] = peaks["bf16"]  # one tensor-core rate for both 16-bit formats
    name = values.get("name") or (device.name if base.lower() == "custom" else
                                  f"{device.name}*")  # * marks a changed catalog entry
    return dataclasses.replace(device, name=name, peak_flops=peaks, aliases=(),
                               source="; ".join(filter(None, (device.source, f"--gpu {spec}"))),
                               **changes)
