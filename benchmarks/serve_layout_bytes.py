"""The planner's DeepSeek serving answer, run on local ranks (issue 16 item 6; docs/deepseek.md).

For DeepSeek-R1 on 16 GPUs, `tetrad plan serve` ranks attention data parallelism with the
experts over all GPUs first for throughput (tp1 dp16 ep16) and splits the model by stages and
over tensor-parallel ranks for latency (tp2 pp2 dp4 ep8, tp8 pp2, tp16 ep16). This script serves
a tiny DeepSeek-V3-shaped model (configs/deepseek-v3-tiny.toml, random fp32 weights) under those
shapes on N local CPU ranks: `--dp N --ep N`, `--pp N`, `--tp 2 --pp N/2` and `--tp N --ep N`
(MLA split by heads, each tp rank keeping the whole latent cache). For
each layout it checks that greedy output equals one process, then prints every rank's weight
bytes and KV-cache bytes per token, counted on its parameters and its pool, beside the planner's
prediction for that rank (ranks.layout.planned_bytes). Counting, not timing.

    PYTHONPATH=. python benchmarks/serve_layout_bytes.py [--ranks 4] [--model TOML]
"""

from __future__ import annotations

import argparse

import torch

from tetrad.inference.engine import LLM
from tetrad.inference.ranks.layout import planned_bytes
from tetrad.spec.serving import ServeLayout
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.ranks.rank_share import held_bytes
from tetrad.inference.ranks.driver import ServingWorker
from tetrad.models.transformer import Transformer
from tetrad.parallel.launch import spawn
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250], [200], list(range(30, 60)), [1, 2, 3, 4, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ENGINE = dict(block_size=16, kv_memory="1MiB", device="cpu", dtype="fp32", log=None)


def random_model(config) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():  # weights far from init: distinct logits, no argmax near-ties
        for param in model.parameters():
            param.normal_(0, 0.15)
    return model.eval()


def degrees(layout: ServeLayout) -> dict:
    return dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.dp)


def rank_main(rank: int, world_size: int, config, layout: ServeLayout) -> dict:
    """Rank 0 serves the prompts; every rank reports what it holds and where it sits."""
    if rank == 0:
        with LLM(random_model(config), ByteTokenizer(), **ENGINE, **degrees(layout)) as llm:
            outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            return {"outputs": outputs, "coords": llm.driver.ranks.coords,
                    **held_bytes(llm.runner)}
    worker = ServingWorker(random_model(config))
    worker.serve()
    return {"coords": worker.ranks.coords, **held_bytes(worker.runner)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="configs/deepseek-v3-tiny.toml")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    config = resolve_model(args.model)
    n = args.ranks
    layouts = {"throughput": ServeLayout(ep=n, dp=n), "latency": ServeLayout(pp=n),
               "latency, tp": ServeLayout(tp=2, pp=n // 2),
               "latency, tp with experts": ServeLayout(tp=n, ep=n)}
    single = LLM(random_model(config), ByteTokenizer(), **ENGINE)
    reference = [o.token_ids for o in single.generate(PROMPTS, GREEDY)]
    whole, planned = held_bytes(single.runner), planned_bytes(ServeLayout(), config, "fp32", 0)
    print(f"{config.name}: {args.ranks} local CPU ranks, fp32 weights and KV cache, "
          f"{len(PROMPTS)} prompts x {GREEDY.max_tokens} greedy tokens")
    print()
    print("| layout | rank | stage, dp rank | weights counted | weights planned "
          "| KV B/token counted | KV B/token planned | KV pool counted |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| one process | 0 | 0, 0 | {whole['weights']:,} | {planned['weights']:,.0f} "
          f"| {whole['kv_per_token']:,} | {planned['kv_per_token']:,.0f} | {whole['kv_pool']:,} |")
    checks = []
    for purpose, layout in layouts.items():
        layout.check(config)
        ranks = spawn(rank_main, layout.world_size, (config, layout), timeout_s=600)
        same = ranks[0]["outputs"] == reference
        for rank, held in enumerate(ranks):
            stage = held["coords"]["pp"]
            planned = planned_bytes(layout, config, "fp32", stage)
            label = f"{purpose}: {layout.describe()}"
            print(f"| {label if rank == 0 else ''} | {rank} | {stage}, {held['coords']['dp']} "
                  f"| {held['weights']:,} | {planned['weights']:,.0f} "
                  f"| {held['kv_per_token']:,} | {planned['kv_per_token']:,.0f} "
                  f"| {held['kv_pool']:,} |")
        checks.append(f"{layout.describe()}: greedy output equals one process: "
                      f"{'yes' if same else 'NO'}")
    print()
    print("\n".join(checks))


if __name__ == "__main__":
    main()
