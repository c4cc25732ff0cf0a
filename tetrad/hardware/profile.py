"""Hardware profiles as files: a catalog GPU or a machine measured by `tetrad calibrate`, in one
JSON schema, so that one time model serves both (torch-free, like the catalog in hardware.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from tetrad.errors import ConfigError, read_json_file
from tetrad.hardware.efficiency import EfficiencyProfile
from tetrad.hardware.catalog import GPU, Cluster, gpu
from tetrad.hardware.custom import inline_gpu, is_inline_spec

PROFILE_SCHEMA = 1
# The EfficiencyProfile fields that are (ranks, value) points.
CURVES = ("concurrent_slowdown", "sync_wait", "sync_wait_back_to_back", "call_cpu")


def profile_to_dict(device: GPU) -> dict:
    """A GPU (a catalog entry or a calibrated machine) as JSON-ready data: `tetrad calibrate`
    writes this, `load_profile` reads it back."""
    data = dataclasses.asdict(device)
    data["aliases"] = list(device.aliases)
    efficiency = data["efficiency"]
    efficiency["matmul_curve"] = [list(point) for point in device.efficiency.matmul_curve]
    efficiency["collectives"] = [list(fit) for fit in device.efficiency.collectives]
    for curve in CURVES:
        efficiency[curve] = [list(point) for point in getattr(device.efficiency, curve)]
    return {"schema": PROFILE_SCHEMA, **data}


def profile_from_dict(data: dict, source: str = "profile") -> GPU:
    """The inverse of profile_to_dict; every problem is one ConfigError naming `source`."""
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise ConfigError(f"{source} is not a schema-{PROFILE_SCHEMA} hardware profile "
                          f"(write one with tetrad calibrate --out {source})")
    try:
        efficiency = dict(data["efficiency"])
        efficiency["matmul_curve"] = tuple((float(size), float(value))
                                           for size, value in efficiency.get("matmul_curve", ()))
        efficiency["collectives"] = tuple((str(kind), int(size), float(alpha), float(beta))
                                          for kind, size, alpha, beta
                                          in efficiency.get("collectives", ()))
        for curve in CURVES:
            efficiency[curve] = tuple((int(ranks), float(value))
                                      for ranks, value in efficiency.get(curve, ()))
        fields = {key: value for key, value in data.items() if key != "schema"}
        fields.update(efficiency=EfficiencyProfile(**efficiency),
                      peak_flops={str(k): float(v) for k, v in data["peak_flops"].items()},
                      aliases=tuple(data.get("aliases", ())))
        device = GPU(**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f"{source} is not a valid hardware profile ({type(error).__name__}: "
                          f"{error})") from None
    _check_numbers(device, source)
    return device


# The efficiency fractions every time divides by; a profile's other numbers may be 0 (unknown).
DIVISORS = ("matmul", "attention", "memory", "intra_link", "inter_link")


def _finite(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _check_numbers(device: GPU, source: str) -> None:
    """Every number of the profile finite and not negative, the ones times are divided by
    positive: a "fast" string, a NaN or a negative bandwidth would come back out as NaN times."""
    if not device.peak_flops or not all(_finite(v) and v > 0 for v in device.peak_flops.values()) \
            or not (_finite(device.memory_bandwidth) and device.memory_bandwidth > 0):
        raise ConfigError(f"{source}: a hardware profile needs positive peak_flops and "
                          f"memory_bandwidth")
    if not isinstance(device.name, str) or not all(isinstance(a, str) for a in device.aliases):
        raise ConfigError(f"{source}: name and aliases must be strings")
    numbers = {f.name: getattr(device, f.name) for f in dataclasses.fields(GPU)
               if f.type == "float"}
    numbers.update((f.name, getattr(device.efficiency, f.name))
                   for f in dataclasses.fields(EfficiencyProfile) if f.type in ("float", "int"))
    for curve in ("matmul_curve", *CURVES):
        numbers.update((f"{curve}[{i}]", value) for i, point in
                       enumerate(getattr(device.efficiency, curve)) for value in point)
    numbers.update((f"collectives[{i}]", value) for i, fit in
                   enumerate(device.efficiency.collectives) for value in fit[1:])
    for name, value in numbers.items():
        if not _finite(value) or value < 0 or (name in DIVISORS and value == 0):
            raise ConfigError(f"{source}: {name} must be a finite "
                              f"{'positive' if name in DIVISORS else 'non-negative'} number, "
                              f"got {value!r}")


def load_profile(path: str | Path) -> GPU:
    data = read_json_file(path, "hardware profile", "tetrad calibrate --out")
    return profile_from_dict(data, str(path))


def save_profile(device: GPU, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_dict(device), indent=2) + "\n")


def default_profile_path() -> Path:
    """This machine's cached profile: what `tetrad calibrate` writes without --out and what
    `tetrad train` reads when no --hardware is given."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tetrad" / "hardware.json"


def is_profile_path(name: str) -> bool:
    """`--gpu` and `--hardware` take a catalog name or a profile file; a name ending in .json
    or naming a file is a file."""
    return name.endswith(".json") or Path(name).is_file()


def gpu_or_profile(name: str) -> GPU:
    """A catalog name, a profile file, or either with datasheet numbers replaced inline
    (tetrad.hardware.custom: `h100,hbm=96GB,bw=2.4TB/s`)."""
    if is_inline_spec(name):
        return inline_gpu(name, gpu_or_profile)
    return load_profile(name) if is_profile_path(name) else gpu(name)


# Server presets: the GPU, GPUs per node and NIC of NVIDIA's reference systems.
CLUSTER_PRESETS: dict[str, tuple[str, int]] = {
    "dgx-a100": ("a100-80gb", 8),
    "dgx-a100-40gb": ("a100-40gb", 8),
    "dgx-h100": ("h100-sxm", 8),
    "hgx-h200": ("h200", 8),
    "hgx-h800": ("h800", 8),
    "hgx-h20": ("h20", 8),
    "dgx-b200": ("b200", 8),
}


def cluster(gpu_name: str, num_gpus: int, gpus_per_node: int | None = None,
            nic_gbps: float | None = None) -> Cluster:
    """A cluster from a GPU name, a server preset name (dgx-h100 ...) or a profile file."""
    key = gpu_name.strip().lower()
    # Given values are checked, never replaced by a default: 0 is not "unset".
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if nic_gbps is not None and not nic_gbps > 0:
        raise ConfigError(f"--nic-gbps must be a positive bandwidth in Gb/s, got {nic_gbps:g}")
    if key in CLUSTER_PRESETS:
        gpu_name, preset_per_node = CLUSTER_PRESETS[key]
        gpus_per_node = gpus_per_node if gpus_per_node is not None else preset_per_node
    return Cluster(gpu_or_profile(gpu_name), num_gpus,
                   gpus_per_node if gpus_per_node is not None else 8,
                   nic_bandwidth=(nic_gbps or 0.0) * 1e9 / 8)
