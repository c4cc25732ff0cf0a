"""A GPU under a power cap (`nvidia-smi -pl W`, the planner's `--gpu-power W`). Torch-free.

NVIDIA enforces a board power limit by lowering the graphics (SM) clock, not the memory clock:
nvidia-smi's clock event reason "SW Power Cap" ("the clocks have been optimized to ensure not to
exceed [the power limit]", nvidia-smi(1), NVML's nvmlClocksEventReasonSwPowerCap). So the tensor
cores' peak scales with the SM clock while HBM bandwidth, NVLink, PCIe and the NIC keep theirs.

The clock a cap allows follows from CMOS dynamic power, P = a C V^2 f, with the supply voltage
scaled along with the clock (dynamic voltage and frequency scaling, V proportional to f): P grows
as f^3 (Hennessy and Patterson, "Computer Architecture: A Quantitative Approach", 6th ed.,
section 1.5). At full load the board draws its rated power (TDP) at the full clock, so a cap of W
watts allows f / f_max = (W / TDP)^(1/3). This counts all of the board's power as dynamic: the
static (leakage) and memory power that does not scale with the SM clock is left out, so the
clock a cap leaves is an upper bound, and so is the speed the planner predicts under it.
"""

from __future__ import annotations

import dataclasses

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GPU

# Rated board power (TDP / maximum power limit) in watts, from each GPU's datasheet (the same
# documents tetrad.hardware.catalog cites): A100 SXM4 400, H100 SXM5 700, H100 PCIe 350, H200
# SXM 700, H800 SXM 700, H20 400, B200 1000 (HGX B200), L40S 350, RTX 4090 450, RTX 3090 350.
BOARD_POWER_W = {"a100-40gb": 400.0, "a100-80gb": 400.0, "h100-sxm": 700.0, "h100-pcie": 350.0,
                 "h200": 700.0, "h800": 700.0, "h20": 400.0, "b200": 1000.0, "l40s": 350.0,
                 "rtx-4090": 450.0, "rtx-3090": 350.0}


def board_power(gpu: GPU) -> float:
    """The rated board power of `gpu`, a catalog entry or one with its numbers replaced inline."""
    name = gpu.name.rstrip("*")  # an inline spec marks a catalog entry it changed with '*'
    if name not in BOARD_POWER_W:
        raise ConfigError(f"--gpu-power: no rated board power known for {gpu.name} (known: "
                          f"{', '.join(BOARD_POWER_W)})")
    return BOARD_POWER_W[name]


def clock_fraction(gpu: GPU, watts: float) -> float:
    """The share of its full SM clock `gpu` keeps under a cap of `watts` (module doc)."""
    rated = board_power(gpu)
    if not 0 < watts <= rated:
        raise ConfigError(f"--gpu-power must be more than 0 and at most the {gpu.name}'s rated "
                          f"{rated:g} W, got {watts:g}")
    return (watts / rated) ** (1 / 3)


def power_capped(gpu: GPU, watts: float) -> GPU:
    """`gpu` under a cap of `watts`: every tensor-core peak scaled by the clock it keeps; memory,
    NVLink, PCIe and network bandwidths as they were."""
    share = clock_fraction(gpu, watts)
    return dataclasses.replace(gpu, name=f"{gpu.name}@{watts:g}W",
                               peak_flops={dtype: flops * share
                                           for dtype, flops in gpu.peak_flops.items()})
