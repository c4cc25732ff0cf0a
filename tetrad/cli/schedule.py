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
                        help="model chunks per rank (interleaved: 2 or more; zbv and dualpipe: "
                             "2, placed in a V)")
    parser.add_argument("--fb-ratio", type=float, default=2.0,
                        help="backward time / forward time; zb, zbv and dualpipe split it evenly "
                             "into B and W")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline to this PNG")
    parser.add_argument("--json", action="store_true",
                        help="print actions, timeline, bubble and peaks as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from tetrad.schedules import Durations, build_schedule, render, simulate, validate

    if args.png:
        from tetrad.viz.save import check_picture_path

        check_picture_path(args.png)
    _check_numbers(args)
    schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.vpp)
    validate(schedule)
    timeline = simulate(schedule, Durations(forward=1.0, backward=args.fb_ratio))
    if args.png:
        from tetrad.viz.pipeline import draw_pipeline

        draw_pipeline(timeline, args.png)
    print(json.dumps(timeline.to_dict(), allow_nan=False) if args.json else render(timeline))
    return 0


# One character per time unit and one row per rank: past 4,096 stage-microbatches (pp 16 with 256
# microbatches) the timeline runs off any screen and its simulation takes seconds.
MAX_STAGE_MICROBATCHES = 4096
# Backward over forward is 2 for a transformer (1 to 3 with recomputation or fused kernels); a
# ratio 16 times off either way is a typo, and it stretches the timeline by as much.
FB_RATIO_RANGE = (1 / 16, 16.0)


def _check_numbers(args: argparse.Namespace) -> None:
    from tetrad.errors import ConfigError
    from tetrad.planner.limits import check_count, check_number

    why = "the most stage-microbatches (pp x vpp x microbatches) a timeline shows"
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches),
                        ("--vpp", args.vpp)):
        check_count(flag, value, MAX_STAGE_MICROBATCHES, why)
    total = args.pp * args.vpp * args.microbatches
    if total > MAX_STAGE_MICROBATCHES:
        raise ConfigError(f"pp x vpp x microbatches = {total:,} is more than "
                          f"{MAX_STAGE_MICROBATCHES:,}: the timeline would run off any screen; "
                          f"lower --pp or --microbatches")
    check_number("--fb-ratio", args.fb_ratio, *FB_RATIO_RANGE,
                 "backward time / forward time is 1 to 3 for a transformer")
