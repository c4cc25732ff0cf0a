"""Checkpoint save and load time of tetrad's sharded checkpoints (safetensors pieces + index)
against torch.distributed.checkpoint (DCP) of FSDP2, on the same model and the same ranks.

    .venv/bin/python benchmarks/bench_checkpoint.py [--nproc 4] [--model small] [--repeats 3]
        [--hidden H --layers L --ffn F --vocab V]

tetrad: a ZeRO-3 run over dp = nproc, stepped once so that AdamW moments exist, saved the way
the trainer saves (trainer.save: checkpoint_state + save_checkpoint), then loaded the way it
resumes (load_checkpoint + load_state_dict) into a fresh ZeRO-3 dp = nproc (same layout), a
DDP dp = nproc and a ZeRO-3 tp = 2 x dp = nproc / 2. torch: fully_shard per layer and at the
root, one AdamW step, dcp.save of get_model_state_dict / get_optimizer_state_dict, dcp.load +
set_state_dict into a fresh FSDP2 model and into a DDP one (DCP reshards to plain tensors).

Each timing runs between barriers (so it is the slowest rank's), into a fresh folder per repeat;
tetrad and torch alternate repeat by repeat so that a shared machine's load hits both alike. The
median over --repeats is printed. Loads read files the save just wrote, from the page cache.
A first, untimed round checks that every load reproduces the saved parameters and moments.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import build_mesh
from tetrad.spec.presets import resolve_model
from tetrad.sharded_tensors import assemble
from tetrad.train import checkpoint as ckpt
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.strategy import build_strategy
from tetrad.train.trainer import save

OVERRIDES = {"hidden": "hidden_size", "layers": "num_layers", "ffn": "ffn_hidden_size",
             "vocab": "vocab_size"}
COLUMNS = ("save", "load same", "load DDP", "load tp2")


def model_overrides(args: argparse.Namespace) -> dict:
    return {field: getattr(args, option) for option, field in OVERRIDES.items()
            if getattr(args, option) is not None}


def batch_of(model_config, rank: int) -> torch.Tensor:
    """A few tokens per rank: the step only has to create the AdamW moments."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(0, model_config.vocab_size, (1, 17), generator=generator)


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def tetrad_strategy(args, model_config, dims: ParallelConfig, zero: int, seed: int):
    config = TrainConfig(model=args.model, model_overrides=model_overrides(args),
                         parallel=ParallelConfig(dp=dims.dp, tp=dims.tp, zero=zero))
    mesh = build_mesh(dims, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(seed)  # targets start from other weights, so a load that did nothing fails
    strategy = build_strategy(Transformer(model_config), config, torch.device("cpu"), mesh,
                              Comm(CommCounter()))
    return strategy, config


def torch_model(model_config, kind: str, seed: int):
    torch.manual_seed(seed)
    model = Transformer(model_config)
    if kind == "FSDP2":
        for layer in model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    defaults = TrainConfig()  # the same AdamW hyper-parameters as tetrad's strategies
    optimizer = build_optimizer(parameter_groups(model, defaults.weight_decay), defaults)
    return model, optimizer


def dcp_save(model, optimizer, path: Path) -> None:
    dcp.save({"model": get_model_state_dict(model),
              "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def dcp_load(model, optimizer, path: Path) -> None:
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def tetrad_load(strategy, folder: Path, model_config) -> None:
    strategy.load_state_dict(ckpt.load_checkpoint(folder, model_config)[1])


def timed(action) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    dist.barrier()  # the slowest rank's time, on every rank
    return time.perf_counter() - started


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def tetrad_whole_state(strategy) -> dict:
    """Every rank's pieces of parameters and moments, assembled on rank 0 (what its next save
    holds); the other ranks get {}: one copy of the whole state fits where four may not."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(strategy.checkpoint_state()[0], gathered)
    by_key: dict[tuple[str, str], list] = {}
    for rank_pieces in gathered or []:
        for piece in rank_pieces:
            by_key.setdefault((piece.kind, piece.name), []).append(piece)
    return {key: assemble(pieces) for key, pieces in by_key.items()}


def torch_whole_state(model, optimizer) -> dict:
    """Parameters and AdamW state as whole tensors by path, on rank 0 ({} on the others)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=full)
    state = {"model": get_model_state_dict(model, options=full),
             "optimizer": optimizer_state.get("state", {})}

    def flat(value, path: str) -> dict:
        if isinstance(value, dict):
            return {inner: tensor for key, item in value.items()
                    for inner, tensor in flat(item, f"{path}/{key}").items()}
        return {path: value}
    return flat(state, "")


def same_tensors(expected: dict, actual: dict) -> bool:
    return expected.keys() == actual.keys() and all(
        torch.equal(expected[key], actual[key]) for key in expected)


def worker(rank: int, world_size: int, args: argparse.Namespace, scratch: str) -> dict:
    torch.set_num_threads(args.threads)
    model_config = resolve_model(args.model, model_overrides(args))
    dp = ParallelConfig(dp=world_size)
    source, config = tetrad_strategy(args, model_config, dp, 3, seed=0)
    targets = {"load same": tetrad_strategy(args, model_config, dp, 3, seed=1)[0],
               "load DDP": tetrad_strategy(args, model_config, dp, 0, seed=1)[0]}
    if world_size % 2 == 0:
        tp2 = ParallelConfig(dp=world_size // 2, tp=2)
        targets["load tp2"] = tetrad_strategy(args, model_config, tp2, 3, seed=1)[0]
    loss = next_token_loss(source.model, batch_of(model_config, rank))
    source.backward(loss, is_last_microbatch=True)
    source.finish_gradients()
    source.step(1e-3)

    fsdp, fsdp_optimizer = torch_model(model_config, "FSDP2", seed=0)
    next_token_loss(fsdp, batch_of(model_config, rank)).backward()
    fsdp_optimizer.step()
    torch_targets = {"load same": torch_model(model_config, "FSDP2", seed=1),
                     "load DDP": torch_model(model_config, "DDP", seed=1)}

    times = {engine: {column: [] for column in COLUMNS} for engine in ("tetrad", "torch")}
    sizes = {}
    for repeat in range(args.repeats + 1):  # the first round checks, warms up, is not counted
        root = Path(scratch) / f"tetrad-{repeat}"
        took = {"save": timed(partial(save, source, dataclasses.replace(
            config, checkpoint_dir=str(root)), model_config, None, 1))}
        folder = ckpt.find_checkpoint(root)
        for column, target in targets.items():
            took[column] = timed(partial(tetrad_load, target, folder, model_config))
        if repeat == 0:
            saved = tetrad_whole_state(source)
            for column, target in targets.items():
                assert same_tensors(saved, tetrad_whole_state(target)), f"tetrad {column}"
            sizes["tetrad"] = folder_bytes(folder)
        else:
            for column, seconds in took.items():
                times["tetrad"][column].append(seconds)

        path = Path(scratch) / f"torch-{repeat}"
        took = {"save": timed(partial(dcp_save, fsdp, fsdp_optimizer, path))}
        for column, (model, optimizer) in torch_targets.items():
            took[column] = timed(partial(dcp_load, model, optimizer, path))
        if repeat == 0:
            saved = torch_whole_state(fsdp, fsdp_optimizer)
            for column, target in torch_targets.items():
                assert same_tensors(saved, torch_whole_state(*target)), f"torch {column}"
            sizes["torch"] = folder_bytes(path)
        else:
            for column, seconds in took.items():
                times["torch"][column].append(seconds)
        dist.barrier()
        if rank == 0:  # only a few checkpoints on disk at a time
            shutil.rmtree(root)
            shutil.rmtree(path)
    whole_model = torch_targets["load DDP"][0]
    return {"times": {engine: {column: statistics.median(values)
                               for column, values in columns.items() if values}
                      for engine, columns in times.items()},
            "sizes": sizes, "params": sum(p.numel() for p in whole_model.parameters())}


def cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="small")
    for option, field in OVERRIDES.items():
        parser.add_argument(f"--{option}", type=int, help=f"override the model's {field}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dir", help="where the checkpoints go (default: the temp folder)")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint-", dir=args.dir) as scratch:
        result = spawn(worker, args.nproc, (args, scratch))[0]
    tetrad, native = result["times"]["tetrad"], result["times"]["torch"]
    megabytes = {engine: size / 1e6 for engine, size in result["sizes"].items()}
    shape = ", ".join(f"{field} {value}" for field, value in model_overrides(args).items())
    print(f"{args.model}{f' ({shape})' if shape else ''}, {result['params'] / 1e6:.2f}M "
          f"parameters, {args.nproc} ranks x {args.threads} thread(s), gloo, median of "
          f"{args.repeats} (slowest rank), {time.perf_counter() - started:.0f} s in all\n")
    print(f"| engine | save s | load s (same layout) | load s (DDP dp={args.nproc}) | "
          f"load s (ZeRO-3 tp=2 dp={args.nproc // 2}) | MB on disk |")
    print("|---|---|---|---|---|---|")
    for engine, label in (("tetrad", f"tetrad ZeRO-3 dp={args.nproc}"),
                          ("torch", "torch FSDP2 + DCP")):
        cells = [cell(result["times"][engine].get(column)) for column in COLUMNS]
        print(f"| {label} | {' | '.join(cells)} | {megabytes[engine]:.1f} |")
    ratios = [f"{tetrad[column] / native[column]:.2f}" if column in native and column in tetrad
              else "-" for column in COLUMNS]
    print(f"| ratio tetrad ÷ torch | {' | '.join(ratios)} | "
          f"{megabytes['tetrad'] / megabytes['torch']:.2f} |")


if __name__ == "__main__":
    main()
