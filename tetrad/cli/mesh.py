"""`tetrad mesh`: print the rank grid and every process group of a layout, without starting any
process (the grid is plain arithmetic, tetrad.spec.layout.ParallelConfig)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "mesh", help="print the process groups of a parallel layout", description=__doc__)
    for axis, meaning in (("dp", "data"), ("pp", "pipeline"), ("cp", "context"),
                          ("tp", "tensor"), ("ep", "expert (folded over dp x cp)")):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{meaning}-parallel degree")
    parser.set_defaults(run=run)


# Every rank is printed once per kind of group: 4,096 ranks already make 120 kB of lines.
MAX_RANKS = 4096


def run(args: argparse.Namespace) -> int:
    from tetrad.spec.model import ParallelConfig
    from tetrad.errors import ConfigError
    from tetrad.planner.limits import check_count

    why = "the most ranks a printed grid shows (tetrad plan takes larger clusters)"
    for axis in ("dp", "pp", "cp", "tp", "ep"):
        check_count(f"--{axis}", getattr(args, axis), MAX_RANKS, why)
    world = args.dp * args.pp * args.cp * args.tp
    if world > MAX_RANKS:
        raise ConfigError(f"dp x pp x cp x tp = {world:,} ranks is more than {MAX_RANKS:,}, {why}")
    dims = ParallelConfig(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep)
    print(dims.describe())
    return 0
