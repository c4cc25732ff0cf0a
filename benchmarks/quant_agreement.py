"""`--quantization int8 / int4` (and `--kv-cache-dtype fp8`) on a trained model against its bf16
serving: greedy agreement and mean |Δlogit| (issue 30's goal: int8 >= 90%, int4 >= 80% of the
first 64 tokens over 20 prompts).

    .venv/bin/python benchmarks/quant_agreement.py [--steps 300] [--batch-size 16] [--model DIR]
        [--keep DIR] [--calibration-seeds N] [--calibration-texts PLAY ...]
        [--settings int8 int4 ...]

The model (without --model) is trained here on one CPU process: smaller than the Shakespeare
demo's `small`, with widths int4's groups of 128 tile (4 layers, hidden 128, 4 heads of 32, 2 kv
heads, SwiGLU 384, byte vocabulary), `--steps` steps of `--batch-size` x 128 tokens of the
bundled plays (the demo's learning rate and schedule; seed 0); with --keep it is trained into
DIR and kept, and a later run with the same --keep, --steps and --batch-size reuses it. Each of
20 prompts is 16 tokens of Hamlet. Greedy continuations of 64 tokens come from the serving
engine (`LLM`, one process, bf16, the setting named); agreement is the share of the 64 positions
where the setting's continuation has the bf16 engine's token. Mean |Δlogit| is over every
position of prompt plus the bf16 continuation and the whole vocabulary, the quantized model
(tetrad.models.quant_model) against the bf16 one, both reading the same tokens. "quantize s" is
the wall time of that quantize_model call: the load's calibration (self-generated tokens, their
Hessians, GPTQ) and the packing, in this process's threads.

With --calibration-seeds N the int8 and int4 rows are repeated for calibration seeds 1..N-1 (the
engine calibrates with seed 0): how far the choice of self-generated calibration text alone
moves both measures. The "fp32" row serves the checkpoint as trained, in fp32: its agreement
is how many greedy tokens bf16's own rounding (of weights and activations) flips, the scale of
the measure's noise on this model. The "bf16 forward" row takes the greedy tokens of the bf16
model's own full forward (no engine, no KV cache) for each prompt: how many the engine's kernels
alone flip.

With --calibration-texts the int8 and int4 rows are repeated calibrated on real text instead of
the self-generated: CALIBRATION_SEQUENCES windows of CALIBRATION_TOKENS tokens spread evenly
over each named text of the bundled plays (e.g. macbeth_gut.txt), as a user's calibration file
would give them.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

MODEL = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
             ffn_hidden_size=384, max_seq_len=256)
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 20, 16, 64
SETTINGS = {"int8": dict(quantization="int8"), "int4": dict(quantization="int4"),
            "bf16 + fp8 KV": dict(kv_cache_dtype="fp8", attention="sdpa"),
            "fp32": dict(dtype="fp32"), "bf16 forward": dict(forward=True)}


def trained_hf_folder(work: Path, steps: int = 300, batch_size: int = 16) -> Path:
    """Train MODEL for `steps` steps of `batch_size` x 128 tokens in `work` and save it as an HF
    (llama) folder there; one that an earlier call trained there with the same steps and batch is
    reused."""
    from tetrad.models.hf import load_pretrained, save_hf
    from tetrad.train.checkpoint import find_checkpoint, read_json
    from tetrad.train.launch import train_model

    run, folder = work / "run", work / "hf"
    if folder.exists():
        trained = read_json(find_checkpoint(run), "run.json")
        done = (trained["step"], trained["config"]["batch_size"])
        if done != (steps, batch_size):
            raise SystemExit(f"{work} holds a model trained {done[0]} steps of {done[1]} x 128 "
                             f"tokens, not {steps} of {batch_size}: name another --keep folder")
        return folder
    train_model(model="small", model_overrides=MODEL, steps=steps, batch_size=batch_size,
                checkpoint_dir=str(run), save_every=steps, sample_tokens=0,
                log_every=max(1, steps // 5), device="cpu")
    save_hf(load_pretrained(run), folder)
    return folder


def hamlet_prompts(tokenizer) -> list[list[int]]:
    from tetrad.train.data import default_corpus

    ids = tokenizer.encode((default_corpus() / "hamlet_gut.txt").read_text()[20_000:60_000])
    step = len(ids) // PROMPTS
    return [ids[i * step:i * step + PROMPT_TOKENS] for i in range(PROMPTS)]


def text_windows(tokenizer, name: str) -> torch.Tensor:
    """[CALIBRATION_SEQUENCES, CALIBRATION_TOKENS] token ids: windows spread evenly over the
    bundled text `name`."""
    from tetrad.models.quant_calibrate import CALIBRATION_SEQUENCES, CALIBRATION_TOKENS
    from tetrad.train.data import default_corpus

    ids = tokenizer.encode((default_corpus() / name).read_text())
    step = (len(ids) - CALIBRATION_TOKENS) // CALIBRATION_SEQUENCES
    return torch.tensor([ids[i * step:i * step + CALIBRATION_TOKENS]
                         for i in range(CALIBRATION_SEQUENCES)])


@contextmanager
def calibrated_on(source: int | torch.Tensor):
    """The engine's and quantize_model's calibration, while inside: self-generated with seed
    `source`, or the token ids `source`."""
    from tetrad.models import quant_calibrate

    saved = quant_calibrate.CALIBRATION_SEED, quant_calibrate.self_generated_tokens
    if isinstance(source, int):
        quant_calibrate.CALIBRATION_SEED = source
    else:
        quant_calibrate.self_generated_tokens = lambda *args, **kwargs: source
    try:
        yield
    finally:
        quant_calibrate.CALIBRATION_SEED, quant_calibrate.self_generated_tokens = saved


@torch.no_grad()
def forward_continuations(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from `model`'s full forward over the whole sequence at every step."""
    continuations = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids]))[0, -1].float().argmax()))
        continuations.append(ids[len(prompt):])
    return continuations


