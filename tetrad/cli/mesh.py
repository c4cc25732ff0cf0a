"""`tetrad mesh`: print the rank grid and every process group of a layout, without starting any
process (the grid is plain arithmetic, tetrad.parallel_config.ParallelConfig)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "mesh", help="print the process groups of a parallel layout", description=__doc__)
    for axis, meaning in (("dp", "data"), ("pp", "pipeline"), ("cp", "context"),
                          ("tp", "tensor"), ("ep", "expert (folded over dp x cp)")):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{meaning}-parallel degree")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.config import ParallelConfig

    dims = ParallelConfig(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep)
    print(dims.describe())
    return 0
