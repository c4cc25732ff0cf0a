"""The AdamW step alone, on the parameters of bench_vs_hf.py's model (27M, Llama shape): torch's
single-tensor path (its CPU default), its foreach path and its fused kernel, which
tetrad.train.optim.build_optimizer uses. The three alternate step by step on the same gradients,
so that load from other processes hits them alike; median of --steps after one untimed step.

    .venv/bin/python benchmarks/bench_optimizer.py [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tetrad.spec.model import ModelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.train.optim import parameter_groups

IMPLEMENTATIONS = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True},
                   "fused (tetrad)": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(name="bench", vocab_size=4096, hidden_size=512, num_layers=8,
                         num_heads=8, num_kv_heads=4, ffn_hidden_size=1376, max_seq_len=256)
    train = TrainConfig()
    models = {name: Transformer(config) for name in IMPLEMENTATIONS}
    optimizers = {}
    for name, model in models.items():
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizers[name] = torch.optim.AdamW(
            parameter_groups(model, train.weight_decay), lr=train.lr,
            betas=(train.beta1, train.beta2), eps=1e-8, **IMPLEMENTATIONS[name])
    wall: dict[str, list[float]] = {name: [] for name in optimizers}
    for step in range(args.steps + 1):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            if step:
                wall[name].append(time.perf_counter() - start)
    numel = sum(param.numel() for param in models["fused (tetrad)"].parameters())
    print(f"AdamW step over {numel / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}")
    fused = statistics.median(wall["fused (tetrad)"])
    for name, values in wall.items():
        median = statistics.median(values)
        print(f"{name:>15}: median {median * 1e3:7.1f} ms (n={len(values)}), "
              f"{median / fused:.2f}x the fused kernel's time")


if __name__ == "__main__":
    main()
