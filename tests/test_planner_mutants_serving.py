"""Serving estimates taken apart: weights per GPU from the tensors' own split (tensor ranks share the
attention and MLP columns, expert ranks the experts, quantized formats only the matmul weights),
the KV budget from free memory, and the first token and each decoded token as the sum of their
kernels and collectives, layer by layer."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.hardware.catalog import Cluster
from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner import comm
from tetrad.planner.compute import bandwidth_time, gemm_time, layer_times
from tetrad.planner.flops import head_gemm, layer_gemms
from tetrad.planner.layout import stage_layer_counts
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.model_stats import (count_parameters, embedding_params, head_params,
                                        layer_params, norm_params, position_params,
                                        unquantized_layer_params)
from tetrad.planner.precision import weight_bytes
from tetrad.planner.serving import (ServeLayout, ServeWorkload, evaluate_serving,
                                    model_weight_bytes, weight_bytes_per_gpu)
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

H100 = catalog_gpu("h100-sxm")
NODE = Cluster(H100, 8)
LLAMA = preset("llama2-7b")
MOE = preset("mixtral-8x7b").replace(num_layers=4)
DEEPSEEK = preset("deepseek-v3").replace(num_layers=4)  # 3 dense layers, then MoE
GPT = ModelConfig(vocab_size=50304, hidden_size=2048, num_layers=4, num_heads=16,
                  ffn_hidden_size=1024, max_seq_len=2048, norm="layernorm", position="learned",
                  mlp="gelu", bias=True, tie_embeddings=True)


def _weights(config, layout, dtype, stage):
    """Bytes of one GPU's weights: each block's matmul weights in `dtype` (attention and MLP
    columns over tp; experts over max(ep, tp) ranks, whole on every rank when ep is 1), its norms,
    biases and router in 16 bits; the embedding over tp on the first stage, the final norm and
    the head (a tied one's own copy when the pipeline separates it) on the last."""
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = sum(counts[:stage])
    expert_split = 1 if layout.ep == 1 else max(layout.ep, layout.tp)
    total = 0.0
    for layer in range(first, first + counts[stage]):
        params = layer_params(config, layer)
        kept = unquantized_layer_params(config, layer)
        matmuls = params.tp_sharded / layout.tp + (params.replicated - kept)
        total += (matmuls + params.experts / expert_split) * weight_bytes(dtype) + kept * 2
    if stage == 0:
        total += (embedding_params(config) / layout.tp + position_params(config)) * 2
    if stage == layout.pp - 1:
        head = head_params(config) or (embedding_params(config) if layout.pp > 1 else 0)
        total += (head / layout.tp + norm_params(config)) * 2
    return total


@pytest.mark.parametrize("config", [LLAMA, MOE, GPT], ids=["llama", "moe", "gpt"])
# int8 and int4 are counted matrix by matrix as the engine holds them (planner/quantized.py;
# tests/test_quantization*.py check them against the engine's counted bytes).
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 2), (2, 1, 4),
                                      (4, 1, 2)])
def test_weights_per_gpu_follow_each_tensors_split(config, dtype, tp, pp, ep):
    if ep > 1 and not config.is_moe:
        return
    layout = ServeLayout(tp=tp, pp=pp, ep=ep)
    for stage in range(pp):
        assert weight_bytes_per_gpu(config, layout, dtype, stage) == pytest.approx(
            _weights(config, layout, dtype, stage))
    if (tp, pp, ep) == (1, 1, 1):
        assert model_weight_bytes(config, dtype) == pytest.approx(
            _weights(config, layout, dtype, 0))
        if dtype == "bf16":
            assert model_weight_bytes(config, dtype) == 2 * count_parameters(config)


def _serve(prompt=512, output=256, batch=0, **kwargs):
    return ServeWorkload(context_len=prompt + output, prompt_len=prompt, output_len=output,
                         batch=batch, **kwargs)


