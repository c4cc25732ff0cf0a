"""`tetrad plan train|serve`: memory, time and the best parallel layout, without torch."""

from __future__ import annotations

import argparse
import dataclasses
import json

from tetrad.planner.serving import DEFAULT_GPU_MEMORY_UTILIZATION
from tetrad.planner.zero_r_flags import check_zero_r
from tetrad.planner.stacks import DEFAULT_SERVING_STACK, DEFAULT_STACK, SERVING_STACKS, STACKS
from tetrad.schedules.generate import SCHEDULES
from tetrad.spec.layout import OFFLOAD_MODES, RECOMPUTE_MODES


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset name (llama3-70b, deepseek-r1, ...), HF config.json or folder")
    parser.add_argument("--gpu", required=True,
                        help="GPU (h100-sxm, a100-80gb, rtx-4090, ...), server (dgx-h100), "
                             "profile file, or either with numbers replaced inline: "
                             "h100,hbm=96GB,bw=2.4TB/s,price=2.5 (docs/planner.md)")
    parser.add_argument("--num-gpus", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs sharing NVLink/PCIe (default 8)")
    parser.add_argument("--nic-gbps", type=float, default=None,
                        help="network bandwidth per GPU in Gb/s (default: the GPU's reference "
                             "server, e.g. 400 for DGX H100)")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--ep", type=int)
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="USD",
                        help="rental price per GPU-hour for cost and tokens per dollar "
                             "(default: the catalog's on-demand list price, docs/planner.md)")
    parser.add_argument("--gpu-power", type=float, metavar="W",
                        help="each GPU's power cap in watts (nvidia-smi -pl): the SM clock, so "
                             "the tensor-core peak, falls as the cube root of the share of the "
                             "rated power; memory bandwidth does not (docs/planner.md)")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show")
    parser.add_argument("--rank-by", choices=("time", "cost"),
                        help="time: the fastest step (train) or shortest request (serve); "
                             "cost: the fewest GPU-seconds per token, training also on fewer "
                             "of the GPUs (default: time for train, cost for serve)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="PATH", help="save a memory-breakdown picture")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan memory, time and parallel layout for training or serving",
        description="Estimate memory, compute and communication; search the best layout. "
                    "Degrees left out are searched; given ones are evaluated as given.")
    parser.add_argument("--web", action="store_true",
                        help="open a local page to choose models, GPUs and layouts and see "
                             "memory, step time and the pipeline drawn (docs/planner.md)")
    parser.add_argument("--port", type=int, default=8765, help="the page's port (--web; 0: any)")
    parser.add_argument("--no-open", action="store_true",
                        help="print the page's address without opening a browser (--web)")
    modes = parser.add_subparsers(dest="mode", metavar="MODE")
    train = modes.add_parser("train", help="plan a training run")
    _common(train)
    train.add_argument("--dp", type=int)
    train.add_argument("--cp", type=int)
    train.add_argument("--vpp", type=int, help="model chunks per pipeline rank (interleaved)")
    train.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    train.add_argument("--offload", nargs="?", const="optimizer", choices=OFFLOAD_MODES,
                       help="optimizer (the flag alone): its state in CPU memory; params: "
                            "ZeRO-3's parameter shard too; nvme: in files; none (default: "
                            "searched where a layout needs it)")
    train.add_argument("--recompute", choices=RECOMPUTE_MODES)
    train.add_argument("--partition-activations", action="store_true",
                       help="ZeRO-R: each recomputed block's input kept as this rank's 1/tp "
                            "slice, all-gathered before its rerun (--recompute full or sqrt, tp "
                            "2+, no sequence parallelism; searched layouts obey all three)")
    train.add_argument("--offload-activations", action="store_true",
                       help="ZeRO-R: each recomputed block's input kept in host memory until its "
                            "rerun (--recompute full or sqrt; searched layouts use one of them)")
    train.add_argument("--zero-bucket-size", type=int, default=0, metavar="ELEMENTS",
                       help="ZeRO-R: ZeRO-3 gathers parameters and reduce-scatters gradients "
                            "at most ELEMENTS at a time through two buffers allocated once "
                            "(--zero 3; default 0: each unit in one call)")
    train.add_argument("--contiguous-buffers", action="store_true",
                       help="ZeRO-R: the inputs full or sqrt checkpoints keep in slots of one "
                            "device buffer, ZeRO's gradient buffers in one block (--zero 1, 2 "
                            "or 3, or --recompute full or sqrt)")
    train.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                       default=None, help="default: on whenever tp > 1")
    train.add_argument("--schedule", choices=tuple(SCHEDULES))
    train.add_argument("--micro-batch", type=int)
    train.add_argument("--global-batch", type=int,
                       help="sequences per step (default: about 4M tokens)")
    train.add_argument("--seq-len", type=int, help="default: min(model context, 4096)")
    train.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8"))
    train.add_argument("--tokens", type=float, default=0.0,
                       help="token budget: adds total FLOPs, days and GPU-hours")
    train.add_argument("--stack",
                       choices=tuple(STACKS),
                       help="training software: what it overlaps and stores (docs/planner.md, "
                            "'Training stacks'); the flags below override single choices "
                            f"(default: tetrad on a profile from tetrad calibrate, else "
                            f"{DEFAULT_STACK})")
    train.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=None,
                       help="--no-flash-attention: the training code materializes the s x s "
                            "scores (Megatron before 2023): more memory and time")
    train.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                       help="the model uses dropout (GPT-3 era): masks in memory, more time")
    for name, what in (("grad-reduce", "data-parallel gradient reduction behind the backward"),
                       ("param-gather", "ZeRO parameter all-gathers behind compute"),
                       ("tp-comm", "tensor-parallel collectives chunked behind their GEMMs"),
                       ("p2p", "pipeline sends and receives behind compute")):
        train.add_argument(f"--overlap-{name}", action=argparse.BooleanOptionalAction,
                           default=None, help=f"overlap {what} (default: the stack's)")
    train.add_argument("--compile", action="store_true",
                       help="torch.compile: fused element-wise kernels, pointwise outputs "
                            "recomputed in the backward (as --recompute-ops norm,activation); "
                            "on the tetrad stack, fused kernels counted instead of eager ones")
    train.add_argument("--recompute-ops", type=_op_list, default=(), metavar="OPS",
                       help="op-level selective recomputation: element-wise ops run again in the "
                            "backward instead of stored, comma-separated from norm,activation; "
                            "with --recompute selective also the attention core (Megatron-Core's "
                            "--recompute-modules)")
    train.add_argument("--node-limited-dispatch", action="store_true",
                       help="DeepSeek-V3's expert dispatch: a token crosses the network once "
                            "per node holding its experts, at most topk_expert_groups nodes")
    serve = modes.add_parser("serve", help="plan serving (inference)")
    _common(serve)
    serve.add_argument("--dtype", default="bf16",
                       choices=("fp32", "bf16", "fp16", "fp8", "int8", "int4"),
                       help="weight format (fp8 carries 128x128 block scales)")
    serve.add_argument("--kv-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8"))
    serve.add_argument("--prompt-len", type=int, default=1024)
    serve.add_argument("--output-len", type=int, default=256)
    serve.add_argument("--context-len", type=int,
                       help="longest sequence the KV cache holds (default prompt + output)")
    serve.add_argument("--batch", type=int, default=0,
                       help="concurrent sequences per replica (default: as many as fit, <= 256)")
    serve.add_argument("--request-rate", type=float, default=0.0, metavar="R",
                       help="requests per second arriving at the server, instead of --batch: "
                            "continuous batching's steady state (running batch, TTFT, TPOT)")
    serve.add_argument("--gpu-memory-utilization", type=float,
                       default=DEFAULT_GPU_MEMORY_UTILIZATION,
                       help="share of each GPU's memory the server may use (vLLM's flag; "
                            "default %(default)s)")
    serve.add_argument("--stack", choices=SERVING_STACKS, default=DEFAULT_SERVING_STACK,
                       help="serving software generation: vllm-0.5 waits on the host each step "
                            "(vLLM before v0.6.0, 2024-09; docs/planner.md, 'Serving stacks'); "
                            "default %(default)s")
    parser.set_defaults(run=run)


