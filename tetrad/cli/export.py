"""`tetrad export CHECKPOINT --out DIR`: a tetrad checkpoint as an HF folder that
transformers' AutoModelForCausalLM.from_pretrained loads (and AutoTokenizer, when the checkpoint
has a BPE tokenizer)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint as an HF model folder",
        description="Write a tetrad checkpoint (a step folder, or a checkpoint root with a "
                    "`latest` file) as an HF folder: config.json, model.safetensors and, when "
                    "the checkpoint has one, tokenizer.json.")
    parser.add_argument("checkpoint", help="checkpoint step folder, checkpoint root, or a stored "
                                           "model's name (tetrad list)")
    parser.add_argument("--out", required=True, help="folder to write the HF model to")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp8"),
                        help="tensor dtype: auto (as stored), fp32, bf16, or fp8 (DeepSeek-V3's "
                             "layout: E4M3 projections with a weight_scale_inv per 128x128 "
                             "block, the rest bf16)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.errors import ConfigError
    from tetrad.models.hf import load_pretrained, save_hf
    from tetrad.models.quant_store import stored_quantization
    from tetrad.store.models import resolve_model_argument
    from tetrad.tokenizer import load_tokenizer

    folder, _ = resolve_model_argument(args.checkpoint)
    check_out_folder(args.out)
    method = stored_quantization(folder)
    if method:
        raise ConfigError(f"{args.checkpoint} is stored quantized to {method} (tetrad create "
                          f"--quantize): its 16-bit projections are not stored, so it has no HF "
                          f"form; export the model it was created from")
    model = load_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    save_hf(model, args.out, eos_id=tokenizer.eos_id, dtype=args.dtype)
    # A byte-level tokenizer has no HF file form: the folder then holds the model only.
    tokenizer.save(args.out)
    print(f"wrote {model.config.name} as an HF model to {args.out}"
          + ("" if args.dtype == "auto" else f" ({args.dtype})"))
    return 0


def check_out_folder(out: str) -> None:
    """Export writes its files in place, so `out` must hold no file that another folder shares:
    a stored model's files are hardlinks to its source's and to other stored models'."""
    from pathlib import Path

    from tetrad.errors import ConfigError
    from tetrad.store.models import ModelStore

    folder, root = Path(out).resolve(), ModelStore().root.resolve()
    if folder == root or root in folder.parents:
        raise ConfigError(f"--out {out} is inside the model store ({root}), whose files are "
                          f"shared with other models: export to a folder outside it")
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.is_symlink() and path.stat().st_nlink > 1:
                raise ConfigError(f"--out {out} holds {path.name}, a file hardlinked elsewhere "
                                  f"(a stored model's, or its source's): writing it would change "
                                  f"them too; export to an empty folder")
