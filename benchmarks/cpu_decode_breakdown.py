"""Where one request's CPU decode step goes: the whole `LLM.step()`, the fused step inside it
(tetrad/inference/worker/cpu_decode.py) and its one `decode_model` call (embedding, rotary angles,
every layer, final norm and output head in C++), in ms per step, on cpu_vs_llamacpp.py's 32m
Llama (random weights, 8k vocabulary).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/cpu_decode_breakdown.py [--dtypes fp32 bf16 int8 int4]
        [--steps 200] [--threads 2] [--folder DIR]

One request, a 32-token prompt, then --steps greedy decode steps timed one after another (wall
clock; "cpu / wall" says how many threads worked). The op is timed by wrapping torch.ops.tetrad
as cpu_decode.py sees it: the fused step's time outside it is the step's tensors built from its
plan; outside the fused step, the runner, sampler and scheduler. Each dtype runs in a process of
its own (--dtype, what the parent runs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_vs_llamacpp_sides import TETRAD_SETTINGS, _tetrad_engine, prompt_ids

PROMPT = 32


class _TimedOps:
    """torch.ops.tetrad with decode_model timed into `totals`."""

    def __init__(self, ops, totals: dict[str, float]):
        self._ops, self._totals = ops, totals

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        if name != "decode_model":
            return op

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = op(*args, **kwargs)
            self._totals["model"] += time.perf_counter() - started
            return result
        return timed


class _TimedTorch:
    """The torch module, its torch.ops.tetrad timed (_TimedOps)."""

    def __init__(self, torch, totals: dict[str, float]):
        self._torch = torch
        self.ops = type("Ops", (), {"tetrad": _TimedOps(torch.ops.tetrad, totals)})()

    def __getattr__(self, name):
        return getattr(self._torch, name)


def measure(folder: str, dtype: str, steps: int, threads: int) -> str:
    import torch

    from tetrad.inference.core.params import SamplingParams
    from tetrad.inference.worker import cpu_decode

    llm = _tetrad_engine(argparse.Namespace(folder=folder, dtype=dtype, threads=threads,
                                            eager=False, requests=1, prompt=PROMPT,
                                            tokens=steps + 2))
    totals = {"fused": 0.0, "model": 0.0}
    run = cpu_decode.FusedCpuDecode.run

    def timed_run(self, *args):
        started = time.perf_counter()
        result = run(self, *args)
        totals["fused"] += time.perf_counter() - started
        return result

    cpu_decode.FusedCpuDecode.run = timed_run
    cpu_decode.torch = _TimedTorch(torch, totals)  # cpu_decode reads torch through its global
    greedy = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    llm.add_request(prompt_ids(PROMPT), greedy)
    llm.step()  # the prefill
    llm.step()
    totals.update(dict.fromkeys(totals, 0.0))
    count, started, cpu_started = 0, time.perf_counter(), time.process_time()
    while llm.has_unfinished():
        llm.step()
        count += 1
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    per = {key: 1e3 * value / count for key, value in totals.items()}
    return (f"| {dtype} | {1e3 * wall / count:.2f} | {cpu / wall:.2f} | {per['fused']:.2f} | "
            f"{per['model']:.2f} | {count / wall:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(TETRAD_SETTINGS),
                        choices=tuple(TETRAD_SETTINGS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--folder", help="the 32m model's HF folder (else exported here)")
    parser.add_argument("--dtype", choices=tuple(TETRAD_SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype:
        print(measure(args.folder, args.dtype, args.steps, args.threads))
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or scratch
        if not (Path(folder) / "config.json").exists():
            from cpu_vs_llamacpp import export
            export(argparse.Namespace(shape="32m", convert=None), Path(folder))
        print(f"32m Llama, one request, {args.steps} decode steps, {args.threads} threads; "
              f"load average {os.getloadavg()[0]:.1f}")
        print("| dtype | ms per step | cpu / wall | fused step ms | decode_model ms | tokens/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for dtype in args.dtypes:
            result = subprocess.run(
                [sys.executable, __file__, "--dtype", dtype, "--folder", folder, "--steps",
                 str(args.steps), "--threads", str(args.threads)], capture_output=True,
                text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if result.returncode:
                raise RuntimeError(result.stderr[-3000:])
            print(result.stdout.strip().splitlines()[-1], flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
