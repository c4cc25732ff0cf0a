"""`tetrad calibrate`: microbenchmarks of this machine -> a hardware profile for plan and train."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine and write a hardware profile",
        description="Time matmuls across shapes, attention, streaming element-wise work, the "
                    "optimizer step, eager PyTorch's per-operator costs, and every collective "
                    "by group size (gloo on CPU, NCCL with a GPU per rank), and write them as a "
                    "hardware profile: `tetrad plan --gpu PROFILE.json` and `tetrad train "
                    "--hardware PROFILE.json` predict step times with it.")
    parser.add_argument("--out", metavar="PROFILE.json",
                        help="where to write the profile (default: this machine's cached "
                             "profile, which tetrad train reads when no --hardware is given)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="what to measure (cuda: NCCL collectives need more than one GPU; "
                             "one GPU measures compute and memory only)")
    parser.add_argument("--nproc", type=int,
                        help="ranks for the collectives (default: 8 on CPU, every GPU on cuda; "
                             "1: none)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions per measurement and one round of the collectives "
                             "(3 by default): a rougher profile in less time")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from tetrad.errors import ConfigError
    from tetrad.hardware.profile import save_profile

    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or out.suffix != ".json"):
        raise ConfigError(f"--out {args.out}: give a file name ending in .json")
    if args.nproc is not None and not 1 <= args.nproc <= 64:
        raise ConfigError(f"--nproc must be between 1 and 64, got {args.nproc}")

    from tetrad.calibrate import calibrate, default_profile_path
    from tetrad.calibrate.collectives import ROUNDS

    started = time.perf_counter()
    profile = calibrate(args.device, args.nproc or 0, budget_s=0.01 if args.quick else 0.05,
                        rounds=1 if args.quick else ROUNDS)
    out = out or default_profile_path()
    save_profile(profile, out)
    efficiency = profile.efficiency
    print(f"{profile.name}: matmul {profile.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32 at best, "
          f"memory {profile.memory_bandwidth / 1e9:.1f} GB/s, eager operator "
          f"{efficiency.op_forward_s * 1e6:.1f} us forward / {efficiency.op_backward_s * 1e6:.1f}"
          f" us backward, {len(efficiency.collectives)} collective fits "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"profile: {out}")
    return 0
