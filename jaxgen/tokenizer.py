"""Tokenizers: a byte-level default and any Hugging Face `tokenizer.json`, both through `tokenizers`.

The byte-level tokenizer is itself a real `tokenizers` object (byte-level BPE with no merges: one
token per byte, plus an end-of-text token), so every tokenizer saves to and loads from the same
`tokenizer.json` format and a run folder is self-describing.

Train a BPE tokenizer on a corpus:
    python -m jaxgen.tokenizer --vocab-size 4096 --out runs/bpe/tokenizer.json [data.source=...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` that knows its end-of-sequence id."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_id: int | None = None):
        self.tok = tok
        if eos_id is None:
            eos_id = next((tok.token_to_id(t) for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos_id is None:
            raise ValueError(f"tokenizer has none of the end-of-sequence tokens {_EOS_CANDIDATES}")
        self.eos_id = eos_id

    @classmethod
    def byte_level(cls) -> Tokenizer:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_to_char = _bytes_to_unicode()
        vocab = {byte_to_char[b]: b for b in range(256)}
        assert set(vocab) == set(alphabet)
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOS_TOKEN])
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (expected a tokenizer.json)")
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_name(cls, name: str) -> Tokenizer:
        """`byte` or a path to a tokenizer.json (the `data.tokenizer` config value)."""
        return cls.byte_level() if name == "byte" else cls.from_file(name)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (used by ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with `tokenizers` on an iterator of documents."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok)


def main(argv: list[str] | None = None) -> None:
    from jaxgen.config import ConfigError, load_config
    from jaxgen.data.sources import iter_documents

    parser = argparse.ArgumentParser(
        prog="python -m jaxgen.tokenizer",
        description="Train a byte-level BPE tokenizer on a corpus (default: the Python standard library).",
    )
    parser.add_argument("--config", help="YAML config whose data section names the corpus")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.source=files data.paths=[a.txt]")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size} is too small: at least 257 (256 bytes + end of text)")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    tok = train_bpe((d.text for d in iter_documents(cfg.data)), args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out}: vocab {tok.vocab_size}, end-of-text id {tok.eos_id}")


if __name__ == "__main__":
    main()
