"""`tetrad schedule`: print (or draw) a pipeline schedule's simulated timeline."""

from __future__ import annotations

import argparse

from tetrad.schedules import SCHEDULES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "schedule", help="show a pipeline schedule's timeline, bubble and in-flight peaks",
        description="Simulate a pipeline schedule with forward = 1 time unit and print its "
                    "timeline (one row per rank, one column per time unit), bubble fraction and "
                    "peak in-flight microbatches per rank.")
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--vpp", type=int, default=1,
                        help="model chunks per rank (interleaved only)")
    parser.add_argument("--fb-ratio", type=float, default=2.0,
                        help="backward time / forward time; zb splits it evenly into B and W")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline to this PNG")
    parser.add_argument("--json", action="store_true",
                        help="print actions, timeline, bubble and peaks as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from tetrad.errors import ConfigError
    from tetrad.schedules import Durations, build_schedule, render, simulate, validate

    if args.fb_ratio <= 0:
        raise ConfigError(f"--fb-ratio is backward time / forward time and must be > 0, "
                          f"got {args.fb_ratio}")
    schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.vpp)
    validate(schedule)
    timeline = simulate(schedule, Durations(forward=1.0, backward=args.fb_ratio))
    if args.png:
        from tetrad.viz.pipeline import draw_pipeline

        draw_pipeline(timeline, args.png)
    print(json.dumps(timeline.to_dict()) if args.json else render(timeline))
    return 0