def _op_list(text: str) -> tuple[str, ...]:
    return tuple(op.strip() for op in text.split(",") if op.strip())


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts must be counts: 0 or a negative value is refused, never read as "unset"; and every
    number is bounded (tetrad.planner.limits) before any search, so none can make it run long or
    come back out as NaN."""
    from tetrad.hardware.catalog import MAX_GPUS
    from tetrad.planner.limits import (MAX_GLOBAL_BATCH, MAX_NIC_GBPS, MAX_PRICE_PER_GPU_HOUR,
                                       MAX_SEQ_LEN, MAX_TOKENS, MIN_NIC_GBPS, check_count,
                                       check_number)

    cluster = (MAX_GPUS, "the largest cluster the planner is meant for")
    batch = (MAX_GLOBAL_BATCH, "8,000 times the largest published batch (Llama 3's 2,048)")
    tokens = (MAX_SEQ_LEN, "above the longest published context (10M tokens)")
    bounds = {name: cluster for name in ("num_gpus", "gpus_per_node", "tp", "pp", "ep", "dp",
                                         "cp", "vpp", "top")}
    if args.mode == "train":
        bounds.update(micro_batch=batch, global_batch=batch, seq_len=tokens)
        check_number("--tokens", args.tokens, 0, MAX_TOKENS,
                     "25,000 times Llama 3's 15.6e12 training tokens")
    else:
        bounds.update(prompt_len=tokens, context_len=tokens)
        # ServeWorkload says what their low ends mean (0: no output; as many as fit).
        check_count("--output-len", args.output_len, *tokens, at_least=None)
        check_count("--batch", args.batch, *batch, at_least=None)
        check_number("--request-rate", args.request_rate, 0, MAX_GLOBAL_BATCH,
                     "as many requests a second as the most sequences a batch may hold")
    for name, (at_most, why) in bounds.items():
        if name in vars(args):
            check_count(f"--{name.replace('_', '-')}", getattr(args, name), at_most, why)
    check_number("--nic-gbps", args.nic_gbps, MIN_NIC_GBPS, MAX_NIC_GBPS,
                 "60 times the fastest NIC (1.6 Tb/s)")
    check_number("--price-per-gpu-hour", args.price_per_gpu_hour, 0, MAX_PRICE_PER_GPU_HOUR,
                 "a hundred times the dearest on-demand GPU-hour", low_allowed=False)


def run(args: argparse.Namespace) -> int:
    from tetrad.errors import ConfigError

    if args.web:
        from tetrad.planner_web.server import serve_page

        return serve_page(args.port, not args.no_open, _page_plan,
                          _choices(_page_parser())["plan"])
    if args.mode is None:
        raise ConfigError("say what to plan: tetrad plan train|serve ..., or tetrad plan --web")
    config, world = _resolve(args)
    if args.mode == "train":
        return _train(args, config, world)
    return _serve(args, config, world)


def _resolve(args: argparse.Namespace):
    from tetrad.hardware.profile import cluster
    from tetrad.spec.presets import resolve_model

    _check_numbers(args)
    if args.png:
        from tetrad.viz.save import check_picture_path

        check_picture_path(args.png)
    config = resolve_model(args.model)
    world = cluster(args.gpu, args.num_gpus, args.gpus_per_node, args.nic_gbps)
    if args.price_per_gpu_hour is not None:
        world = world.replace(gpu=dataclasses.replace(world.gpu,
                                                      price_per_hour=args.price_per_gpu_hour))
    if args.gpu_power is not None:
        from tetrad.hardware.power import power_capped

        world = world.replace(gpu=power_capped(world.gpu, args.gpu_power))
    return config, world


def _page_parser() -> argparse.ArgumentParser:
    """`tetrad plan`'s parser for the page (--web), raising its errors for the page to show."""
    from tetrad.errors import ConfigError

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise ConfigError(message)

    parser = Parser(prog="tetrad")
    add_parser(parser.add_subparsers())
    return parser


