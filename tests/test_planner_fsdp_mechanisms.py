"""What the FSDP stack's code costs, counted op by op against the planner: eager element-wise
kernels (tetrad.planner.unfused), torchtitan's op-level selective checkpointing
(tetrad.planner.op_checkpoint), the eager cross-entropy's peak, and what Megatron's selective
recomputation frees (Korthikanti et al. 2022)."""

from __future__ import annotations

import pytest

from benchmarks.published_runs import gpt
from tetrad.hardware.profile import cluster
from tetrad.planner.compute import gemm_time, layer_times
from tetrad.planner.flops import Gemm
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import (ActivationOptions, activation_bytes_per_layer,
                                   stage_activation_bytes)
from tetrad.planner.stacks import compile_fields, stack_fields
from tetrad.spec.presets import preset

GPU = cluster("h100-sxm", 8).gpu
BF16 = 2
TOKENS = 2 * 4096


def _layer(config, **kwargs):
    args = dict(micro_batch=2, seq_len=4096, tp=1, cp=1, ep=1, sequence_parallel=False,
                recompute="none", flash=True, dropout=False, compute_dtype="bf16",
                act_bytes=BF16, weight_bytes=BF16, portable_attention=True)
    args.update(kwargs)
    return layer_times(config, GPU, 0, **args)


def _traffic(ops):
    """(bytes moved, kernels) of (bytes read, bytes written) per element of each op."""
    return sum(read + write for read, write in ops), len(ops)


# torchtitan's RMSNorm: x.float(), pow(2), mean(-1), + eps, rsqrt, x * rsqrt, type_as, * weight.
RMSNORM = [(2, 4), (4, 4), (4, 0), (0, 0), (0, 0), (4, 4), (4, 2), (2, 2)]
# apply_rotary_emb, per tensor: float(), the complex product, type_as.
ROPE = [(2, 4), (4, 4), (4, 2)]
# w2(silu(w1(x)) * w3(x)): silu, then the product.
SWIGLU = [(2, 2), (4, 2)]


def test_eager_elementwise_costs_the_bytes_of_each_op_of_the_model_code():
    config = preset("llama3-8b")
    h, head = config.hidden_size, config.head_dim
    rotated = (config.num_heads + config.num_kv_heads) * head
    norm_bytes, norm_kernels = _traffic(RMSNORM)
    rope_bytes, rope_kernels = _traffic(ROPE)
    act_bytes, act_kernels = _traffic(SWIGLU)
    fused_norm, fused_rope, fused_act = 2 * BF16, 2 * BF16, 3 * BF16  # one read, one write each
    extra = TOKENS * (2 * h * (norm_bytes - fused_norm) + rotated * (rope_bytes - fused_rope)
                      + config.ffn_hidden_size * (act_bytes - fused_act))
    extra_kernels = 2 * (norm_kernels - 1) + (2 * rope_kernels - 1) + (act_kernels - 1)
    expected = (extra / (GPU.memory_bandwidth * GPU.efficiency.memory)
                + extra_kernels * GPU.efficiency.kernel_overhead_s)
    eager, fused = _layer(config, eager=True), _layer(config)
    assert eager.forward - fused.forward == pytest.approx(expected)
    assert eager.backward - fused.backward == pytest.approx(2 * expected)
    assert eager.matmul_forward == fused.matmul_forward


def test_layernorm_and_gelu_are_single_kernels_eager_too():
    config = gpt(4096, 32, 32)
    assert _layer(config, eager=True) == _layer(config)


def test_compile_fuses_the_blocks_but_leaves_the_loss_and_the_checkpoint_policy():
    eager = stack_fields("torchtitan")
    compiled = stack_fields("torchtitan", **compile_fields("torchtitan"))
    assert eager["eager_elementwise"] and not compiled["eager_elementwise"]
    assert compiled["eager_loss"] and compiled["selective_op"]
    assert not stack_fields("megatron").get("eager_elementwise", False)


def test_op_level_checkpointing_reruns_every_second_matmul_and_the_elementwise_ops():
    config = preset("llama3-8b")
    h, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    q_width, kv_width = heads * config.head_dim, kv * config.head_dim
    # wq, wk, wv, wo, w1, w3, w2: the 2nd, 4th and 6th run again.
    again = [Gemm(TOKENS, kv_width, h), Gemm(TOKENS, h, q_width),
             Gemm(TOKENS, config.ffn_hidden_size, h)]
    times = _layer(config, recompute="selective", eager=True, selective_op=True)
    elementwise = times.forward - times.matmul_forward - times.attention_forward
    assert times.recompute == pytest.approx(
        elementwise + sum(gemm_time(GPU, g, "bf16", BF16, BF16) for g in again))
    megatron = _layer(config, recompute="selective", eager=True)
    assert megatron.recompute == pytest.approx(megatron.attention_forward)


def test_op_level_checkpointing_keeps_the_input_and_every_other_matmul_output():
    config = preset("llama3-8b")
    h, heads = config.hidden_size, config.num_heads
    q_width = heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    kept = (h + q_width + kv_width + q_width + config.ffn_hidden_size + h) * BF16 + heads * 4
    options = ActivationOptions(selective_op=True)
    assert activation_bytes_per_layer(config, 0, 2, 4096, 1, 1, False, "selective", options,
                                      BF16) == pytest.approx(TOKENS * kept)
    none = activation_bytes_per_layer(config, 0, 2, 4096, 1, 1, False, "none", options, BF16)
    assert TOKENS * kept < none / 2


def test_megatron_selective_frees_the_score_terms_only():
    """Korthikanti et al. 2022, section 4: a GPT block keeps 34sbh + 5as^2b bytes (tp 1);
    selective recomputation drops the 5as^2b of softmax, its dropout mask and output; flash
    attention never stores them, so it leaves only the log-sum-exp to free."""
    config, seq, batch = gpt(4096, 2, 32), 2048, 1
    heads, h = config.num_heads, config.hidden_size
    scores = ActivationOptions(flash_attention=False, dropout=True)
    full = activation_bytes_per_layer(config, 0, batch, seq, 1, 1, False, "none", scores, BF16)
    selective = activation_bytes_per_layer(config, 0, batch, seq, 1, 1, False, "selective",
                                           scores, BF16)
    assert full == pytest.approx(34 * seq * batch * h + 5 * heads * seq * seq * batch)
    assert full - selective == pytest.approx(5 * heads * seq * seq * batch)
    flash = ActivationOptions(flash_attention=True, dropout=True)
    assert (activation_bytes_per_layer(config, 0, batch, seq, 1, 1, False, "none", flash, BF16)
            - activation_bytes_per_layer(config, 0, batch, seq, 1, 1, False, "selective", flash,
                                         BF16)) == pytest.approx(seq * batch * heads * 4)


def test_eager_cross_entropy_peaks_at_three_fp32_copies_of_the_logits():
    config = preset("llama3-8b")
    layout = TrainLayout(tp=1, pp=1, dp=8, zero=3, micro_batch=2, microbatches=1)
    fused = stage_activation_bytes(config, layout, 4096, ActivationOptions(), BF16, 0)
    eager = stage_activation_bytes(config, layout, 4096, ActivationOptions(eager_loss=True),
                                   BF16, 0)
    # log-probabilities, nll_loss's gradient, log_softmax's gradient: fp32 each; the fused
    # count held the 16-bit logits and one fp32 copy.
    assert eager - fused == pytest.approx(TOKENS * config.vocab_size * (3 * 4 - (BF16 + 4)))
