"""Bytes per element of every number format, and the mixed-precision training recipes.

Quantized weight formats carry scales: fp8 as DeepSeek-V3 ships it (e4m3 with one fp32 scale per
128x128 block), int4 as GPTQ/AWQ ship it (one 16-bit scale and one 16-bit zero point per group of
128), int8 with one 16-bit scale per output channel. Only the linear layers' weights are
quantized; embeddings, norms, routers and the LM head stay bf16, as in those checkpoints. The
per-element overheads below price the matmuls' weight reads; serving's int8/int4 weight bytes are
counted matrix by matrix as the engine holds them (planner/quantized.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.errors import ConfigError
from tetrad.spec.runtime_rules import FP8_BLOCK

ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8-e4m3": 1.0,
                 "fp8-e5m2": 1.0, "int8": 1.0, "int4": 0.5}
# Scale overhead per element of a quantized weight matrix (int8's one scale per output channel
# is a few bytes per row: left out of the per-element price, counted in planner/quantized.py).
BLOCK_SCALE_BYTES = {"fp8": 4 / FP8_BLOCK**2, "fp8-e4m3": 4 / FP8_BLOCK**2,
                     "fp8-e5m2": 4 / FP8_BLOCK**2, "int4": 2 * 2 / 128}
# The tensor-core format a matmul runs in for each storage format.
COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "fp8-e4m3": "fp8",
                 "fp8-e5m2": "fp8", "int8": "int8", "int4": "bf16"}


def element_bytes(dtype: str) -> float:
    if dtype not in ELEMENT_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r} (known: {', '.join(ELEMENT_BYTES)})")
    return ELEMENT_BYTES[dtype]


def weight_bytes(dtype: str) -> float:
    """Bytes per weight of a linear layer stored in `dtype`, block scales included."""
    return element_bytes(dtype) + BLOCK_SCALE_BYTES.get(dtype, 0.0)


def unquantized_bytes(dtype: str) -> float:
    """Bytes per weight of the tensors quantized checkpoints keep in 16 bits."""
    return element_bytes(dtype) if element_bytes(dtype) >= 2 else 2.0


@dataclass(frozen=True)
class TrainingPrecision:
    """Bytes per parameter of each training state, and per activation element.

    The default mixed-precision recipe (Megatron, DeepSpeed) keeps 16-bit params and grads, an fp32
    master copy and two fp32 Adam moments: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter
    (ZeRO paper, section 3.1, K = 12). fp32 training has no master copy: 4 + 4 + 8 = 16 too.
    """

    compute_dtype: str  # matmul format: fp32, bf16, fp16, fp8
    param_bytes: float
    grad_bytes: float
    master_bytes: float  # fp32 master weights; 0 when the params are already fp32
    optimizer_bytes: float  # Adam's two moments
    activation_bytes: float
    # --dtype fp8's scaling (tetrad.models.fp8_layers): "block" (128x128 weight blocks, 1x128
    # tiles) or "tensor" (one scale per tensor): what backward keeps of an FP8 linear's scales.
    fp8_recipe: str = "block"

    @property
    def optimizer_state_bytes(self) -> float:
        """What ZeRO calls K: master weights plus moments."""
        return self.master_bytes + self.optimizer_bytes

    @property
    def bytes_per_parameter(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes


def training_precision(dtype: str, fp32_grads: bool = False, fp8_recipe: str = "block"
                       ) -> TrainingPrecision:
    """The recipe for `--dtype`: fp32, bf16/fp16 mixed precision, or fp8. `fp32_grads`
    accumulates gradients in fp32 (Megatron's --accumulate-allreduce-grads-in-fp32): 18
    bytes/param.

    fp8 is DeepSeek-V3's recipe as tetrad runs it (tetrad.models.fp8): the three matmuls of every
    block linear (attention, MLP and expert projections) in E4M3, weights scaled per 128x128
    block and activations and gradients per 1x128 tile (fp32 scales); embeddings, norms, router,
    LM head, attention and the residual stream in bf16; fp32 master weights and two fp32 Adam
    moments. Model state is bf16 mixed precision's, 2 + 2 + 4 + 8 (ZeRO's bf16 parameters; one
    process and DDP keep fp32 parameters, train.strategy.planned_precision). What backward keeps
    of an FP8 linear, its E4M3 input and weight copies and their scales (one fp32 per 128 tokens
    of a column, per 128x128 block; with `fp8_recipe` "tensor", one per tensor), is counted by the
    tetrad profile (eager_activations)."""
    if dtype == "fp32":
        return TrainingPrecision("fp32", 4, 4, 0, 8, 4)
    if dtype in ("bf16", "fp16"):
        return TrainingPrecision(dtype, 2, 4 if fp32_grads else 2, 4, 8, 2)
    if dtype in ("fp8", "fp8-e4m3", "fp8-e5m2"):
        return TrainingPrecision("fp8", 2, 4 if fp32_grads else 2, 4, 8, 2, fp8_recipe)
    raise ConfigError(f"training dtype must be fp32, bf16, fp16 or fp8, got {dtype!r}")
