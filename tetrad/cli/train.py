"""`tetrad train`: flags map one to one onto TrainConfig / ParallelConfig fields; a TOML
`--config` supplies the rest, and flags the user typed win over it."""

from __future__ import annotations

import argparse

from tetrad.spec.layout import OFFLOAD_MODES, RECOMPUTE_MODES
from tetrad.spec.model import DEVICES, DTYPES, FP8_RECIPES
from tetrad.schedules import SCHEDULES

TRAIN_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "preset name (tiny, small, tiny-moe), HF folder, config.json or TOML"),
    ("--data", str, "text file, folder of .txt files or .jsonl with a 'text' field "
                    "(default: the bundled Shakespeare plays)"),
    ("--tokenizer", str, "'byte' (default) or a tokenizer.json (see `tetrad tokenizer train`)"),
    ("--steps", int, "optimizer steps"),
    ("--seed", int, "seed for initialization and data order"),
    ("--batch-size", int, "global batch, in sequences, per optimizer step"),
    ("--seq-len", int, "tokens per sequence"),
    ("--lr", float, "peak learning rate (linear warm-up, then cosine decay)"),
    ("--warmup-steps", int, "warm-up steps"),
    ("--weight-decay", float, "AdamW weight decay on matrices"),
    ("--grad-clip", float, "clip the global gradient norm to this (0: no clipping)"),
    ("--grad-accum", int, "microbatches per optimizer step (gradient accumulation)"),
    ("--report", str, "write the run report JSON here"),
    ("--hardware", str, "hardware profile (tetrad calibrate --out) or catalog GPU the report's "
                        "predicted step time is for (default: this machine's cached profile, "
                        "if any; on a GPU the catalog's entry)"),
    ("--checkpoint-dir", str, "folder for checkpoints (the final state is always saved here)"),
    ("--save-every", int, "also save every N steps"),
    ("--keep", int, "keep only the N newest checkpoints (0: keep all)"),
    ("--log-every", int, "steps between progress updates"),
    ("--sample-tokens", int, "tokens of text to sample from the model at the end (0: none)"),
]


DEGREES = [
    ("--dp", "data-parallel degree"),
    ("--tp", "tensor-parallel degree (splits heads, MLP and vocabulary)"),
    ("--pp", "pipeline-parallel degree (stages of consecutive layers)"),
    ("--cp", "context-parallel degree (ring attention over sequence chunks)"),
    ("--ep", "expert-parallel degree (MoE experts over the dp*cp ranks)"),
]


def layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 3,4,4,3, got {text!r}")