@pytest.mark.parametrize("config", [LLAMA, GPT], ids=["ffn-widest", "qkv-widest"])
@pytest.mark.parametrize("prompt,batch", [(512, 4), (64, 200), (20000, 8)])
@pytest.mark.parametrize("tp", [1, 2])
def test_scratch_is_a_prefill_chunks_widest_intermediates_and_the_batchs_logits(config, prompt,
                                                                                 batch, tp):
    """One chunk of at most 8192 tokens (vLLM's chunked prefill; at least one per sequence of the
    batch) in 16 bits: the residual stream, its normed copy, the block input and output (4h) and
    the widest projection twice (the SwiGLU pair, or q, k and v); plus fp32 logits of the
    batch's last positions."""
    estimate = evaluate_serving(config, NODE, ServeLayout(tp=tp, dp=8 // tp),
                                _serve(prompt, 16, batch))
    tokens = min(8192, max(prompt, batch))
    widest = max(2 * config.ffn_hidden_size,
                 (config.num_heads + 2 * config.num_kv_heads) * config.head_dim) / tp
    assert estimate.activations == pytest.approx(
        tokens * (4 * config.hidden_size + 2 * widest) * 2 + batch * config.vocab_size / tp * 4)


@pytest.mark.parametrize("batch", [0, 3])
@pytest.mark.parametrize("layout", [ServeLayout(), ServeLayout(tp=2, dp=4), ServeLayout(pp=2)])
def test_kv_budget_is_free_memory_over_a_whole_context(batch, layout):
    workload = _serve(batch=batch)
    estimate = evaluate_serving(LLAMA, NODE, layout, workload)
    usable = 0.9 * H100.memory_bytes
    assert estimate.usable_memory == pytest.approx(usable)
    per_token = kv_bytes_per_token(LLAMA, 2.0, layout.tp,
                                   max(stage_layer_counts(LLAMA.num_layers, layout.pp)))
    per_replica = estimate.max_concurrent_sequences // layout.dp
    assert estimate.max_concurrent_sequences == per_replica * layout.dp
    edge = evaluate_serving(LLAMA, NODE, layout, _serve(batch=per_replica))
    assert edge.total_memory <= usable < edge.total_memory + per_token * 768 + (
        evaluate_serving(LLAMA, NODE, layout, _serve(batch=per_replica + 1)).activations
        - edge.activations)
    assert estimate.batch == (batch or min(per_replica, 256))
    assert estimate.kv_cache == pytest.approx(estimate.batch * 768 * per_token)
    assert estimate.total_memory == pytest.approx(estimate.weights + estimate.activations
                                                  + estimate.kv_cache)
    assert estimate.fits == (estimate.batch >= 1 and estimate.total_memory <= usable)
    assert estimate.decode_tokens_per_s == pytest.approx(
        layout.dp * estimate.batch / estimate.tpot_s)
    too_many = evaluate_serving(LLAMA, NODE, layout, _serve(batch=per_replica + 1))
    assert not too_many.fits


def _decode_layer(config, layer, tokens, context, tp=1, ep=1, gpu=H100):
    """Its matmuls at `tokens` rows, then attention over every sequence's whole KV cache: the
    longer of its FLOPs at the attention efficiency and the cache read."""
    group = tokens * max(1, ep // tp)
    expert_tp = tp // ep if 1 < ep < tp else 1
    matmuls = sum(gemm_time(gpu, g, "bf16", 2.0, 2.0)
                  for g in layer_gemms(config, layer, tokens, tp, ep, group, expert_tp))
    heads = config.num_heads // tp
    # MLA attends in its latent space (weight absorption): scores over the latent and the rope
    # key, values out of the latent.
    width = (2 * config.kv_lora_rank + config.qk_rope_head_dim if config.attention == "mla"
             else 2 * config.head_dim)
    flops = 2.0 * heads * width * context * tokens
    read = kv_bytes_per_token(config, 2.0, tp, 1) * context * tokens
    return matmuls + max(flops / (gpu.peak("bf16") * gpu.efficiency.attention),
                         bandwidth_time(gpu, read, 1))


@pytest.mark.parametrize("config", [LLAMA, MOE, DEEPSEEK], ids=["llama", "moe", "mla"])
@pytest.mark.parametrize("tp", [1, 2])
def test_first_token_and_each_next_one_are_their_layers_and_collectives(config, tp):
    prompt, output, batch = 256, 128, 6
    layout = ServeLayout(tp=tp, dp=8 // tp)
    estimate = evaluate_serving(config, NODE, layout, _serve(prompt, output, batch))
    group = comm.place_group(NODE, tp, 1)
    expert_tp = 1
    prefill = sum(layer_times(config, H100, layer, 1, prompt, tp, 1, 1, True, "none", True,
                              False, "bf16", 2.0, 2.0, prompt, expert_tp).forward
                  + 2 * comm.all_reduce_time(NODE, group, prompt * config.hidden_size * 2)
                  for layer in range(config.num_layers))
    head = gemm_time(H100, head_gemm(config, 1, tp), "bf16", 2.0, 2.0)
    assert estimate.ttft_s == pytest.approx(prefill + head)
    context = prompt + output // 2  # a token is decoded at the mean context
    decode = sum(_decode_layer(config, layer, batch, context, tp)
                 + 2 * comm.all_reduce_time(NODE, group, batch * config.hidden_size * 2)
                 for layer in range(config.num_layers))
    assert estimate.tpot_s == pytest.approx(
        decode + gemm_time(H100, head_gemm(config, batch, tp), "bf16", 2.0, 2.0))


def test_a_pipeline_decodes_its_microbatches_through_every_stage_in_turn():
    """pp 2: the batch splits into two microbatches of ceil(batch / 2); a token takes two stage
    times of the slower stage, the first stage also sending its microbatch on."""
    prompt, output, batch = 256, 128, 5
    estimate = evaluate_serving(LLAMA, NODE, ServeLayout(pp=2, dp=4),
                                _serve(prompt, output, batch))
    in_flight, context = 3, prompt + output // 2
    half = LLAMA.num_layers // 2
    first = sum(_decode_layer(LLAMA, layer, in_flight, context) for layer in range(half)) \
        + comm.p2p_time(NODE, False, in_flight * LLAMA.hidden_size * 2)
    last = sum(_decode_layer(LLAMA, layer, in_flight, context)
               for layer in range(half, LLAMA.num_layers)) \
        + gemm_time(H100, head_gemm(LLAMA, in_flight), "bf16", 2.0, 2.0)
    assert estimate.tpot_s == pytest.approx(2 * max(first, last))


def test_experts_on_other_replicas_add_a_dispatch_and_combine_per_moe_layer():
    """ep 8 over tp 2: a token's k expert copies leave the replica and come back, each tensor
    rank sending its slice, in every MoE layer of prefill and decode."""
    prompt, output, batch = 256, 128, 4
    spread = evaluate_serving(MOE, NODE, ServeLayout(tp=2, dp=4, ep=8),
                              _serve(prompt, output, batch))
    group = comm.place_group(NODE, 8, 1)
    tp_group = comm.place_group(NODE, 2, 1)

    def moe_traffic(tokens):
        size = tokens * MOE.num_experts_per_token * MOE.hidden_size * 2 / 2
        return 2 * comm.all_to_all_time(NODE, group, size)

    prefill = sum(layer_times(MOE, H100, layer, 1, prompt, 2, 1, 8, True, "none", True, False,
                              "bf16", 2.0, 2.0, prompt * 4, 1).forward
                  + 2 * comm.all_reduce_time(NODE, tp_group, prompt * MOE.hidden_size * 2)
                  + moe_traffic(prompt) for layer in range(MOE.num_layers))
    assert spread.ttft_s == pytest.approx(
        prefill + gemm_time(H100, head_gemm(MOE, 1, 2), "bf16", 2.0, 2.0))


def test_a_serving_workload_and_layout_at_their_limits():
    from tetrad.errors import ConfigError
    from tetrad.planner.serving import check_serve_layout

    ServeWorkload(context_len=1, prompt_len=1, output_len=0)
    ServeWorkload(context_len=30, prompt_len=10, output_len=20, batch=0)
    for context, prompt, output, batch, words in (
            (10, 0, 0, 0, "--prompt-len must be at least 1"),
            (10, 1, -1, 0, "--output-len at least 0"),
            (29, 10, 20, 0, "cannot hold the prompt and the output"),
            (30, 10, 20, -1, "--batch must be")):
        with pytest.raises(ConfigError, match=words):
            ServeWorkload(context_len=context, prompt_len=prompt, output_len=output,
                          batch=batch)
    check_serve_layout(MOE, 8, ServeLayout(tp=2, dp=4, ep=8))
    check_serve_layout(MOE, 8, ServeLayout(tp=4, dp=2, ep=2))
    check_serve_layout(MOE, 8, ServeLayout(tp=2, pp=2, dp=2))
    for gpus, layout, words in ((8, ServeLayout(tp=2, dp=2), "but there are 8 GPUs"),
                                (8, ServeLayout(tp=2, dp=2, pp=2, ep=8), "must divide tp\\*dp"),
                                (8, ServeLayout(tp=1, pp=8), "more than the model")):
        with pytest.raises(ConfigError, match=words):
            check_serve_layout(MOE, gpus, layout)


@pytest.mark.parametrize("config", [LLAMA, DEEPSEEK], ids=["gqa", "mla"])
def test_decode_attention_is_compute_bound_where_memory_is_fast(config):
    """With HBM ten thousand times faster and free launches every decode kernel is bound by its
    FLOPs: the attention term is then its FLOPs alone (MLA's in the latent space)."""
    fast = dataclasses.replace(H100, memory_bandwidth=1e4 * H100.memory_bandwidth,
                               efficiency=dataclasses.replace(H100.efficiency,
                                                              kernel_overhead_s=0.0))
    prompt, output, batch = 4096, 128, 64  # attention's FLOPs far above a launch
    estimate = evaluate_serving(config, Cluster(fast, 8), ServeLayout(dp=8),
                                _serve(prompt, output, batch))
    context = prompt + output // 2
    decode = sum(_decode_layer(config, layer, batch, context, gpu=fast)
                 for layer in range(config.num_layers))
    assert estimate.tpot_s == pytest.approx(
        decode + gemm_time(fast, head_gemm(config, batch), "bf16", 2.0, 2.0))


@pytest.mark.parametrize("num_layers, pp", [(10, 4), (11, 4)])
def test_the_fullest_serving_gpu_is_found_among_every_stage(num_layers, pp):
    """A dense-first MoE model (DeepSeek-V3's 3 dense layers) cut unevenly puts its heaviest
    weights on a middle stage of MoE layers; the estimate's weights are the most any stage holds
    (the planner looked at one stage per layer count, which missed it)."""
    config = preset("deepseek-v3").replace(num_layers=num_layers)
    layout = ServeLayout(pp=pp)
    estimate = evaluate_serving(config, NODE, layout, _serve(batch=1))
    per_stage = [_weights(config, layout, "bf16", stage) for stage in range(pp)]
    assert estimate.weights == pytest.approx(max(per_stage))
    assert per_stage.index(max(per_stage)) not in (0, pp - 1)  # a middle stage is the fullest