def _choices(parser: argparse.ArgumentParser) -> dict:
    """Each option with fixed choices, subcommands nested by name, so that the page offers
    what the terminal takes (argparse keeps its actions in `_actions`)."""
    out: dict = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({name: _choices(sub) for name, sub in action.choices.items()})
        elif action.choices:
            out[action.dest] = list(action.choices)
    return out


def _page_plan(argv: list[str]):
    """The page's request as `tetrad plan` flags: the same parser, checks and search."""
    from tetrad.planner_web.api import Planned

    args = _page_parser().parse_args(["plan", *argv])
    config, world = _resolve(args)
    if args.mode == "train":
        return Planned(args.mode, config, world, *_train_plan(args, config, world), args.tokens)
    return Planned(args.mode, config, world, *_serve_plan(args, config, world))


def _train_plan(args, config, world):
    from tetrad.planner import TrainSpace, TrainWorkload, plan_training
    from tetrad.planner.report import default_global_batch
    from tetrad.planner.stacks import compile_fields, stack_fields

    seq_len = args.seq_len if args.seq_len is not None else min(config.max_seq_len, 4096)
    global_batch = (args.global_batch if args.global_batch is not None
                    else default_global_batch(seq_len))
    # A profile of eager PyTorch on this machine times tetrad's own runtime by default.
    eager = world.gpu.efficiency.op_forward_s > 0
    stack = args.stack or ("tetrad" if eager else DEFAULT_STACK)
    compiled = compile_fields(stack) if args.compile else {}
    ops = tuple(sorted(set(args.recompute_ops) | set(compiled.pop("recompute_ops", ()))))
    workload = TrainWorkload(seq_len=seq_len, dtype=args.dtype,
                             node_limited_dispatch=args.node_limited_dispatch,
                             recompute_ops=ops, **stack_fields(
        stack, flash_attention=args.flash_attention, dropout=args.dropout,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, overlap_tp_comm=args.overlap_tp_comm,
        overlap_p2p=args.overlap_p2p, **compiled))
    space = TrainSpace(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                       vpp=args.vpp, zero=args.zero, offload_mode=args.offload,
                       recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                       schedule=args.schedule,
                       micro_batch=args.micro_batch,
                       zero_bucket_size=args.zero_bucket_size,
                       contiguous_buffers=args.contiguous_buffers,
                       partition_activations=args.partition_activations,
                       offload_activations=args.offload_activations)
    check_zero_r(space, stack, workload.runtime)
    return workload, global_batch, plan_training(config, world, workload, global_batch, space,
                                                 args.top, args.rank_by or "time")


