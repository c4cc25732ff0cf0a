"""`tetrad report`: a run report's prediction next to its measurement, per rank."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="compare a run report's predicted and measured memory and traffic",
        description="Print, per kind of rank, the planner's predicted bytes (params, grads, "
                    "optimizer, activations) and bytes sent per collective kind next to the "
                    "measured ones with their relative error, the pipeline's idle fraction, the "
                    "step time and the loss.")
    parser.add_argument("report", metavar="RUN.json", help="a run report (tetrad train --report)")
    parser.add_argument("--png", metavar="PATH",
                        help="also draw the loss curve and the predicted vs measured memory")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.viz.report import draw_report, format_report, load_report

    if args.png:
        from tetrad.viz.save import check_picture_path

        check_picture_path(args.png)
    report = load_report(args.report)
    print(format_report(report))
    if args.png:
        draw_report(report, args.png)
        print(f"figure: {args.png}")
    return 0