def byte_count(text: str) -> int:
    """Bytes, with an optional binary unit: 800000, 512K, 1.5M, 2G."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    try:
        return int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected bytes like 800000, 512K, 1.5M or 2G, "
                                         f"got {text!r}")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a transformer", description=__doc__,
        # Unset flags stay absent, so only what the user typed overrides the TOML file.
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="TOML file of these settings (flags override it)")
    for flag, kind, help_text in TRAIN_FLAGS:
        parser.add_argument(flag, type=kind, help=help_text)
    parser.add_argument("--dtype", choices=DTYPES, help="compute precision (autocast)")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES,
                        help="scaling of --dtype fp8: block (default; DeepSeek-V3's 128x128 "
                             "weight blocks and 1x128 activation tiles) or tensor (one scale "
                             "per tensor, gradients in E5M2: docs/fp8.md)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block (regional compilation); "
                             "the compile time is reported apart from the step times")
    parser.add_argument("--device", choices=DEVICES,
                        help="auto (default): a GPU per local rank (NCCL) when there are enough, "
                             "else the CPU (gloo); cpu: the CPU beside GPUs; cuda: a GPU per "
                             "local rank or stop")
    parser.add_argument("--device-memory-cap", type=byte_count, metavar="BYTES",
                        help="refuse a run whose rank would hold more in device memory (the "
                             "planner's count), stop one that does (the counted tensors); "
                             "reported in the run report")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--save-as", metavar="NAME",
                        help="store the trained model under this name[:tag] (tetrad list, "
                             "tetrad run NAME)")
    distributed = parser.add_argument_group(
        "distributed", "N local worker processes (gloo on CPU, NCCL with a GPU per rank); the "
        "same command also runs under torchrun, one node or many")
    distributed.add_argument("--nproc", type=int,
                             help="worker processes to start on this machine (dp*pp*cp*tp; "
                                  "with --strategy ps: dp + servers)")
    for flag, help_text in DEGREES:
        distributed.add_argument(flag, type=int, help=help_text)
    distributed.add_argument("--sequence-parallel", action="store_true",
                             help="split norms and residuals along the sequence over tp too")
    distributed.add_argument("--schedule", choices=tuple(SCHEDULES), help="pipeline schedule")
    distributed.add_argument("--microbatches", type=int,
                             help="pipeline microbatches per step (default: pp)")
    distributed.add_argument("--vpp", type=int,
                             help="model chunks per pipeline rank (interleaved schedule)")
    distributed.add_argument("--stage-layers", type=layer_counts, metavar="N,N,...",
                             help="layers per pipeline stage, e.g. 3,4,4,3 (default: balanced "
                                  "by cost)")
    distributed.add_argument("--recompute", choices=RECOMPUTE_MODES,
                             help="activation recomputation")
    distributed.add_argument("--partition-activations", action="store_true", default=None,
                             help="ZeRO-R: keep each recomputed block's input as this rank's 1/tp "
                                  "slice, all-gathered before its rerun (--tp 2+, --recompute "
                                  "full or sqrt)")
    distributed.add_argument("--offload-activations", action="store_true", default=None,
                             help="ZeRO-R: keep each recomputed block's input in host memory "
                                  "until its rerun (--recompute full or sqrt)")
    distributed.add_argument("--zero-bucket-size", type=int, metavar="ELEMENTS",
                             help="ZeRO-R: ZeRO-3 gathers parameters and reduce-scatters "
                                  "gradients at most ELEMENTS at a time through two buffers "
                                  "allocated once (--zero 3; default 0: each unit in one call)")
    distributed.add_argument("--contiguous-buffers", action="store_true", default=None,
                             help="ZeRO-R: keep the inputs full or sqrt checkpoints keep in "
                                  "slots of one device buffer (a slot per checkpoint of each "
                                  "microbatch in flight), and ZeRO's gradient "
                                  "buffers in one block")
    distributed.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                             help="0: DDP; 1: shard optimizer state; 2: and gradients; "
                                  "3: and parameters (FSDP)")
    distributed.add_argument("--offload", dest="offload_mode", nargs="?", const="optimizer",
                             choices=OFFLOAD_MODES,
                             help="optimizer (the flag alone): the optimizer state and step in "
                                  "host memory (ZeRO 1-3); params: ZeRO-3's parameter and "
                                  "gradient shards too; nvme: parameter shards and optimizer "
                                  "state in files under --offload-dir")
    distributed.add_argument("--offload-dir", metavar="PATH",
                             help="--offload nvme: an existing writable folder for its files")
    distributed.add_argument("--offload-keep", action="store_true",
                             help="--offload nvme: leave its files in --offload-dir at the end")
    distributed.add_argument("--collectives", choices=("backend", "ring"),
                             help="'ring': tetrad's own ring all-reduce on send/recv")
    distributed.add_argument("--overlap", dest="overlap", action="store_true",
                             help="issue TP/SP and EP collectives in chunks behind the matmuls / "
                                  "shared experts (default: on GPUs with NCCL, off on gloo)")
    distributed.add_argument("--no-overlap", dest="overlap", action="store_false",
                             help="issue TP/SP and EP collectives whole and wait for each")
    ps = parser.add_argument_group(
        "parameter server", "--strategy ps: --dp workers push gradients to and pull parameters "
        "from --servers server processes (docs/parameter_server.md); --nproc is dp + servers")
    ps.add_argument("--strategy", choices=("collective", "ps"),
                    help="'collective' (default): all-reduce among the ranks; 'ps': parameter "
                         "servers")
    ps.add_argument("--servers", type=int, help="parameter-server processes (the last ranks)")
    ps.add_argument("--ps-mode", choices=("sync", "async", "ssp"),
                    help="sync: every step waits for every worker; async: pushes applied on "
                         "arrival; ssp: async with at most --staleness steps between workers")
    ps.add_argument("--staleness", type=int, metavar="K",
                    help="ssp: how many steps the fastest worker may run ahead of the slowest "
                         "(default 1)")
    ps.add_argument("--ps-replicas", type=int, choices=(0, 1),
                    help="1: each server's key range replicated on the next server, which takes "
                         "over when it dies (sync, --servers 2 or more; default 0)")
    ps.add_argument("--ps-spares", type=int, metavar="N",
                    help="N more worker processes that wait and take a dead worker's place in the "
                         "running job (sync: redoing the step it left unfinished; default 0)")
    ps.add_argument("--ps-join-step", type=int, metavar="K",
                    help="sync: the spares still waiting join as new workers from step K, each "
                         "step's batch then cut into one more share per worker")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.spec.model import build_train_config
    from tetrad.store.models import parse_name

    save_as = getattr(args, "save_as", None)
    if save_as is not None:
        parse_name(save_as)  # a bad name costs one line, not a run
    overrides = {key: value for key, value in vars(args).items()
                 if key not in ("command", "run", "config", "save_as")}
    config = build_train_config(getattr(args, "config", None), overrides)
    config.parallel.check_offload_dir()
    if save_as is not None:
        return train_and_store(config, save_as)

    from tetrad.train.launch import run_training

    return finish(run_training(config), config)


def train_and_store(config, name: str) -> int:
    """Train, then store the final checkpoint under `name`. Without --checkpoint-dir the run
    checkpoints into a staging folder inside the store (one filesystem, so storing hardlinks);
    the folder goes once the model is stored, and stays, named, if storing fails."""
    import dataclasses
    import shutil
    import tempfile

    from tetrad.errors import TetradError
    from tetrad.store.modelfile import Modelfile
    from tetrad.store.models import ModelStore
    from tetrad.train.launch import run_training, started_by_torchrun

    store = ModelStore()
    staging = None
    if not config.checkpoint_dir:
        if started_by_torchrun():  # each rank would stage in a folder of its own
            raise TetradError("--save-as under torchrun needs --checkpoint-dir (a folder every "
                              "rank sees)")
        store.root.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".tmp-train-", dir=store.root)
        config = dataclasses.replace(config, checkpoint_dir=staging)
    try:
        result = run_training(config)
    except BaseException:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if result is None:  # a torchrun rank other than 0: rank 0 stores
        return 0
    if result.stopped_by:  # stored once the run finishes: --resume, then it is
        return finish(result, config)
    try:
        stored = store.create(name, Modelfile(source=str(result.checkpoint)),
                              origin=f"tetrad train --model {config.model} ({config.steps} steps)")
    except (OSError, TetradError) as error:
        raise TetradError(f"the run finished, but storing it as {name} failed ({error}); its "
                          f"checkpoint is {result.checkpoint}: tetrad create {name} -f a "
                          f"Modelfile with FROM {result.checkpoint}") from None
    if staging:
        shutil.rmtree(staging)
        result.checkpoint = None
    finish(result, config)
    print(f"stored as {stored.name}: tetrad run {stored.name}")
    return 0


def finish(result, config) -> int:
    """Print what the run did (nothing on a torchrun rank other than 0: rank 0 reports); the
    exit status is 128 + the signal that stopped it early (130 Ctrl-C, 143 SIGTERM), else 0."""
    import signal
    import sys

    from tetrad.train.stop import exit_status

    if result is None:
        return 0
    steps = result.report["steps"]
    if steps:
        print(f"loss {steps[0]['loss']:.4f} (step {steps[0]['step']}) -> {steps[-1]['loss']:.4f} "
              f"(step {steps[-1]['step']})", end="")
        validation = result.report.get("validation_loss")
        print(f", validation loss {validation:.4f}" if validation is not None else "")
    if "compile_time_s" in result.report:
        print(f"compiling took {result.report['compile_time_s']:.1f} s (kept out of the step "
              f"times)")
    if result.sample:
        print("--- sample ---")
        print(result.sample.strip())
        print("--------------")
    if config.report:
        print(f"run report: {config.report}")
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    if result.stopped_by:
        done = steps[-1]["step"] if steps else "none"
        saved = f"saved in {result.checkpoint}: --resume continues" if result.checkpoint else \
            "not saved (no --checkpoint-dir)"
        print(f"stopped by {signal.Signals(result.stopped_by).name} after step {done}; the run "
              f"is {saved}", file=sys.stderr)
        return exit_status(result.stopped_by)
    return 0
