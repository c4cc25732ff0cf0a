"""HBM traffic of a block's element-wise work as eager PyTorch model code runs it, op by op.

Fused stacks (Megatron-Core with Transformer Engine, torch.compile's inductor) run each norm,
rotary embedding and gated activation as one kernel that reads its input and writes its output
once (compute._elementwise_bytes). Eager model code dispatches every operator of the Python
expression as its own kernel, each reading and writing HBM in full, and upcasts to fp32 where the
code says so. What is counted is torchtitan's Llama code (torchtitan/models/norms.py `RMSNorm`,
torchtitan/models/llama/model.py `apply_rotary_emb` and `FeedForward`), the FSDP stack's model:

  RMSNorm   `_norm(x.float()).type_as(x) * weight`, `_norm(x) = x * rsqrt(x.pow(2).mean(-1) + eps)`:
            x.float() (read 16-bit, write fp32), pow (fp32 in and out), mean (fp32 in), add and
            rsqrt (one value per token), x * rsqrt (fp32 in and out), type_as (fp32 in, 16-bit
            out), * weight (16-bit in and out): 8 kernels.
  RoPE      `view_as_complex(xq.float()...) * freqs_cis`, `.type_as(xq)`, for q and for k:
            a float copy (16-bit in, fp32 out), the complex product (fp32 in and out; the
            frequencies, one row per position, are not counted), type_as: 3 kernels each.
  SwiGLU    `w2(F.silu(w1(x)) * w3(x))`: silu (in and out), the product (two in, one out).

LayerNorm (`F.layer_norm`) and GELU are single native kernels in eager PyTorch too, so GPT and MPT
shapes move the same bytes either way. The backward moves about twice the forward's bytes under
both counts (compute.layer_times), so the difference scales the same way.
"""

from __future__ import annotations

from tetrad.spec.model import ModelConfig

FP32 = 4
RMSNORM_KERNELS = 8
ROPE_KERNELS_PER_TENSOR = 3


def norm_traffic(config: ModelConfig, act_bytes: float, eager: bool) -> tuple[float, int]:
    """(bytes moved per normalized element, kernels) of one norm."""
    if not eager or config.norm != "rmsnorm":
        return 2 * act_bytes, 1
    upcast = act_bytes + FP32
    square, mean, scale = 2 * FP32, FP32, 2 * FP32
    downcast, weight = FP32 + act_bytes, 2 * act_bytes
    return upcast + square + mean + scale + downcast + weight, RMSNORM_KERNELS


def rope_traffic(act_bytes: float, eager: bool) -> tuple[float, int]:
    """(bytes moved per rotated element, kernels for q and k together) of rotary embedding."""
    if not eager:
        return 2 * act_bytes, 1
    upcast, rotate, downcast = act_bytes + FP32, 2 * FP32, FP32 + act_bytes
    return upcast + rotate + downcast, 2 * ROPE_KERNELS_PER_TENSOR


def activation_traffic(config: ModelConfig, act_bytes: float, eager: bool) -> tuple[float, int]:
    """(bytes moved per element of the FFN width, kernels) of the MLP's activation."""
    if config.mlp != "swiglu":
        return 2 * act_bytes, 1
    if not eager:
        return 3 * act_bytes, 1  # gate and up in, their product out
    silu, product = 2 * act_bytes, 3 * act_bytes
    return silu + product, 2


def loss_bytes_per_logit(act_bytes: float, eager: bool) -> float:
    """Bytes per logit the cross-entropy holds at its peak, beside every stored activation. A
    fused loss keeps the 16-bit logits and one fp32 copy. torchtitan's
    `cross_entropy(pred.flatten(0, 1).float(), labels)` with `del pred` before the backward peaks
    in log_softmax's backward: the saved fp32 log-probabilities, nll_loss's fp32 gradient and the
    fp32 gradient it writes (the forward's 16-bit logits, fp32 copy and log-probabilities, 10
    bytes, come first and are fewer)."""
    return 3 * FP32 if eager else act_bytes + FP32
