"""Published serving measurements: the planner's serving predictions set against TensorRT-LLM's
tables (benchmarks/planner_cross_validation.py prints them; not fitted: the catalog profiles).
Every row cites its table, as benchmarks/published_runs.py's training rows do."""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.hardware.profile import cluster
from tetrad.planner.search import ServeSpace, search_serving
from tetrad.planner.serving import ServeWorkload
from tetrad.spec.presets import preset

TRTLLM = ("https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/performance.md "
          "(v0.6.1 peak throughput / v0.5 low latency tables)")


@dataclass
class ServeRun:
    """A published serving measurement: output tokens per second of a static batch of whole
    requests (prefill and decode, all GPUs), or time to the first token (batch 1, one output
    token)."""

    name: str
    citation: str
    model: str
    gpu: str
    tp: int
    dtype: str  # weights and KV cache
    batch: int
    prompt_len: int
    output_len: int
    measured: float  # tokens/s for "output_tokens_per_s", seconds for "ttft"
    metric: str  # "output_tokens_per_s" or "ttft"


def serve_runs() -> list[ServeRun]:
    """TensorRT-LLM's H100 FP8 and A100 FP16 tables (LLaMA = Llama 2 shapes). Throughput rows:
    out tok/s per GPU x TP GPUs over a static batch of 128-token prompts and 2048-token outputs,
    compared with the planner's whole request (the batch's prefill, then its decode steps). The
    A100 table does not say whether its throughput is per GPU, so only its TP-1 rows (where both
    agree) are used."""
    rows = [ServeRun(f"{model} b{batch} tp{tp} {dtype} 128/2048", TRTLLM + ", peak throughput",
                     model, gpu, tp, dtype, batch, 128, 2048, per_gpu * tp,
                     "output_tokens_per_s")
            for model, gpu, tp, dtype, batch, per_gpu in (
                ("llama2-70b", "h100-sxm", 4, "fp8", 480, 1486),
                ("llama2-7b", "h100-sxm", 1, "fp8", 112, 6818),
                ("llama2-7b", "a100-80gb", 1, "fp16", 60, 1928))]
    rows += [ServeRun(f"{model} tp{tp} {dtype} prompt {prompt}", TRTLLM + ", low latency",
                      model, gpu, tp, dtype, 1, prompt, 1, ms / 1e3, "ttft")
             for model, gpu, tp, dtype, prompt, ms in (
                 ("llama2-7b", "h100-sxm", 1, "fp8", 128, 7),
                 ("llama2-7b", "h100-sxm", 1, "fp8", 2048, 36),
                 ("llama2-70b", "h100-sxm", 4, "fp8", 128, 26),
                 ("llama2-70b", "h100-sxm", 4, "fp8", 2048, 109),
                 ("llama2-7b", "a100-80gb", 1, "fp16", 128, 16),
                 ("llama2-7b", "a100-80gb", 1, "fp16", 2048, 133),
                 ("llama2-70b", "a100-80gb", 4, "fp16", 128, 47),
                 ("llama2-70b", "a100-80gb", 4, "fp16", 2048, 377))]
    return rows


def predict_serving(run: ServeRun) -> float:
    workload = ServeWorkload(context_len=run.prompt_len + run.output_len,
                             prompt_len=run.prompt_len, output_len=run.output_len,
                             weight_dtype=run.dtype, kv_dtype=run.dtype, batch=run.batch)
    estimate = search_serving(preset(run.model), cluster(run.gpu, run.tp), workload,
                              ServeSpace(tp=run.tp, pp=1, ep=1), top=1).ranked[0]
    return (estimate.output_tokens_per_s if run.metric == "output_tokens_per_s"
            else estimate.ttft_s)


def serving_row(run: ServeRun, predicted: float) -> str:
    """One markdown row: measured, predicted (tokens/s or ms) and the signed error."""
    def shown(value: float) -> str:
        return (f"{value:,.0f} tok/s" if run.metric == "output_tokens_per_s"
                else f"{value * 1e3:.1f} ms")
    return (f"| {run.name} ({run.metric}) | {shown(run.measured)} | {shown(predicted)} | "
            f"{predicted / run.measured - 1:+.0%} |")
