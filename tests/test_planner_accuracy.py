"""The planner against published large-scale training runs: one efficiency profile per GPU.

Every row is a published measurement with its layout; the planner predicts the step time from the
model, the layout and the hardware alone. Published TFLOP/s figures are turned back into step times
with the paper's own FLOP formula (so the planner's FLOP convention does not matter). Where the
paper does not give the microbatch size or pipeline schedule, the planner searches them, as the
authors tuned them. Run with -s to see the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tetrad.config import ModelConfig
from tetrad.hardware import cluster
from tetrad.planner.layout import TrainLayout, check_training_layout
from tetrad.planner.memory import kv_bytes_per_token, zero_state_bytes
from tetrad.planner.precision import training_precision
from tetrad.planner.search import TrainSpace, search_training
from tetrad.planner.serving import model_weight_bytes
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.presets import preset


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """Megatron's GPT: learned positions, LayerNorm, GELU, biases, tied embeddings."""
    return ModelConfig(name=f"gpt-{layers}x{hidden}", vocab_size=vocab, hidden_size=hidden,
                       num_layers=layers, num_heads=heads, ffn_hidden_size=4 * hidden,
                       max_seq_len=seq, norm="layernorm", position="learned", mlp="gelu",
                       bias=True, tie_embeddings=True)


def megatron_flops(config: ModelConfig, batch: int, seq: int, recompute: bool) -> float:
    """Narayanan et al. 2021, eq. 3: 72 (96 with full recompute) B s l h^2 (1 + s/6h + V/16lh)
    (V/12lh without recompute: Korthikanti et al. 2022, appendix)."""
    h, layers, vocab = config.hidden_size, config.num_layers, config.vocab_size
    factor, head = (96, 16) if recompute else (72, 12)
    return factor * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (head * layers * h))


def nemo_flops(config: ModelConfig, batch: int, seq: int) -> float:
    """NVIDIA DGX-Cloud benchmark recipes' 'model flops' (README notes): attention
    12 l h^2 (1 + g/a + s/h), MLP 18 l f h (SwiGLU), embedding 6 V h, per token."""
    h, layers = config.hidden_size, config.num_layers
    attention = 12 * layers * h * h * (1 + config.num_kv_heads / config.num_heads + seq / h)
    mlp = 18 * layers * config.ffn_hidden_size * h
    return batch * seq * (attention + mlp + 6 * config.vocab_size * h)


@dataclass
class Run:
    name: str
    source: str
    config: ModelConfig
    gpu: str
    num_gpus: int
    layout: dict  # TrainLayout fields that the source states
    global_batch: int
    seq_len: int
    measured_step_s: float
    workload: dict = field(default_factory=dict)
    nic_gbps: float | None = None


NARAYANAN_2021 = "Narayanan et al. 2021 (Megatron-LM, SC21)"
KORTHIKANTI_2022 = "Korthikanti et al. 2022, tables 3 and 5"
MTNLG = "Smith et al. 2022 (MT-NLG 530B), section 2.4"
NEMO_H100 = "NVIDIA/dgxc-benchmarking, NeMo 24.09 on DGX H100"
TORCHTITAN = "torchtitan docs/performance.md, 64 A100-80GB, FSDP2"
# 2021-22 Megatron/DeepSpeed: no flash attention, dropout, gradient reduction after the backward.
MEGATRON_2021 = dict(flash_attention=False, dropout=True, overlap_grad_reduce=False,
                     overlap_param_gather=False, overlap_p2p=False)
# NeMo 24.09 recipes: flash attention, distributed optimizer with overlapped gradient reduction
# and parameter gathers, TP communication overlap (userbuffers), overlapped p2p.
NEMO = dict(overlap_tp_comm=True)


def _narayanan_weak_scaling() -> list[Run]:
    """Table 1 (A100-80GB Selene, full recomputation, interleaved schedule): heads, hidden,
    layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU (hardware FLOPs, eq. 3)."""
    rows = [(24, 2304, 24, 1, 1, 32, 512, 137), (32, 3072, 30, 2, 1, 64, 512, 138),
            (32, 4096, 36, 4, 1, 128, 512, 142), (48, 6144, 40, 8, 1, 256, 1024, 135),
            (64, 8192, 48, 8, 2, 512, 1536, 138), (80, 10240, 60, 8, 4, 1024, 1792, 140),
            (96, 12288, 80, 8, 8, 1536, 2304, 148), (128, 16384, 96, 8, 16, 1920, 2160, 155),
            (128, 20480, 105, 8, 35, 2520, 2520, 163), (160, 25600, 128, 8, 64, 3072, 3072, 163)]
    runs = []
    for heads, hidden, layers, tp, pp, gpus, batch, tflops in rows:
        config = gpt(hidden, layers, heads)
        step = megatron_flops(config, batch, 2048, True) / (tflops * 1e12 * gpus)
        runs.append(Run(f"GPT {layers}x{hidden} tp{tp} pp{pp}", NARAYANAN_2021 + " table 1",
                        config, "a100-80gb", gpus,
                        dict(tp=tp, pp=pp, recompute="full", sequence_parallel=False,
                             **({"schedule": "interleaved"} if pp > 1 else {})),
                        batch, 2048, step, MEGATRON_2021))
    return runs


def _narayanan_ptd_vs_zero3() -> list[Run]:
    """Table 2: GPT-3 175B and 530B with PTD parallelism (tp 8) on 384-2240 A100s."""
    gpt3, mt530 = gpt(12288, 96, 96), gpt(20480, 105, 128)
    rows = [(gpt3, 12, 384, 1536, 153), (gpt3, 12, 768, 1536, 149), (gpt3, 12, 1536, 1536, 141),
            (mt530, 35, 560, 2240, 171), (mt530, 35, 1120, 2240, 167),
            (mt530, 35, 2240, 2240, 159)]
    return [Run(f"{'175B' if config is gpt3 else '530B'} PTD {gpus} GPUs",
                NARAYANAN_2021 + " table 2", config, "a100-80gb", gpus,
                dict(tp=8, pp=pp, recompute="full", sequence_parallel=False,
                     schedule="interleaved"), batch, 2048,
                megatron_flops(config, batch, 2048, True) / (tflops * 1e12 * gpus),
                MEGATRON_2021)
            for config, pp, gpus, batch, tflops in rows]


def _korthikanti() -> list[Run]:
    """Tables 3 and 5: sequence parallelism + selective recomputation vs full recomputation
    (tp only), measured iteration times on A100-80GB."""
    rows = [(gpt(6144, 48, 64), 1, 8, 4, 4, 1.10, 1.42),
            (gpt(12288, 96, 96), 8, 64, 64, 1, 13.75, 18.13),
            (gpt(20480, 105, 128), 35, 280, 280, 1, 37.83, 49.05),
            (gpt(25600, 128, 160), 64, 512, 512, 1, 71.49, 94.42)]
    runs = []
    for config, pp, gpus, batch, micro, selective, full in rows:
        for recompute, step in (("selective", selective), ("full", full)):
            runs.append(Run(f"GPT {config.num_layers}x{config.hidden_size} {recompute}",
                            KORTHIKANTI_2022, config, "a100-80gb", gpus,
                            dict(tp=8, pp=pp, dp=1, recompute=recompute, micro_batch=micro,
                                 sequence_parallel=recompute == "selective",
                                 **({"schedule": "interleaved"} if pp > 1 else
                                    {"schedule": "1f1b"})),
                            batch, 2048, step, MEGATRON_2021))
    return runs


def _mtnlg() -> list[Run]:
    config = gpt(20480, 105, 128)
    return [Run(f"MT-NLG 530B {gpus} GPUs", MTNLG, config, "a100-80gb", gpus,
                dict(tp=8, pp=35, zero=1, recompute="full", micro_batch=1,
                     sequence_parallel=False, schedule="1f1b"), 1920, 2048, step, MEGATRON_2021)
            for gpus, step in ((2240, 60.1), (2800, 50.2), (3360, 44.4))]


