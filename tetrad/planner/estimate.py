"""A training layout's estimate: its memory per GPU, step time, throughput and traffic, as
tetrad.planner.training.evaluate_training computes them and the search ranks them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tetrad.planner.comm import CommLedger
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import MemoryBreakdown
from tetrad.planner.timeline import StepTime


@dataclass(frozen=True)
class TrainingEstimate:
    layout: TrainLayout
    memory: MemoryBreakdown
    fullest_stage: int
    usable_memory: float
    step: StepTime
    tokens_per_step: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    num_gpus: int
    peak_flops: float
    comm: CommLedger = field(compare=False)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step.total

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_step / self.step.total / self.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops_per_step / self.step.total / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops
