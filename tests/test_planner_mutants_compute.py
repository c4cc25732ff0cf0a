"""Kernel times against byte and FLOP counts made by hand, and against the additive structure a
pipeline cut must keep (the stages of a model take, together, the time of the whole model)."""

from __future__ import annotations

import pytest

from tetrad.spec.model import ModelConfig
from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner.compute import (attention_efficiencies, attention_times, bandwidth_time,
                                    gemm_time, head_times, layer_times, optimizer_time,
                                    stage_times)
from tetrad.planner.flops import Gemm
from tetrad.spec.presets import preset

H100 = catalog_gpu("h100-sxm")
A100 = catalog_gpu("a100-80gb")


def _streamed(gpu, num_bytes, kernels):
    """Time to stream `num_bytes` through HBM at the profile's efficiency, plus launches."""
    return num_bytes / (gpu.memory_bandwidth * gpu.efficiency.memory) + \
        kernels * gpu.efficiency.kernel_overhead_s


def _gpt(layers=4, h=1024, heads=16, seq=2048):
    return ModelConfig(vocab_size=1000, hidden_size=h, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * h, max_seq_len=seq, norm="layernorm",
                       position="learned", mlp="gelu", bias=True, tie_embeddings=True)


@pytest.mark.parametrize("gpu", [H100, A100], ids=["h100", "a100"])
def test_unfused_attention_streams_its_scores(gpu):
    """Without flash attention: two batched GEMMs (QK^T over 64-wide heads, then AV), and a
    softmax that reads the 2-byte scores and writes 2-byte probabilities (one kernel); dropout
    reads those and writes a 1-byte mask and a 2-byte copy (a second kernel). The backward moves twice the bytes
    and does twice the matmuls."""
    config, b, s, tp = _gpt(), 2, 512, 2
    heads = 16 // tp
    scores, values = Gemm(s, s, 64, b * heads), Gemm(s, 64, s, b * heads)
    matmuls = sum(gemm_time(gpu, g, "bf16", 2.0, 2.0) for g in (scores, values))
    elements = b * heads * s * s
    for dropout, per_element, kernels in ((False, 4, 1), (True, 9, 2)):
        forward, backward = attention_times(config, gpu, b, s, tp, 1, False, dropout, 2.0)
        assert forward == pytest.approx(matmuls + _streamed(gpu, elements * per_element, kernels))
        assert backward == pytest.approx(
            2 * matmuls + _streamed(gpu, 2 * elements * per_element, kernels))


def test_flash_attention_backward_is_two_and_a_half_forwards():
    # FlashAttention-2, section 3.1.2: 5 matmuls backward against 2 forward; causal attention
    # does s(s+1)/2 query-key pairs, 2 FLOPs per multiply-add in QK^T and again in AV.
    # Each at its own measured share of peak (tests/test_planner_mechanisms.py checks those).
    config, b, s, tp = _gpt(), 2, 512, 2
    forward, backward = attention_times(config, H100, b, s, tp, 1, True, False, 2.0)
    flops = 2 * 8 * (64 + 64) * s * (s + 1) / 2 * b
    overhead = H100.efficiency.kernel_overhead_s
    forward_share, backward_share = attention_efficiencies(H100, False, True, s)
    assert forward == pytest.approx(flops / (H100.peak("bf16") * forward_share) + overhead)
    assert backward == pytest.approx(2.5 * flops / (H100.peak("bf16") * backward_share)
                                     + 2 * overhead)


def test_recomputation_repeats_the_forward_or_only_attention():
    config = _gpt()
    args = (H100, 0, 2, 1024, 2, 1, 1, True)
    tail = (True, False, "bf16", 2.0, 2.0)
    none = layer_times(config, *args, "none", *tail)
    full = layer_times(config, *args, "full", *tail)
    selective = layer_times(config, *args, "selective", *tail)
    assert none.recompute == 0
    assert full.recompute == pytest.approx(none.forward)
    assert selective.recompute == pytest.approx(none.attention_forward)
    assert (full.forward, full.backward) == (none.forward, none.backward)
    # The backward does twice the matmul and element-wise work but the attention's own backward.
    attention_forward, attention_backward = attention_times(config, H100, 2, 1024, 2, 1, True,
                                                            False, 2.0)
    assert none.attention_forward == attention_forward
    assert none.backward - 2 * none.forward == pytest.approx(
        attention_backward - 2 * attention_forward)


def test_gelu_block_element_wise_bytes():
    """A GPT block with tp 1: two layernorms (read + write h each), two residual adds (read two,
    write one) and the GELU (read and write 4h) at 2 bytes; with dropout, the two on the
    residual path each write a 1-byte mask and their 2-byte output: the block's time beyond its
    matmuls and attention."""
    config, b, s = _gpt(), 2, 512
    args = (H100, 0, b, s, 1, 1, 1, False, "none", True)
    for dropout, per_token, kernels in ((False, (4 + 6 + 2 * 4) * 1024 * 2, 5),
                                        (True, (4 + 6 + 2 * 4) * 1024 * 2 + 2 * 1024 * 3, 7)):
        times = layer_times(config, *args, dropout, "bf16", 2.0, 2.0)
        attention = attention_times(config, H100, b, s, 1, 1, True, dropout, 2.0)[0]
        elementwise = times.forward - times.matmul_forward - attention
        assert elementwise == pytest.approx(_streamed(H100, b * s * per_token, kernels))


def test_head_reads_fp32_logits_both_ways():
    config, b, s = _gpt(), 2, 512
    times = head_times(config, H100, b, s, 1, 1, "bf16", 2.0, 2.0)
    tokens = b * s
    matmul = gemm_time(H100, Gemm(tokens, 1000, 1024), "bf16", 2.0, 2.0)
    loss = _streamed(H100, tokens * 1000 * (2 + 4 + 4), 2)
    norm = _streamed(H100, tokens * 1024 * 2 * 2, 1)
    assert times.forward == pytest.approx(matmul + loss + norm)
    assert times.backward == pytest.approx(2 * matmul + loss + 2 * norm)
    assert times.matmul_forward == pytest.approx(matmul)
    assert times.recompute == 0 and times.attention_forward == 0


@pytest.mark.parametrize("name", ["small", "tiny-moe"])
@pytest.mark.parametrize("stages", [2, 3])
def test_the_stages_of_a_cut_take_the_whole_models_time(name, stages):
    config = preset(name)
    args = (2, 256, 1, 1, 1, False, "selective", True, False, "bf16", 2.0, 2.0)
    whole = stage_times(config, H100, 1, 0, *args)
    parts = [stage_times(config, H100, stages, stage, *args) for stage in range(stages)]
    for field in ("forward", "backward", "recompute", "matmul_forward", "attention_forward"):
        assert sum(getattr(part, field) for part in parts) == pytest.approx(getattr(whole, field))
    head = head_times(config, H100, 2, 256, 1, 1, "bf16", 2.0, 2.0)
    blocks = sum(layer_times(config, H100, layer, *args[:9], "bf16", 2.0, 2.0).forward
                 for layer in range(config.num_layers))
    assert whole.forward == pytest.approx(blocks + head.forward)


def test_adam_streams_gradient_master_moments_and_parameter():
    n = 1e9
    # Read the bf16 gradient, read and write 12 bytes of fp32 state, write the bf16 parameter.
    assert optimizer_time(A100, n, 2, 2, 12, False, 1e11) == pytest.approx(
        _streamed(A100, 28 * n, 1))
    # Offloaded: the state is streamed in host memory and the gradient and parameter cross PCIe.
    assert optimizer_time(A100, n, 2, 2, 12, True, 1e11) == pytest.approx(
        28 * n / 1e11 + 4 * n / A100.pcie_bandwidth)


def test_bandwidth_time_is_bytes_over_effective_bandwidth_plus_launches():
    assert bandwidth_time(H100, 3e9, 4) == pytest.approx(
        3e9 / (H100.memory_bandwidth * H100.efficiency.memory)
        + 4 * H100.efficiency.kernel_overhead_s)
