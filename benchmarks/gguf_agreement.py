"""GGUF Q8_0 and Q4_0 loads of a trained model against its bf16 serving: greedy agreement and mean
|Δlogit| (issue 30's goal line for GGUF, beside quant_agreement.py's int8 / int4).

    .venv/bin/python benchmarks/gguf_agreement.py [--steps 300] [--batch-size 16] [--model DIR]

The model, the prompts and both measures are quant_agreement.py's (its helpers, imported): the
model trained there (or --model, an HF llama folder), 20 prompts of 16 tokens of Hamlet, 64
greedy tokens from the serving engine in bf16 against the bf16 engine's, mean |Δlogit| of the
plain forward over prompt plus bf16 continuation and the whole vocabulary. The weights are written
as GGUF files the way llama.cpp's converter writes them (tests/gguf_files.py: permuted Q/K rows,
gguf.quants.quantize; norms in F32) and served as `tetrad run ./x.gguf` serves them, one rank in
bf16: Q4_0 linears as Int4Linear (group 32, the file's 4-bit values and scales), Q8_0 dequantized
to bf16 at load (no int8 kernel takes its scale per 32 values), F16 as a control. The
"Q4_0+Q8_0 head" row keeps the untied LM head at Q8_0, nearer what llama-quantize gives a Q4_0
file's output matrix (Q6_K) than Q4_0 is.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from gguf_files import write_gguf  # noqa: E402
from quant_agreement import (agreement, bf16_reference, engine_continuations,  # noqa: E402
                             mean_logit_difference, trained_hf_folder)

from tetrad.models.hf import load_pretrained  # noqa: E402
from tetrad.store.gguf import unpack_gguf  # noqa: E402

# (label, the weights' type, the LM head's type). llama-quantize writes a Q4_0 file's output
# matrix as Q6_K, which gguf.quants cannot write: Q8_0 stands in for it in the last row.
KINDS = (("F16", "F16", None), ("Q8_0", "Q8_0", None), ("Q4_0", "Q4_0", None),
         ("Q4_0+Q8_0 head", "Q4_0", "Q8_0"))


def gguf_folder(hf_folder: Path, label: str, kind: str, output_kind: str | None,
                work: Path) -> Path:
    """`hf_folder`'s weights as a `kind` GGUF file (its LM head `output_kind`, when given),
    unpacked as tetrad create unpacks one."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    name = label.replace("+", "-").replace(" ", "-")
    file = write_gguf(work / f"{name}.gguf", hf_model, kind, template=None,
                      output_kind=output_kind)
    folder = work / name
    folder.mkdir()
    unpack_gguf(file, folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", help="an HF llama folder instead of training one")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = (Path(args.model) if args.model
                  else trained_hf_folder(work, args.steps, args.batch_size))
        reference, prompts, expected = bf16_reference(folder, args)
        print(f"{'GGUF':<15} {'linears':<12} {'mean |dlogit|':>14} {'greedy agreement':>17}")
        for label, kind, output_kind in KINDS:
            loaded = gguf_folder(folder, label, kind, output_kind, work)
            model = load_pretrained(loaded, dtype=torch.bfloat16, keep_fp8=True)
            tokens = engine_continuations(loaded, prompts)
            agreed = agreement(tokens, expected)
            error = mean_logit_difference(reference, model, prompts, expected)
            print(f"{label:<15} {type(model.layers[0].mlp.down).__name__:<12} {error:>14.4f} "
                  f"{agreed:>16.1%}")


if __name__ == "__main__":
    main()
