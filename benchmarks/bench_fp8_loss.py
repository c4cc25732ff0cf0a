"""FP8 training against bf16: the loss curves of the same run (`small` preset, same seed, same data
order) under `--dtype bf16` and `--dtype fp8`, and how far apart they are.

    .venv/bin/python benchmarks/bench_fp8_loss.py [--steps 300] [--batch-size 16] [--seq-len 128]
        [--fp8-recipe block|tensor]

The two runs go in two processes at once (one thread each), so load from other processes hits
both alike. Printed: the relative difference |fp8 - bf16| / bf16 of the losses smoothed by a
trailing mean of --window steps, its maximum and mean over the run, the raw final losses and the
validation losses. Issue 14's goal: within 2%. The curves go to runs/fp8_loss/ (JSON, and a PNG
when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

OUT = Path("runs/fp8_loss")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8-recipe", default="block", choices=("block", "tensor"),
                        help="the scaling of the fp8 run (docs/fp8.md)")
    parser.add_argument("--window", type=int, default=10, help="steps in the smoothing mean")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also train in fp32 and print how far bf16 itself is from it: "
                             "the spread any change of rounding gives this run")
    return parser.parse_args()


def run(dtype: str, args: argparse.Namespace) -> dict:
    import torch

    from tetrad.spec.model import TrainConfig
    from tetrad.train.trainer import train

    torch.set_num_threads(1)
    config = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size,
                         seq_len=args.seq_len, seed=args.seed, dtype=dtype, sample_tokens=0,
                         fp8_recipe=args.fp8_recipe if dtype == "fp8" else "block")
    report = train(config).report  # its progress bar on stderr
    return {"loss": [step["loss"] for step in report["steps"]],
            "time_s": sum(step["time_s"] for step in report["steps"]),
            "validation_loss": report["validation_loss"]}


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean of up to `window` values."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
            for i in range(len(values))]


def plot(curves: dict[str, dict], window: int, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(7, 4))
    for dtype, curve in curves.items():
        axis.plot(smoothed(curve["loss"], window), label=f"--dtype {dtype}")
    axis.set(xlabel="step", ylabel=f"loss (mean of {window} steps)")
    axis.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return True


def main() -> None:
    args = parse_args()
    dtypes = ("bf16", "fp8") + (("fp32",) if args.fp32_reference else ())
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(dtypes), mp_context=context) as pool:
        futures = {dtype: pool.submit(run, dtype, args) for dtype in dtypes}
        curves = {dtype: future.result() for dtype, future in futures.items()}
    print(f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len} tokens, "
          f"seed {args.seed}, fp8 recipe {args.fp8_recipe}")
    for dtype, curve in curves.items():
        print(f"  {dtype:5s} loss {curve['loss'][0]:.4f} -> {curve['loss'][-1]:.4f}  "
              f"validation {curve['validation_loss']:.4f}  ({curve['time_s']:.0f} s of steps)")
    bf16 = smoothed(curves["bf16"]["loss"], args.window)
    for dtype in dtypes[1:]:
        other = smoothed(curves[dtype]["loss"], args.window)
        relative = [abs(a - b) / b for a, b in zip(other, bf16)]
        verdict = ("within" if max(relative) <= 0.02 else "NOT within") + " the 2% goal"
        print(f"  |{dtype} - bf16| / bf16 of the {args.window}-step mean loss: "
              f"max {max(relative):.2%} (step {relative.index(max(relative)) + 1}), "
              f"mean {sum(relative) / len(relative):.2%}"
              + (f"; {verdict}" if dtype == "fp8" else " (reference)"))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "curves.json").write_text(json.dumps({"args": vars(args), **curves}))
    if plot(curves, args.window, OUT / "curves.png"):
        print(f"  curves: {OUT / 'curves.png'}")


if __name__ == "__main__":
    main()