def _bloom() -> list[Run]:
    """BLOOM 176B (BigScience notion page / Le Scao et al. 2022): tp 4, pp 12, dp 8, ZeRO-1,
    micro batch 2, global 2048, about 150 TFLOP/s per GPU (eq. 3), 4x100 Gb/s Omni-Path per
    8-GPU node (12.5 Gb/s... per GPU: 50 Gb/s)."""
    config = ModelConfig(name="bloom-176b", vocab_size=250880, hidden_size=14336, num_layers=70,
                         num_heads=112, ffn_hidden_size=4 * 14336, max_seq_len=2048,
                         norm="layernorm", position="rope", mlp="gelu", bias=True,
                         tie_embeddings=True)
    step = megatron_flops(config, 2048, 2048, True) / (150e12 * 384)
    return [Run("BLOOM 176B 384 GPUs", "BigScience BLOOM training (about 150 TFLOP/s)", config,
                "a100-80gb", 384, dict(tp=4, pp=12, dp=8, zero=1, micro_batch=2,
                                       recompute="full", sequence_parallel=False,
                                       schedule="1f1b"),
                2048, 2048, step, MEGATRON_2021, nic_gbps=50)]


def _torchtitan() -> list[Run]:
    """FSDP2 (ZeRO-3) on 64 A100-80GB, local batch = micro batch; tokens/s per GPU measured.
    Its 'selective op' checkpointing recomputes every second matmul, which is neither of the
    planner's modes, so those rows are left out; 'selective layer' likewise."""
    rows = [("llama3-70b", 8192, 1, "full", 331), ("llama2-13b", 4096, 2, "none", 2162),
            ("llama2-70b", 4096, 2, "full", 353)]
    return [Run(f"{name} b{batch} {recompute}", TORCHTITAN, preset(name), "a100-80gb", 64,
                dict(tp=1, pp=1, dp=64, zero=3, micro_batch=batch, recompute=recompute,
                     schedule="1f1b"),
                64 * batch, seq, batch * seq / wps)
            for name, seq, batch, recompute, wps in rows]


def _nemo_h100() -> list[Run]:
    """BF16 step times of the DGX-Cloud recipes (TE flash attention, no recomputation except
    GPT-3's selective, sequence parallel, distributed optimizer, overlapped communication)."""
    llama8b = preset("llama3-8b")
    llama70b = preset("llama3-70b")
    # The recipe's 405B config uses 16 query groups (launcher conf llama3_1_405b.yaml).
    llama405b = preset("llama3-405b").replace(num_kv_heads=16)
    gpt3 = gpt(12288, 96, 96)
    runs = []
    for gpus, batch, step in ((8, 128, 12.91), (16, 256, 13.00), (32, 512, 13.05),
                              (64, 1024, 13.08), (128, 2048, 13.10)):
        runs.append(Run(f"Llama3.1 8B {gpus} GPUs", NEMO_H100 + ", llama3.1/README_8b.md",
                        llama8b, "h100-sxm", gpus,
                        dict(tp=1, pp=1, cp=2, zero=1, micro_batch=1, schedule="1f1b"), batch,
                        8192, step, NEMO))
    for gpus, batch, step in ((64, 128, 14.72), (128, 256, 14.73), (256, 512, 14.8),
                              (512, 1024, 14.89), (1024, 2048, 14.92), (2048, 4096, 14.98)):
        runs.append(Run(f"Llama3.1 70B {gpus} GPUs", NEMO_H100 + ", llama3.1/README_70b.md",
                        llama70b, "h100-sxm", gpus,
                        dict(tp=4, pp=4, cp=2, vpp=5, schedule="interleaved", zero=1,
                             micro_batch=1, sequence_parallel=True), batch, 8192, step, NEMO))
    for gpus, batch, step in ((576, 252, 17.20), (1152, 504, 17.52), (2304, 1008, 17.62)):
        runs.append(Run(f"Llama3.1 405B {gpus} GPUs", NEMO_H100 + ", llama3.1/README_405b.md",
                        llama405b, "h100-sxm", gpus,
                        dict(tp=8, pp=9, cp=2, vpp=7, schedule="interleaved", zero=1,
                             micro_batch=1, sequence_parallel=True), batch, 8192, step, NEMO))
    for gpus, batch, step in ((128, 256, 8.309), (256, 512, 8.408), (512, 1024, 8.42),
                              (1024, 2048, 8.453), (2048, 4096, 8.49)):
        runs.append(Run(f"GPT-3 175B {gpus} GPUs", NEMO_H100 + ", nemo_megatron/README_175b.md",
                        gpt3, "h100-sxm", gpus,
                        dict(tp=4, pp=8, vpp=12, schedule="interleaved", zero=1, micro_batch=1,
                             recompute="selective", sequence_parallel=True),
                        batch, 2048, step, dict(NEMO, dropout=True)))
    return runs


