"""The fused CPU decode step against the eager forward on quantized weights, in ONE process (the
same weights and engine; the fused step switched off for the eager runs), so a loaded machine
hits both alike: cpu_vs_llamacpp.py's 32m shape (random weights) with round-to-nearest int8 /
int4 projections (no GPTQ, which takes minutes and does not change how fast the kernels read),
one 32-token prompt, greedy; decode tokens/s of 32 steps (33 tokens' time less 1 token's), four
runs of each side interleaved, 2 threads.

    .venv/bin/python benchmarks/cpu_fused_quantized.py int8 int4
"""

import os
import statistics
import sys
import time

import torch
from torch import nn
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.engine import LLM
from tetrad.models.quant import Int4Linear, Int8Linear
from tetrad.models.transformer import Transformer
from tetrad.spec.model import ModelConfig
from tetrad.tokenizer import ByteTokenizer

torch.set_num_threads(2)
config = ModelConfig(name="llama-32m", vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8,
                     num_kv_heads=8, ffn_hidden_size=1408, max_seq_len=2048)
prompt = [list(range(100, 132))]
for method in sys.argv[1:]:
    torch.manual_seed(0)
    model = Transformer(config).to(torch.bfloat16).eval()
    for name, module in list(model.named_modules()):
        if name.startswith("layers.") and type(module) is nn.Linear:
            parent, _, child = name.rpartition(".")
            layer = (Int8Linear.quantize(module.weight) if method == "int8"
                     else Int4Linear.quantize(module.weight))
            setattr(model.get_submodule(parent), child, layer)
    llm = LLM(model, ByteTokenizer(), log=None, dtype="bf16", kv_memory=64 * 2**20)
    fused = llm.runner.fused
    assert fused is not None, "not fused"
    times = {"fused": [], "eager": []}
    tokens = {}
    def run(n):
        start = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, out[0].token_ids
    for i in range(4):
        for side in (("fused", "eager") if i % 2 == 0 else ("eager", "fused")):
            llm.runner.fused = fused if side == "fused" else None
            t33, ids = run(33)
            t1, _ = run(1)
            times[side].append(32 / (t33 - t1))
            tokens[side] = ids
    print(method, {k: [round(v, 1) for v in vs] for k, vs in times.items()},
          "median fused/eager %.2fx" % (statistics.median(times["fused"]) / statistics.median(times["eager"])),
          "same tokens:", tokens["fused"] == tokens["eager"], "load %.1f" % os.getloadavg()[0], flush=True)
    llm.close()
