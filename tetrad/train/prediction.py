"""What the planner predicts for the run at hand, which the run report puts next to what the run
measured: the same resolved layout (pipeline cut included), the same cost model, the precision
the strategy keeps, for the hardware the run is on (or is asked to be priced for)."""

from __future__ import annotations

from typing import Any

import torch

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GPU, gpu_from_device_name
from tetrad.hardware.profile import default_profile_path, gpu_or_profile, load_profile
from tetrad.planner import predict_run
from tetrad.planner.rules import ResolvedLayout
from tetrad.spec.model import TrainConfig
from tetrad.train.strategy import planned_precision


def device_gpu(device: torch.device) -> GPU | None:
    """The catalog GPU this run is on (for MFU against its peak), None on CPU or unknown GPUs."""
    return gpu_from_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" \
        else None


def prediction_hardware(config: TrainConfig, gpu: GPU | None) -> GPU | None:
    """What the predicted step time is for: --hardware (a profile or a catalog GPU), else this
    machine's cached profile (tetrad calibrate) on CPU, else the catalog GPU this run is on."""
    if config.hardware:
        return gpu_or_profile(config.hardware)
    if gpu is None:
        cached = default_profile_path()
        return load_profile(cached) if cached.is_file() else None
    return gpu


def predict(layout: ResolvedLayout, config: TrainConfig, gpu: GPU | None) -> dict[str, Any]:
    """The planner's prediction for this very run. A rank's batch goes through grad_accum
    pipeline steps of `microbatches` microbatches each (one without a pipeline)."""
    num_microbatches = config.grad_accum * config.parallel.microbatches
    micro_batch = config.batch_size // (config.parallel.dp * num_microbatches)
    try:
        return predict_run(layout, micro_batch, num_microbatches=num_microbatches,
                           dtype=config.dtype, gpu=gpu,
                           precision=planned_precision(config))
    except ConfigError as error:  # a layout the cost model does not cover
        return {"error": str(error)}