def _llama3_paper() -> list[Run]:
    """Llama 3 (Dubey et al. 2024) table 4: 405B, seq 8192, 16M tokens per batch, BF16 MFU.
    TFLOP/s are converted with 6N + causal attention per token (the paper's convention is not
    stated; this one matches its quoted 3.8e25 FLOPs for 15.6T tokens)."""
    config = preset("llama3-405b")
    per_token = 6 * 405.85e9 + 6 * config.num_layers * config.hidden_size * 8192
    runs = []
    for gpus, dp, tflops in ((8192, 64, 430), (16384, 128, 400)):
        step = 2048 * 8192 * per_token / (tflops * 1e12 * gpus)
        runs.append(Run(f"Llama3 405B {gpus} GPUs", "Llama 3 paper, table 4", config,
                        "h100-sxm", gpus, dict(tp=8, pp=16, cp=1, dp=dp, micro_batch=1,
                                               sequence_parallel=True, zero=1,
                                               schedule="interleaved"),
                        2048, 8192, step, NEMO))
    return runs


def all_runs() -> list[Run]:
    return (_narayanan_weak_scaling() + _narayanan_ptd_vs_zero3() + _korthikanti() + _mtnlg()
            + _bloom() + _torchtitan() + _nemo_h100() + _llama3_paper())


def known_gaps() -> list[tuple[Run, str]]:
    """Published runs whose speed comes from software the planner does not model; printed with
    their error, left out of the asserted mean."""
    gpt3, mt530 = gpt(12288, 96, 96), gpt(20480, 105, 128)
    why_zero3 = ("DeepSpeed ZeRO-3 of 2021 reached a fraction of the multi-rail fabric's "
                 "bandwidth; the planner models NCCL rings over every NIC")
    gaps = [(Run(f"{'175B' if config is gpt3 else '530B'} ZeRO-3 {gpus} GPUs",
                 NARAYANAN_2021 + " table 2", config, "a100-80gb", gpus,
                 dict(tp=1, pp=1, zero=3, recompute="full", sequence_parallel=False,
                      schedule="1f1b"), batch, 2048,
                 megatron_flops(config, batch, 2048, True) / (tflops * 1e12 * gpus),
                 MEGATRON_2021), why_zero3)
            for config, gpus, batch, tflops in ((gpt3, 384, 1536, 144), (gpt3, 768, 1536, 88),
                                                (gpt3, 1536, 1536, 44), (mt530, 640, 2560, 138),
                                                (mt530, 1120, 2240, 98),
                                                (mt530, 2240, 2240, 48))]
    # DeepSeek-V3 report: 180K H800 GPU-hours per trillion tokens on 2048 GPUs (pp 16, ep 64,
    # ZeRO-1, DualPipe, FP8), final batch 15360 x 4096.
    tokens_per_gpu_s = 1e12 / (180_000 * 3600)
    gaps.append((Run("DeepSeek-V3 2048 GPUs", "DeepSeek-V3 technical report, sections 3.2-3.3",
                     preset("deepseek-v3"), "h800", 2048,
                     dict(tp=1, pp=16, cp=1, ep=64, zero=1, schedule="zb"), 15360, 4096,
                     15360 * 4096 / (tokens_per_gpu_s * 2048), dict(dtype="fp8")),
                 "DualPipe hides the expert all-to-all behind compute and FP8 activation "
                 "storage avoids recomputation; the planner exposes the all-to-all"))
    return gaps


