"""Logit error of DeepSeek-V3's FP8 checkpoint layout against the fp32 model, next to bf16's.

    .venv/bin/python benchmarks/fp8_checkpoint_error.py

For each tiny random DeepSeek model of tests/deepseek_models.py (v3: low-rank q, groups, yarn;
lite: full-rank q), the HF fp32 folder is exported with `tetrad export --dtype fp8` and `--dtype
bf16`, each export is loaded back in fp32 (FP8 weights dequantised per 128x128 block), and the
logits of 2 x 48 tokens are compared with the fp32 model's: max and mean |difference|, the share of
positions whose argmax agrees, and the mean relative error of the quantized weights.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from deepseek_models import CASES, VOCAB, hf_model  # noqa: E402

from tetrad import load_pretrained  # noqa: E402
from tetrad.cli.main import main  # noqa: E402
from tetrad.models.hf_fp8 import SCALE_SUFFIX  # noqa: E402


def weight_error(original: Path, fp8: Path) -> float:
    """Mean |dequantised - original| / mean |original| over the quantized weights."""
    with safe_open(str(original / "model.safetensors"), framework="pt") as before, \
            safe_open(str(fp8 / "model.safetensors"), framework="pt") as after:
        errors, sizes = 0.0, 0.0
        for name in after.keys():
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                scale = after.get_tensor(name)  # one block each in these tiny models
                restored = after.get_tensor(weight).float() * scale
                reference = before.get_tensor(weight)
                errors += (restored - reference).abs().sum().item()
                sizes += reference.abs().sum().item()
    return errors / sizes


def main_() -> None:
    root = Path(tempfile.mkdtemp())
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    for case in sorted(CASES):
        hf_model(case).save_pretrained(root / case / "original")
        for dtype in ("fp32", "fp8", "bf16"):
            assert main(["export", str(root / case / "original"), "--out",
                         str(root / case / dtype), "--dtype", dtype]) == 0
        with torch.no_grad():
            reference = load_pretrained(root / case / "fp32", dtype=torch.float32)(ids)
            print(f"{case}: fp32 logits max |x| {reference.abs().max():.3f}, "
                  f"mean |x| {reference.abs().mean():.4f}")
            for dtype in ("fp8", "bf16"):
                out = load_pretrained(root / case / dtype, dtype=torch.float32)(ids)
                error = (out - reference).abs()
                agree = (out.argmax(-1) == reference.argmax(-1)).float().mean()
                print(f"  {dtype:4s} |logit error| max {error.max():.4f} mean {error.mean():.4f},"
                      f" argmax agrees at {agree:.1%} of positions")
        print(f"  fp8 weights: mean relative error "
              f"{weight_error(root / case / 'fp32', root / case / 'fp8'):.2%}")


if __name__ == "__main__":
    main_()
