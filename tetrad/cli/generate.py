"""`tetrad generate PATH --prompt TEXT`: complete prompts with the serving engine and print them.
Also the engine and sampling flags that `tetrad run` and `tetrad serve` share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from tetrad.spec.serving import DEFAULT_CPU_KV_MEMORY, PREEMPTION_MODES, ServeConfig

# Help texts name a default as {field}: ServeConfig's, the one place each is declared.
ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("--dtype", str, "{dtype} (default: the checkpoint's), fp32, bf16 or fp16"),
    ("--device", str, "{device} (default: cuda when available), cpu, cuda, cuda:N"),
    ("--block-size", int, "tokens per KV block (default {block_size})"),
    ("--kv-memory", str, f"KV cache budget, e.g. 2GiB (default: "
                         f"{DEFAULT_CPU_KV_MEMORY // 2**20}MiB on CPU, the free memory on a GPU)"),
    ("--swap-memory", str, "CPU pool for --preemption swap (default {swap_memory})"),
    ("--num-blocks", int, "exact number of KV blocks (overrides --kv-memory)"),
    ("--max-num-seqs", int, "sequences running at once (default {max_num_seqs})"),
    ("--max-num-batched-tokens", int, "tokens computed per step (default "
                                      "{max_num_batched_tokens})"),
    ("--max-model-len", int, "context length (default: the model's)"),
    ("--preemption", str, "when KV blocks run out: " + " or ".join(PREEMPTION_MODES)
     + " (default {preemption})"),
    ("--attention", str, "{attention} (default: triton on a GPU where it runs, else varlen where "
                         "it can, else gathering; on a CPU the C++ decode kernel, sdpa or "
                         "tiled without a compiler), cpu, sdpa, tiled, flex, varlen or triton"),
    ("--quantization", str, "{quantization} (default), int8 or int4: the blocks' projections "
                            "held in 8 bits (a scale per output channel) or 4 bits (a scale and "
                            "zero per 128 inputs), computing in bf16/fp16"),
    ("--kv-cache-dtype", str, "{kv_cache_dtype} (default: the model's dtype), bf16, fp16 or fp8 "
                              "(E4M3, 1 byte; read by the sdpa and tiled backends)"),
    ("--seed", int, "engine seed: the sampling seed of requests that bring none (default "
                    "{seed})"),
    ("--tp", int, "tensor-parallel ranks: the weights and KV cache split over this many "
                  "processes, one GPU each (default {tp})"),
    ("--pp", int, "pipeline stages, each of --tp ranks: consecutive layers and their KV cache "
                  "per stage, decode steps in microbatches (default {pp})"),
    ("--dp", int, "attention data-parallel ranks, each with its own requests and KV cache "
                  "(default {dp}; with tp 1 and pp 1)"),
    ("--ep", int, "ranks the routed experts are spread over (default {ep}): dividing --dp, "
                  "tokens sent to them by all-to-all; or equal to --tp"),
]
SAMPLING_FLAGS: list[tuple[str, type, str]] = [
    ("--temperature", float, "0 is greedy (default 1.0)"),
    ("--top-p", float, "nucleus sampling threshold (default 1.0: off)"),
    ("--top-k", int, "keep the k most likely tokens (default 0: off)"),
    ("--repetition-penalty", float, "penalize tokens already seen (default 1.0: off)"),
    ("--max-tokens", int, "tokens to generate (default: up to the context length)"),
    ("--sample-seed", int, "sampling seed of this request"),
]


# Flags beyond the value flags above, with their argparse options.
ENGINE_SWITCHES: list[tuple[str, dict]] = [
    ("--enforce-eager", dict(action="store_true",
                             help="no CUDA graphs for decode steps (they are captured on a GPU)")),
    ("--compile", dict(action="store_true", help="torch.compile the forward (and FlexAttention)")),
    ("--no-prefix-caching", dict(dest="enable_prefix_caching", action="store_false",
                                 help="do not share KV blocks across requests")),
]
SAMPLING_SWITCHES: list[tuple[str, dict]] = [
    ("--stop", dict(action="append", help="stop string (repeatable)")),
    ("--ignore-eos", dict(action="store_true",
                          help="keep generating past the end-of-text token")),
]


def _add_group(parser: argparse.ArgumentParser, title: str, values: list[tuple[str, type, str]],
               switches: list[tuple[str, dict]]) -> None:
    """Flags left out of the command line stay out of the namespace (SUPPRESS), so a stored
    model's defaults and then the engine's fill them."""
    defaults = {field.name: field.default for field in dataclasses.fields(ServeConfig)}
    group = parser.add_argument_group(title)
    for flag, kind, help_text in values:
        group.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                           help=help_text.format_map(defaults))
    for flag, options in switches:
        group.add_argument(flag, default=argparse.SUPPRESS, **options)


def add_engine_arguments(parser: argparse.ArgumentParser, nargs: str | None = None) -> None:
    """nargs: the model argument's ("*": `tetrad serve`'s none or several, a list)."""
    parser.add_argument("path", metavar="MODEL", nargs=nargs,
                        help="a stored model's name (tetrad list), an HF model folder (llama, "
                             "qwen2, gpt2, ...) or a tetrad checkpoint (step folder or root)")
    parser.add_argument("--tokenizer", help="'byte', a tokenizer.json or a folder (default: the "
                                            "model folder's)")
    _add_group(parser, "engine", ENGINE_FLAGS, ENGINE_SWITCHES)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    _add_group(parser, "sampling", SAMPLING_FLAGS, SAMPLING_SWITCHES)


def build_engine(args: argparse.Namespace):
    """The engine over args.path. A stored model's name becomes its folder, and `args.stored`
    the stored model, whose Modelfile settings are the defaults of the flags left out."""
    from tetrad.inference.engine import LLM
    from tetrad.store.models import resolve_model_argument

    args.path, args.stored = resolve_model_argument(args.path)
    config = {key: value for key, value in vars(args).items()
              if key in ServeConfig.__dataclass_fields__}
    if args.stored and "max_model_len" in args.stored.parameters:
        config.setdefault("max_model_len", args.stored.parameters["max_model_len"])
    tokenizer = None
    if getattr(args, "tokenizer", None):
        from tetrad.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    return LLM(args.path, tokenizer, log=lambda line: print(line, file=sys.stderr), **config)


def sampling_params(args: argparse.Namespace, **extra):
    from tetrad.inference.core.params import SamplingParams

    values = {key: value for key, value in vars(args).items()
              if key in ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens",
                         "stop", "ignore_eos", "n")}
    if "sample_seed" in vars(args):
        values["seed"] = args.sample_seed
    stored = getattr(args, "stored", None)
    defaults = stored.sampling_defaults if stored else {}
    return SamplingParams(**{**defaults, **values, **extra})


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts with a model",
                                   description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for a batch)")
    parser.add_argument("--n", type=int, default=argparse.SUPPRESS, help="samples per prompt")
    parser.add_argument("--report", help="write a JSON report (latencies, throughput, KV use)")
    add_sampling_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with build_engine(args) as llm:
        return generate(llm, args)


def generate(llm, args: argparse.Namespace) -> int:
    params = sampling_params(args)
    start = time.perf_counter()
    if len(args.prompt) == 1 and params.n == 1:
        outputs = []
        for output in llm.stream(args.prompt[0], params):
            print(output.outputs[0].delta_text, end="", flush=True)
            outputs = [output]
        print()
    else:
        outputs = llm.generate(args.prompt, params)
        for output in outputs:
            for completion in output.outputs:
                print(f"--- prompt {output.request_id}, sample {completion.index} "
                      f"({completion.finish_reason})\n{output.prompt}{completion.text}")
    report = build_report(llm, outputs, time.perf_counter() - start)
    summary = report["summary"]
    print(f"{summary['generated_tokens']} tokens in {summary['time_s']:.2f} s "
          f"({summary['tokens_per_s']:.1f} tokens/s), TTFT p50 {summary['ttft_s']['p50']:.3f} s, "
          f"TPOT p50 {summary['tpot_s']['p50']:.4f} s, KV blocks peak "
          f"{summary['kv_blocks_peak']}/{summary['kv_blocks_total']}, preemptions "
          f"{summary['preemptions']}", file=sys.stderr)
    if args.report:
        with open(args.report, "w") as file:
            json.dump(report, file, indent=2)
    return 0


def build_report(llm, outputs: list, elapsed: float) -> dict:
    """The serving side of the run report (DESIGN.md): per request and summarized."""
    import dataclasses

    stats = llm.stats()
    generated = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {
        "schema": 1,
        "config": {**dataclasses.asdict(llm.config), "model": llm.model_config.to_dict()},
        "kv": dataclasses.asdict(llm.kv_plan),
        "requests": [{"id": o.request_id, "prompt_tokens": len(o.prompt_token_ids),
                      "cached_prompt_tokens": o.num_cached_tokens,
                      "completion_tokens": [len(c.token_ids) for c in o.outputs],
                      "finish_reasons": [c.finish_reason for c in o.outputs],
                      "ttft_s": (o.first_token_time or o.finish_time) - o.arrival_time,
                      "latency_s": o.finish_time - o.arrival_time} for o in outputs],
        "summary": {"generated_tokens": generated, "time_s": elapsed,
                    "tokens_per_s": generated / max(elapsed, 1e-9),
                    "ttft_s": llm.metrics.ttft.summary(), "tpot_s": llm.metrics.tpot.summary(),
                    "preemptions": stats["preemptions"],
                    "kv_blocks_total": stats["kv_blocks_total"],
                    "kv_blocks_peak": llm.peak_blocks_used,
                    "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]},
    }