def engine_continuations(folder: Path, prompts: list[list[int]], **settings) -> list[list[int]]:
    from tetrad.inference.core.params import SamplingParams
    from tetrad.inference.engine import LLM

    llm = LLM(folder, **{"dtype": "bf16", "device": "cpu", "log": None, **settings})
    try:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [output.token_ids for output in llm.generate(prompts, greedy)]
    finally:
        llm.close()


@torch.no_grad()
def mean_logit_difference(reference, model, prompts, continuations) -> float:
    difference, count = 0.0, 0
    for prompt, continuation in zip(prompts, continuations):
        ids = torch.tensor([prompt + continuation])
        delta = (model(ids).float() - reference(ids).float()).abs()
        difference, count = difference + delta.sum().item(), count + delta.numel()
    return difference / count


def bf16_reference(folder: Path, args) -> tuple:
    """The bf16 model at `folder`, the prompts and the bf16 engine's greedy continuations, after
    a line saying which model they come from."""
    from tetrad.models.hf import load_pretrained
    from tetrad.tokenizer import load_tokenizer

    reference = load_pretrained(folder, dtype=torch.bfloat16)
    prompts = hamlet_prompts(load_tokenizer(folder))
    expected = engine_continuations(folder, prompts)
    trained = f"trained {args.steps} steps of {args.batch_size} x 128 tokens"
    print(f"model {folder if args.model else trained}: "
          f"{sum(p.numel() for p in reference.parameters()):,} parameters; {PROMPTS} "
          f"prompts of {PROMPT_TOKENS} tokens, {NEW_TOKENS} greedy tokens each; against "
          f"the bf16 engine")
    return reference, prompts, expected


def agreement(tokens: list[list[int]], expected: list[list[int]]) -> float:
    """The share of greedy tokens equal to the bf16 engine's, position by position."""
    return sum(a == b for got, want in zip(tokens, expected)
               for a, b in zip(got, want)) / (PROMPTS * NEW_TOKENS)


def main() -> None:
    from tetrad.tokenizer import load_tokenizer
    from tetrad.train.data import default_corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", help="an HF or tetrad model folder instead of training one")
    parser.add_argument("--keep", help="train the model into this folder and keep it (reused by "
                                       "a later run with the same --steps and --batch-size)")
    parser.add_argument("--calibration-seeds", type=int, default=1,
                        help="also quantize with calibration seeds 1..N-1 (the spread)")
    parser.add_argument("--calibration-texts", nargs="+", default=[], metavar="PLAY",
                        help="also quantize calibrated on these bundled texts")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="only these rows (default: all)")
    args = parser.parse_args()
    if missing := [name for name in args.calibration_texts
                   if not (default_corpus() / name).is_file()]:
        parser.error(f"--calibration-texts: no bundled text {', '.join(missing)} (they are the "
                     f"files of {default_corpus()})")

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        folder = Path(args.model) if args.model else trained_hf_folder(work, args.steps,
                                                                        args.batch_size)
        reference, prompts, expected = bf16_reference(folder, args)
        tokenizer = load_tokenizer(folder)
        calibrations = ([("", 0)] + [(f" seed {seed}", seed)
                                     for seed in range(1, args.calibration_seeds)]
                        + [(f" on {Path(name).stem}", text_windows(tokenizer, name))
                           for name in args.calibration_texts])
        print(f"{'setting':<22} {'mean |dlogit|':>14} {'greedy agreement':>17} "
              f"{'quantize s':>11}")
        for name in args.settings:
            settings = SETTINGS[name]
            for suffix, source in (calibrations if "quantization" in settings else [("", 0)]):
                with calibrated_on(source):
                    row = measured(folder, reference, prompts, expected, settings)
                print(f"{name + suffix:<22} {row}")


def measured(folder: Path, reference, prompts, expected, settings: dict) -> str:
    """One setting's mean |dlogit|, greedy agreement and quantize seconds."""
    from tetrad.models.quant_model import quantize_model

    error = seconds = "-"  # the engine's KV cache: no full forward to compare
    if settings.get("forward"):
        agreed = agreement(forward_continuations(reference, prompts), expected)
        return f"{error:>14} {agreed:>16.1%} {seconds:>11}"
    agreed = agreement(engine_continuations(folder, prompts, **settings), expected)
    if method := settings.get("quantization"):
        start = time.perf_counter()
        quantized = quantize_model(copy.deepcopy(reference), method)
        seconds = f"{time.perf_counter() - start:.1f}"
        error = f"{mean_logit_difference(reference, quantized, prompts, expected):.4f}"
    return f"{error:>14} {agreed:>16.1%} {seconds:>11}"


if __name__ == "__main__":
    main()