def predict(run: Run) -> float:
    """The step time of the published layout; the microbatch size and schedule are searched when
    the source does not give them."""
    world = cluster(run.gpu, run.num_gpus, nic_gbps=run.nic_gbps)
    workload = TrainWorkload(seq_len=run.seq_len, **run.workload)
    given = dict(run.layout)
    given.setdefault("dp", run.num_gpus // (given["tp"] * given["pp"] * given.get("cp", 1)))
    if "micro_batch" in given and "schedule" in given and (
            given["schedule"] != "interleaved" or "vpp" in given):
        microbatches = run.global_batch // (given["dp"] * given["micro_batch"])
        layout = TrainLayout(**given, microbatches=microbatches)
        check_training_layout(run.config, run.num_gpus, layout, run.seq_len)
        return evaluate_training(run.config, world, layout, workload).step.total
    space = TrainSpace(**{"cp": 1, "ep": 1, **given})
    result = search_training(run.config, world, workload, run.global_batch, space, top=1)
    assert result.num_fitting, f"{run.name}: the published layout does not fit"
    return result.ranked[0].step.total


def test_step_time_accuracy():
    rows = [(run, predict(run)) for run in all_runs()]
    errors = [predicted / run.measured_step_s - 1 for run, predicted in rows]
    print(f"\n{'run':34} {'GPU':10} {'GPUs':>5} {'measured s':>10} {'predicted':>10} {'error':>7}")
    for (run, predicted), error in zip(rows, errors):
        print(f"{run.name:34} {run.gpu:10} {run.num_gpus:5} {run.measured_step_s:10.3f} "
              f"{predicted:10.3f} {error:+7.1%}")
    by_gpu: dict[str, list[float]] = {}
    by_source: dict[str, list[float]] = {}
    for (run, _), error in zip(rows, errors):
        by_gpu.setdefault(run.gpu, []).append(abs(error))
        by_source.setdefault(run.source.split(",")[0].split(" table")[0], []).append(abs(error))
    for name, group in list(by_gpu.items()) + list(by_source.items()):
        print(f"{name}: mean |error| {sum(group) / len(group):.1%} over {len(group)} runs")
    mean = sum(abs(e) for e in errors) / len(errors)
    print(f"all: mean |error| {mean:.1%} over {len(errors)} runs")
    print("\nknown gaps (not in the mean):")
    for run, why in known_gaps():
        error = predict(run) / run.measured_step_s - 1
        print(f"{run.name:34} {error:+7.1%}  {why}")
    assert mean < 0.06
    assert all(abs(e) < 0.25 for e in errors)


def memory_figures() -> list[tuple[str, str, float, float]]:
    """(figure, source, published bytes, planner bytes)."""
    bf16 = training_precision("bf16")
    rows = [(f"ZeRO-{stage} 7.5B, 64 GPUs", "Rajbhandari et al. 2020, figure 1", published * 1e9,
             sum(zero_state_bytes(7.5e9, 64, stage, False, bf16)))
            for stage, published in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.9))]
    rows.append(("mixed-precision Adam, per parameter", "ZeRO paper, section 3.1", 16,
                 bf16.bytes_per_parameter))
    opt = kv_bytes_per_token(preset("opt-13b"), 2.0)
    # vLLM's "800 KB" is 2 x 5120 x 40 x 2 bytes = 800 KiB.
    rows += [("OPT-13B KV cache per token", "Kwon et al. 2023 (vLLM), section 3", 800 * 1024,
              opt),
             ("OPT-13B KV cache, 2048 tokens", "Kwon et al. 2023 (vLLM), section 3", 1.6e9,
              opt * 2048),
             ("13B model weights, fp16", "Kwon et al. 2023 (vLLM), figure 1", 26e9,
              model_weight_bytes(preset("opt-13b"), "bf16"))]
    return rows


def test_memory_accuracy():
    print(f"\n{'figure':38} {'published':>12} {'planner':>12} {'error':>7}")
    errors = []
    for name, source, published, predicted in memory_figures():
        errors.append(predicted / published - 1)
        print(f"{name:38} {published:12.4g} {predicted:12.4g} {errors[-1]:+7.1%}  ({source})")
    mean = sum(abs(e) for e in errors) / len(errors)
    print(f"memory: mean |error| {mean:.1%} over {len(errors)} figures (published: rounded)")
    assert mean < 0.03


if __name__ == "__main__":
    pytest.main([__file__, "-s"])
