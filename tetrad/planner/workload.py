"""What is trained and how the training code behaves, apart from the layout: the workload every
planner evaluation of a training layout takes (training.evaluate_training, the search)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tetrad.errors import ConfigError
from tetrad.planner.memory import ActivationOptions
from tetrad.planner.precision import TrainingPrecision, training_precision
from tetrad.planner.stacks import check_recompute_ops


@dataclass(frozen=True)
class TrainWorkload:
    """What is trained and how the training code behaves (not the layout)."""

    seq_len: int
    dtype: str = "bf16"
    flash_attention: bool = True
    dropout: bool = False
    fp32_grads: bool = False
    overlap_grad_reduce: bool = True  # DP gradient reduction behind the backward pass
    overlap_param_gather: bool = True  # ZeRO parameter all-gathers behind the forward pass
    overlap_tp_comm: bool = False  # TP collectives pipelined with their GEMMs (userbuffers)
    overlap_p2p: bool = True  # pipeline sends and receives behind compute
    recipe: TrainingPrecision | None = None  # overrides the recipe `dtype` implies
    runtime: str = "megatron"  # whose tensors are counted: memory.RUNTIMES
    zero3_live_params: float = 0.0  # ZeRO-3 gather budget (DeepSpeed); 0: two whole blocks
    # DeepSpeed's ZeRO-3 of 2021 gathered parameter by parameter: messages too small for NCCL to
    # spread over a node's rails, so each crosses nodes at one NIC's bandwidth; its activation
    # checkpointing re-runs the gather hooks, one more all-gather under full recomputation.
    zero3_per_parameter: bool = False
    zero3_whole_stage_under_pp: bool = False  # FSDP2's under pp (planner.weight_copies)
    fp8_saved_inputs: bool = False  # Transformer Engine's FP8 linears (planner.fp8_inputs)
    portable_attention: bool = False  # FlashAttention-2 / Triton, not the vendor's kernels
    # DeepSeek-V3's dispatch kernels (report section 3.2.2): a token crosses the network once per
    # node that holds any of its experts, then fans out over NVLink; with group-limited routing
    # whose expert groups are the ep group's nodes, that is at most topk_expert_groups nodes.
    node_limited_dispatch: bool = False
    recompute_ops: tuple[str, ...] = ()  # memory.RECOMPUTE_OPS run again in the backward
    compiled: bool = False  # torch.compile: recompute_ops at no kernel of their own (stacks.py)
    eager_elementwise: bool = False  # unfused element-wise model code (planner.unfused)
    selective_op: bool = False  # selective as torchtitan's op-level policy (planner.op_checkpoint)
    eager_loss: bool = False  # cross-entropy over an fp32 copy of the logits (planner.unfused)

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be at least 1, got {self.seq_len}")
        check_recompute_ops(self.recompute_ops, self.runtime)

    # Cached on the instance (frozen fields never change): the search reads them per layout.
    @cached_property
    def precision(self) -> TrainingPrecision:
        return self.recipe or training_precision(self.dtype, self.fp32_grads)

    @cached_property
    def activation_options(self) -> ActivationOptions:
        return ActivationOptions(self.flash_attention, self.dropout, self.runtime,
                                 self.zero3_live_params, self.recompute_ops, self.selective_op,
                                 self.eager_loss,
                                 zero3_whole_stage_under_pp=self.zero3_whole_stage_under_pp,
                                 fp8_saved_inputs=(self.fp8_saved_inputs
                                                   and self.precision.compute_dtype == "fp8"))
