"""`tetrad tokenizer train --data PATH --vocab-size N --out tokenizer.json`: train a byte-level BPE
tokenizer on a text file, a folder of .txt files, or a .jsonl file with a "text" field."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="train a BPE tokenizer")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser(
        "train", help="train a byte-level BPE tokenizer",
        description="Train a byte-level BPE tokenizer with an <|endoftext|> token; pass the "
                    "written file (or its folder) to `tetrad train --tokenizer`.")
    train.add_argument("--data", required=True,
                       help="text file, folder of .txt files, or .jsonl with a \"text\" field")
    train.add_argument("--vocab-size", type=int, required=True, help="vocabulary size (>= 257)")
    train.add_argument("--out", required=True,
                       help="a .json file to write, or a folder to write tokenizer.json into")
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tetrad.text_sources import iter_texts
    from tetrad.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train(iter_texts(args.data), args.vocab_size)
    if args.out.endswith(".json"):
        tokenizer.save_json(args.out)
    else:
        tokenizer.save(args.out)
    print(f"trained a BPE tokenizer with {tokenizer.vocab_size} tokens "
          f"(eos {tokenizer.eos_id}), wrote {args.out}")
    return 0
