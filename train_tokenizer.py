"""Train a BPE tokenizer: `python train_tokenizer.py --vocab-size 4096 --out runs/bpe/tokenizer.json [key=value]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxgen.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train a byte-level BPE tokenizer on a corpus (default: the Python standard library). "
        "The corpus is the data section of a training config, so the same data.* overrides pick it.",
        epilog="example:\n  python train_tokenizer.py --vocab-size 4096 --out runs/bpe/tokenizer.json "
        "data.source=files 'data.paths=[corpus/*.txt]'\nthen train with data.tokenizer=runs/bpe/tokenizer.json "
        "and model.vocab_size at least the printed vocab size.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML training config whose data section names the corpus")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.source=files data.paths=[a.txt]")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size} is too small: at least 257 (256 bytes + end of text)")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxgen.tokenizer import train_bpe
    from jaxgen.training.data.sources import iter_documents

    tok = train_bpe((d.text for d in iter_documents(cfg.data)), args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out}: vocab {tok.vocab_size}, end-of-text id {tok.eos_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