def _train(args, config, world) -> int:
    from tetrad.planner.report import training_fit_advice, training_json, training_text

    workload, global_batch, result = _train_plan(args, config, world)
    if args.json:
        print(json.dumps(training_json(config, world, workload, global_batch, result,
                                       args.tokens), indent=2, allow_nan=False))
    else:
        print(training_text(config, world, workload, global_batch, result, args.tokens))
        if not result.num_fitting:
            print()
            print(training_fit_advice(config, world, workload, result.ranked[0]))
    if args.png:
        from tetrad.viz.memory import save_memory_breakdown

        save_memory_breakdown(args.png, [(_label(e.layout.to_dict()), e.memory.as_dict(),
                                          e.usable_memory) for e in result.ranked],
                              f"{config.name} on {world.num_gpus} x {world.gpu.name}")
    return 0 if result.num_fitting else 1


def _serve_plan(args, config, world):
    from tetrad.planner import ServeSpace, ServeWorkload, plan_serving
    from tetrad.planner.stacks import serving_host_step_s

    workload = ServeWorkload(context_len=args.context_len or args.prompt_len + args.output_len,
                             prompt_len=args.prompt_len, output_len=args.output_len,
                             weight_dtype=args.dtype, kv_dtype=args.kv_dtype, batch=args.batch,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             host_step_s=serving_host_step_s(args.stack),
                             request_rate=args.request_rate)
    return workload, None, plan_serving(config, world, workload,
                                        ServeSpace(args.tp, args.pp, args.ep), args.top,
                                        args.rank_by or "cost")


def _serve(args, config, world) -> int:
    from tetrad.planner.report import serving_fit_advice, serving_json, serving_text

    workload, _, result = _serve_plan(args, config, world)
    if args.json:
        print(json.dumps(serving_json(config, world, workload, result), indent=2,
                         allow_nan=False))
    else:
        print(serving_text(config, world, workload, result))
        if not result.num_fitting:
            print()
            print(serving_fit_advice(config, world, result.ranked[0], workload))
    if args.png:
        from tetrad.viz.memory import save_memory_breakdown

        bars = [(_label(e.layout.to_dict()),
                 {"params": e.weights, "activations": e.activations, "kv_cache": e.kv_cache},
                 e.usable_memory) for e in result.ranked]
        save_memory_breakdown(args.png, bars, f"{config.name} serving on {world.num_gpus} x "
                                              f"{world.gpu.name}")
    return 0 if result.num_fitting else 1


def _label(parallel: dict) -> str:
    """A short layout name for the picture, e.g. 'tp8 pp2 dp4 zero1 full 1f1b mb1'."""
    parts = [f"{key}{parallel[key]}" for key in ("tp", "pp", "dp", "cp", "ep", "zero")
             if key in parallel and (parallel[key] != 1 or key in ("tp", "pp", "dp"))]
    if "recompute" in parallel:
        parts.append(f"rc-{parallel['recompute']}")
    if "schedule" in parallel and parallel["pp"] > 1:
        parts.append(parallel["schedule"] + (f"/v{parallel['vpp']}" if parallel["vpp"] > 1
                                             else ""))
    if "micro_batch" in parallel:
        parts.append(f"mb{parallel['micro_batch']}")
    return " ".join(parts)
