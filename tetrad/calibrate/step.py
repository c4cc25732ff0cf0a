"""A whole eager training step of a calibration model, as tetrad's trainer runs it: what the
operator and kernel microbenchmarks leave out (module calls and their hooks, the autograd
engine's bookkeeping, element-wise kernels slower than a streaming add, gradient clipping, the
optimizer's Python) shows up as the ratio of its measured time to the time model's sum of parts.

The calibration model is its own size (CALIBRATION_RUN), not any model a benchmark evaluates, so
a prediction checked against a training run stays out of sample. The same step, run by several
spawned ranks at once, measures how ranks slow each other down when they share the machine's
cores and memory (`concurrent_slowdown`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from tetrad.spec.model import ParallelConfig, TrainConfig

CALIBRATION_RUN = dict(model="tiny", model_overrides={"num_layers": 2, "hidden_size": 96,
                                                      "ffn_hidden_size": 256},
                       batch_size=4, seq_len=48, steps=1, sample_tokens=0)
REPS = 12


def calibration_config() -> TrainConfig:
    return TrainConfig(**CALIBRATION_RUN, nproc=1, parallel=ParallelConfig())


def calibration_model() -> tuple[TrainConfig, torch.nn.Module, torch.Tensor]:
    """The calibration run's config, its model and a batch of token ids (seq_len + 1 wide)."""
    from tetrad.train.job import prepare, resolve_run
    from tetrad.train.trainer import build_model

    config = calibration_config()
    model_config, _, _ = prepare(config, resolve_run(config).model)
    model = build_model(model_config, config)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model_config.vocab_size, (config.batch_size, config.seq_len + 1),
                          generator=generator)
    return config, model, batch


def forward_pass() -> Callable[[], None]:
    """The calibration model's forward alone: the kind of compute a rank runs between two
    collectives of a training step (a few blocks' worth, milliseconds on a CPU)."""
    _, model, batch = calibration_model()

    def forward() -> None:
        with torch.no_grad():
            model(batch[:, :-1])

    return forward


def training_step() -> Callable[[], None]:
    """One optimizer step of the calibration model in this process (one thread, as a rank)."""
    from tetrad.train.strategy import build_strategy

    config, model, batch = calibration_model()
    strategy = build_strategy(model, config, torch.device("cpu"))

    def step() -> None:
        strategy.forward_backward(batch)
        strategy.finish_gradients()
        strategy.clip_grad_norm(1.0)
        strategy.step(1e-4)

    return step


def step_seconds(step: Callable[[], None], reps: int = REPS) -> float:
    """Median of `reps` steps after two warm-up steps."""
    step()
    step()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def predicted_step_seconds(profile) -> float:
    """The time model's step of the calibration model on `profile` (one process)."""
    from tetrad.train.strategy import planned_precision
    from tetrad.planner import predict_run
    from tetrad.train.job import resolve_run

    config = calibration_config()
    predicted = predict_run(resolve_run(config), config.batch_size, num_microbatches=1,
                            dtype=config.dtype, gpu=profile, precision=planned_precision(config))
    return predicted["step_time_s"]["total"]
