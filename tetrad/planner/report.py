"""What `tetrad plan` prints: the JSON object (field names are a stable interface, documented in
docs/planner.md), readable tables, and advice for layouts that do not fit."""

from __future__ import annotations

import dataclasses
import math

from tetrad.spec.model import ModelConfig
from tetrad.spec.layout import RECOMPUTE_MODES
from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GiB, Cluster
from tetrad.planner.flops import six_n_d
from tetrad.planner.layout import check_training_layout
from tetrad.planner.memory import kv_bytes_per_token, training_memory
from tetrad.planner.precision import element_bytes
from tetrad.planner.model_stats import active_parameters, count_parameters
from tetrad.planner.runtime_memory import runtime_reserve
from tetrad.planner.search import SearchResult
from tetrad.planner.serving import ServeWorkload, ServingEstimate, model_weight_bytes
from tetrad.planner.training import TrainingEstimate, TrainWorkload

SECONDS_PER_DAY = 86400.0


def _gib(value: float) -> float:
    return round(value / GiB, 3)


def _round(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def tokens_per_dollar(tokens_per_s: float, num_gpus: int,
                      price_per_gpu_hour: float) -> float | None:
    """Tokens bought by one dollar of `num_gpus` GPUs rented at `price_per_gpu_hour`; None
    without a price."""
    if not price_per_gpu_hour:
        return None
    return _round(tokens_per_s * 3600 / (num_gpus * price_per_gpu_hour))


def training_config_json(estimate: TrainingEstimate, tokens: float = 0.0,
                         price_per_gpu_hour: float = 0.0) -> dict:
    memory = estimate.memory.as_dict()
    out = {
        "parallel": estimate.layout.to_dict(),
        "num_gpus": estimate.num_gpus,  # fewer than the cluster's when ranked by cost
        "fits": estimate.fits,
        "memory_gib": {**{key: _gib(value) for key, value in memory.items()},
                       "usable": _gib(estimate.usable_memory),
                       # Of `params`: ZeRO-3's whole blocks at the peak, which the ZeRO
                       # paper's model-state formula (params + grads + optimizer without
                       # them) leaves out.
                       "params_gathered": _gib(estimate.memory.params_gathered),
                       # ZeRO-R's buffers, in `total`: --zero-bucket-size, --contiguous-buffers.
                       "zero_buffers": _gib(estimate.memory.zero_buffers),
                       "activation_buffer": _gib(estimate.memory.activation_buffer),
                       # Not in `total`: --offload-activations' kept inputs in host memory.
                       "host_activations": _gib(estimate.memory.host_activations),
                       "model_states_formula": _gib(
                           estimate.memory.params + estimate.memory.grads
                           + estimate.memory.optimizer - estimate.memory.params_gathered),
                       # Held beside the tensors; `usable` is the GPU's memory less these.
                       **{key: _gib(value) for key, value in runtime_reserve(
                           estimate.layout).lines(estimate.memory.total).items()}},
        "fullest_stage": estimate.fullest_stage,
        "step_time_s": {key: _round(value) for key, value in estimate.step.as_dict().items()},
        "tokens_per_s": _round(estimate.tokens_per_s),
        "tflops_per_gpu": _round(estimate.tflops_per_gpu),
        "hardware_tflops_per_gpu": _round(estimate.hardware_tflops_per_gpu),
        "mfu": _round(estimate.mfu, 3),
        "comm_bytes_per_step": {kind: _round(value) for kind, value in estimate.comm.sent.items()},
        "tokens_per_dollar": tokens_per_dollar(estimate.tokens_per_s, estimate.num_gpus,
                                               price_per_gpu_hour),
    }
    if tokens:
        seconds = tokens / estimate.tokens_per_s
        gpu_hours = seconds / 3600 * estimate.num_gpus
        out["days"] = _round(seconds / SECONDS_PER_DAY)
        out["gpu_hours"] = _round(gpu_hours)
        out["cost_usd"] = _round(gpu_hours * price_per_gpu_hour) if price_per_gpu_hour else None
    return out


def training_json(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                  global_batch: int, result: SearchResult, tokens: float = 0.0) -> dict:
    out = {
        "mode": "train", "model": config.name, "gpu": cluster.gpu.name,
        "num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
        "num_parameters": count_parameters(config),
        "num_active_parameters": active_parameters(config),
        "seq_len": workload.seq_len, "global_batch": global_batch, "dtype": workload.dtype,
        "stack": {key: getattr(workload, key) for key in (
            "flash_attention", "dropout", "overlap_grad_reduce", "overlap_param_gather",
            "overlap_tp_comm", "overlap_p2p", "zero3_live_params", "runtime", "compiled")},
        "recompute_ops": list(workload.recompute_ops),
        "price_per_gpu_hour": cluster.gpu.price_per_hour or None,
        "num_candidates": result.num_candidates, "num_fitting": result.num_fitting,
        "configs": [training_config_json(e, tokens, cluster.gpu.price_per_hour)
                    for e in result.ranked],
    }
    if tokens:
        exact = result.ranked[0].model_flops_per_step / result.ranked[0].tokens_per_step * tokens
        out["tokens"] = tokens
        out["total_flops"] = _round(exact)
        out["total_flops_6nd"] = _round(six_n_d(config, tokens))
    return out


def serving_config_json(estimate: ServingEstimate, price_per_gpu_hour: float = 0.0) -> dict:
    num_gpus = estimate.layout.tp * estimate.layout.pp * estimate.layout.dp
    return {
        "parallel": estimate.layout.to_dict(),
        "fits": estimate.fits,
        "memory_gib": {"params": _gib(estimate.weights), "grads": 0.0, "optimizer": 0.0,
                       "activations": _gib(estimate.activations),
                       "kv_cache": _gib(estimate.kv_cache), "total": _gib(estimate.total_memory),
                       "usable": _gib(estimate.usable_memory)},
        "batch": estimate.batch,
        "max_concurrent_sequences": estimate.max_concurrent_sequences,
        "ttft_s": _round(estimate.ttft_s),
        "tpot_s": _round(estimate.tpot_s),
        "decode_tokens_per_s": _round(estimate.decode_tokens_per_s),
        "batch_ttft_s": _round(estimate.batch_ttft_s),
        "request_s": _round(estimate.request_s),
        "output_tokens_per_s": _round(estimate.output_tokens_per_s),
        "total_tokens_per_s": _round(estimate.total_tokens_per_s),
        # Output tokens a dollar buys at the decode rate (the prompt's prefill not counted).
        "output_tokens_per_dollar": tokens_per_dollar(estimate.decode_tokens_per_s, num_gpus,
                                                      price_per_gpu_hour),
    }


def serving_json(config: ModelConfig, cluster: Cluster, workload: ServeWorkload,
                 result: SearchResult) -> dict:
    return {
        "mode": "serve", "model": config.name, "gpu": cluster.gpu.name,
        "num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
        "num_parameters": count_parameters(config),
        "num_active_parameters": active_parameters(config),
        "dtype": workload.weight_dtype, "kv_dtype": workload.kv_dtype,
        "weights_gib_total": _gib(model_weight_bytes(config, workload.weight_dtype)),
        "kv_cache_bytes_per_token": kv_bytes_per_token(config, element_bytes(workload.kv_dtype)),
        "context_len": workload.context_len, "prompt_len": workload.prompt_len,
        "output_len": workload.output_len,
        "request_rate": workload.request_rate or None,
        "price_per_gpu_hour": cluster.gpu.price_per_hour or None,
        "num_candidates": result.num_candidates, "num_fitting": result.num_fitting,
        "configs": [serving_config_json(e, cluster.gpu.price_per_hour) for e in result.ranked],
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def training_text(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                  global_batch: int, result: SearchResult, tokens: float = 0.0) -> str:
    data = training_json(config, cluster, workload, global_batch, result, tokens)
    lines = [f"{config.name}: {data['num_parameters'] / 1e9:.2f}B parameters "
             f"({data['num_active_parameters'] / 1e9:.2f}B active), {workload.dtype}, "
             f"seq {workload.seq_len}, global batch {global_batch} sequences on "
             f"{cluster.num_gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node)",
             f"{result.num_candidates} layouts considered, {result.num_fitting} fit", ""]
    headers = ["tp", "pp", "dp", "cp", "ep", "zero", "offload", "recompute", "schedule", "mb",
               "GiB", "fits", "step s", "bubble", "comm", "tok/s", "TFLOP/s", "MFU"]
    if tokens:
        headers.append("days")
    subsets = any(item["num_gpus"] != cluster.num_gpus for item in data["configs"])
    if subsets:  # ranked by cost: some layouts leave GPUs out
        headers.append("GPUs")
    rows = []
    for config_json in data["configs"]:
        p, step = config_json["parallel"], config_json["step_time_s"]
        schedule = p["schedule"] + (f"/v{p['vpp']}" if p["vpp"] > 1 else "")
        row = [str(p[k]) for k in ("tp", "pp", "dp", "cp", "ep", "zero", "offload_mode",
                                   "recompute")] + [
            schedule, str(p["micro_batch"]), f"{config_json['memory_gib']['total']:.1f}",
            "yes" if config_json["fits"] else "NO", f"{step['total']:.3g}",
            f"{step['bubble']:.3g}", f"{step['communication_exposed']:.3g}",
            f"{config_json['tokens_per_s']:.4g}", f"{config_json['tflops_per_gpu']:.0f}",
            f"{config_json['mfu']:.1%}"]
        if tokens:
            row.append(f"{config_json['days']:.1f}")
        if subsets:
            row.append(str(config_json["num_gpus"]))
        rows.append(row)
    lines.append(_table(headers, rows))
    best = data["configs"][0]
    memory = best["memory_gib"]
    lines += ["", ("best" if best["fits"] else "closest") + " layout, per GPU (fullest stage "
              f"{best['fullest_stage']}): params {memory['params']:.1f} GiB, grads "
              f"{memory['grads']:.1f}, optimizer {memory['optimizer']:.1f}, activations "
              f"{memory['activations']:.1f}; total {memory['total']:.1f} of "
              f"{memory['usable']:.1f} usable (held besides: CUDA context "
              f"{memory['cuda_context']:.1f}, NCCL buffers {memory['nccl_buffers']:.1f}, "
              f"allocator reserve {memory['allocator_reserve']:.1f})"]
    if memory["zero_buffers"] or memory["activation_buffer"]:
        lines.append(f"ZeRO-R buffers, in the total: zero_buffers {memory['zero_buffers']:.3f} "
                     f"GiB (ZeRO-3's gather and reduce-scatter buffers, or parameter offload's "
                     f"staging buffer), activation_buffer "
                     f"{memory['activation_buffer']:.3f} GiB (the checkpoints' kept inputs)")
    lines += _kept_checkpoints_line(best["parallel"], memory)
    if memory["params_gathered"]:
        lines.append(f"ZeRO-3: params include {memory['params_gathered']:.2f} GiB of parameters "
                     f"gathered whole at the peak; the ZeRO paper's sharded model states "
                     f"without them: {memory['model_states_formula']:.3f} GiB")
    if tokens:
        lines.append(f"{tokens:.3g} tokens: {data['total_flops']:.3g} FLOPs "
                     f"(6ND: {data['total_flops_6nd']:.3g}), {best['days']:.1f} days, "
                     f"{best['gpu_hours']:.3g} GPU-hours"
                     + (f", ${best['cost_usd']:,.0f}" if best["cost_usd"] else ""))
    lines.append(_price_line(cluster, best["tokens_per_dollar"], "tokens", best["num_gpus"]))
    return "\n".join(lines)


def _kept_checkpoints_line(parallel: dict, memory: dict) -> list[str]:
    """ZeRO-R's kept checkpoints (--partition-activations, --offload-activations), when on."""
    kept = []
    if parallel["partition_activations"]:
        kept.append(f"each tp rank keeps 1/{parallel['tp']} of every checkpoint's input "
                    f"(all-gathered before its rerun)")
    if parallel["offload_activations"]:
        kept.append(f"the kept inputs wait in host memory: host_activations "
                    f"{memory['host_activations']:.3f} GiB, not in the total")
    return [f"ZeRO-R checkpoints: {'; '.join(kept)}"] if kept else []


def _price_line(cluster: Cluster, per_dollar: float | None, what: str,
                num_gpus: int | None = None) -> str:
    if per_dollar is None:
        return (f"cost: no price for {cluster.gpu.name}: pass --price-per-gpu-hour (or price= "
                f"in an inline --gpu spec)")
    if not per_dollar:  # a server that fits no sequence produces nothing to price
        return f"cost: no {what} to price: nothing fits"
    return (f"cost: ${cluster.gpu.price_per_hour:.3g} per GPU-hour x "
            f"{num_gpus or cluster.num_gpus} GPUs: "
            f"{per_dollar:,.0f} {what} per dollar (${1e6 / per_dollar:.3g} per million)")


def serving_text(config: ModelConfig, cluster: Cluster, workload: ServeWorkload,
                 result: SearchResult) -> str:
    data = serving_json(config, cluster, workload, result)
    lines = [f"{config.name}: {data['num_parameters'] / 1e9:.2f}B parameters, weights "
             f"{workload.weight_dtype} ({data['weights_gib_total']:.1f} GiB for one copy), KV "
             f"{workload.kv_dtype} ({data['kv_cache_bytes_per_token'] / 1024:.1f} KiB per "
             f"token), context {workload.context_len} "
             f"(prompt {workload.prompt_len} + output {workload.output_len}) on "
             f"{cluster.num_gpus} x {cluster.gpu.name}",
             f"{result.num_candidates} layouts considered, {result.num_fitting} fit", ""]
    headers = ["tp", "pp", "dp", "ep", "weights GiB", "KV GiB", "fits", "max seqs", "batch",
               "TTFT ms", "TPOT ms", "decode tok/s"]
    rows = []
    for item in data["configs"]:
        p, memory = item["parallel"], item["memory_gib"]
        rows.append([str(p["tp"]), str(p["pp"]), str(p["dp"]), str(p["ep"]),
                     f"{memory['params']:.1f}", f"{memory['kv_cache']:.1f}",
                     "yes" if item["fits"] else "NO", str(item["max_concurrent_sequences"]),
                     str(item["batch"]), f"{item['ttft_s'] * 1e3:.1f}",
                     f"{item['tpot_s'] * 1e3:.2f}", f"{item['decode_tokens_per_s']:.4g}"])
    lines.append(_table(headers, rows))
    shape = f"{workload.prompt_len} prompt + {workload.output_len} output tokens each"
    lines += ["", f"whole requests, as serving tables report them: {shape}, "
                  + (f"{workload.request_rate:g} requests/s in continuous batching (batch: the "
                     f"running sequences per replica; batch TTFT: a request's at that load)"
                     if workload.request_rate else "a static batch per replica"),
              _table(
        ["tp", "pp", "dp", "ep", "batch", "batch TTFT ms", "TPOT ms", "request s",
         "output tok/s", "total tok/s"],
        [[str(item["parallel"][key]) for key in ("tp", "pp", "dp", "ep")]
         + [str(item["batch"]), f"{item['batch_ttft_s'] * 1e3:.1f}",
            f"{item['tpot_s'] * 1e3:.2f}", f"{item['request_s']:.3g}",
            f"{item['output_tokens_per_s']:.4g}", f"{item['total_tokens_per_s']:.4g}"]
         for item in data["configs"]])]
    lines += ["", _price_line(cluster, data["configs"][0]["output_tokens_per_dollar"],
                              "output tokens")]
    return "\n".join(lines)


def training_fit_advice(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                        estimate: TrainingEstimate) -> str:
    """For a layout that does not fit: by how much, and which single changes would fit."""
    over = estimate.memory.total - estimate.usable_memory
    layout = estimate.layout
    lines = [f"this layout needs {estimate.memory.total / GiB:.1f} GiB per GPU (pipeline stage "
             f"{estimate.fullest_stage}), {over / GiB:.1f} GiB more than the "
             f"{estimate.usable_memory / GiB:.1f} GiB usable on a {cluster.gpu.name}"]
    changes = []
    for zero in range(layout.zero + 1, 4):
        changes.append((f"--zero {zero}", dict(zero=zero)))
    # RECOMPUTE_MODES runs from the most held to the least (√N segments keep fewer inputs).
    for recompute in RECOMPUTE_MODES[RECOMPUTE_MODES.index(layout.recompute) + 1:]:
        changes.append((f"--recompute {recompute}", dict(recompute=recompute)))
    # Sequence parallelism splits the checkpointed inputs as --partition-activations does (which
    # refuses it), and more.
    if layout.tp > 1 and not layout.sequence_parallel and not layout.partition_activations:
        changes.append(("--sequence-parallel", dict(sequence_parallel=True)))
    if layout.micro_batch > 1:
        changes.append(("--micro-batch 1", dict(
            micro_batch=1, microbatches=layout.microbatches * layout.micro_batch)))
    if layout.zero >= 1 and not layout.offload:
        changes.append(("--offload optimizer", dict(offload_mode="optimizer")))
    if layout.zero == 3 and not layout.offload_params:
        changes.append(("--offload params", dict(offload_mode="params")))
    # All of them at once, each knob at its most memory-saving setting.
    every: dict = {}
    flags: dict[str, str] = {}
    for flag, change in changes:
        every.update(change)
        flags[next(iter(change))] = flag
    if len(flags) > 1:
        changes.append((" ".join(flags.values()), every))
    fixes = []
    for flag, change in changes:
        try:
            candidate = dataclasses.replace(layout, **change)
            check_training_layout(config, cluster.num_gpus, candidate, workload.seq_len)
        except ConfigError:
            continue
        memory, _ = training_memory(config, candidate, workload.precision, workload.seq_len,
                                    workload.activation_options)
        if memory.total <= estimate.usable_memory:
            fixes.append(f"{flag} ({memory.total / GiB:.1f} GiB)")
    if fixes:
        lines.append("it would fit with " + ", or ".join(fixes))
    else:
        lines.append("no change of ZeRO stage, recomputation, micro batch or offload makes it "
                     "fit: use more GPUs (or more pipeline / tensor parallelism)")
    states = count_parameters(config) * workload.precision.bytes_per_parameter
    minimum = math.ceil(states / estimate.usable_memory)
    lines.append(f"the model states alone ({states / GiB:.0f} GiB at "
                 f"{workload.precision.bytes_per_parameter:g} bytes/parameter) need at least "
                 f"{minimum} GPUs fully sharded (ZeRO-3 or tp*pp), before activations")
    return "\n".join(lines)


def serving_fit_advice(config: ModelConfig, cluster: Cluster, estimate: ServingEstimate,
                       workload: ServeWorkload) -> str:
    need = estimate.weights + estimate.activations
    per_replica = estimate.max_concurrent_sequences // estimate.layout.dp
    if per_replica >= 1:
        return (f"weights, scratch and the KV cache of {estimate.batch} sequences need "
                f"{estimate.total_memory / GiB:.1f} GiB per GPU against "
                f"{estimate.usable_memory / GiB:.1f} GiB usable on a {cluster.gpu.name}: at most "
                f"{per_replica} sequences of {workload.context_len} tokens fit per replica; "
                f"lower --batch, or use a smaller --kv-dtype or more GPUs")
    lines = [f"weights and scratch need {need / GiB:.1f} GiB per GPU against "
             f"{estimate.usable_memory / GiB:.1f} GiB usable on a {cluster.gpu.name}, leaving no "
             f"room for the KV cache of one {workload.context_len}-token sequence"]
    fewer_bytes = [d for d in ("fp8", "int4") if d != workload.weight_dtype]
    lines.append(f"try more GPUs (--num-gpus), a smaller weight format (--dtype "
                 f"{' or '.join(fewer_bytes)}), or a shorter --context-len")
    return "\n".join(lines)


def default_global_batch(seq_len: int) -> int:
    """About 4M tokens per step (GPT-3 175B used 3.2M, Llama 2 and 3 4M+), a power of two."""
    return max(1, 2 ** round(math.log2(4 * 2**20 / seq_len)))

