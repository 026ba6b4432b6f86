"""A constraint's token automaton, kept as a dense table, and the vocabulary it reads.

    Vocabulary.of(tokenizer, model_vocab)       each token's bytes, the end-of-sequence ids, the table's width
    Automaton(next_state)                       next_state (S, V) int32, -1 where a token is not allowed
    dense_table(states, src, tok, dst, finals, vocab) -> (S, V) int32, from the compile worker's edges

`next_state[s, t]` is the state after token t in state s; state 0 is the start. The end-of-sequence ids are
allowed exactly in final states (and stay put there): a row ends with "stop" when its output is complete. A
final state is reached only after whole characters (the automaton reads bytes), so no row ends inside a
UTF-8 character.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxgen.inference.errors import SamplingError
from jaxgen.inference.structured.spec import FIELD

MAX_TABLE_BYTES = 2**28  # one automaton's dense table (S x V int32)


@dataclasses.dataclass(frozen=True)
class Automaton:
    """A constraint's token automaton: `next_state` (S, V) int32, -1 where a token is not allowed; state 0
    is the start. End-of-sequence ids are allowed (and stay put) in final states only."""

    next_state: np.ndarray

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    def walk(self, tokens, state: int = 0) -> int:
        """The state after `tokens` from `state` (-1 once a token was not allowed)."""
        for t in tokens:
            if state < 0:
                break
            state = int(self.next_state[state, t])
        return state

    def allowed(self, state: int) -> np.ndarray:
        return np.flatnonzero(self.next_state[state] >= 0)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The bytes of each token id (None for special tokens, which no constraint allows), the end-of-sequence
    ids and the model's vocabulary size (the table's width; it may exceed the tokenizer's)."""

    tokens: tuple[bytes | None, ...]
    eos_ids: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, tokenizer, model_vocab: int) -> Vocabulary:
        return cls(token_bytes(tokenizer), tuple(tokenizer.eos_ids), model_vocab)


def token_bytes(tokenizer) -> tuple[bytes | None, ...]:
    """What each token id writes, as bytes: byte-level BPE (GPT-2's character map), byte fallback (<0xNN>)
    and SentencePiece's "▁" for a space; None for special (added) tokens."""
    from jaxgen.tokenizer import _bytes_to_unicode

    tok = tokenizer.tok
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in repr(tok.decoder)
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        piece = tok.id_to_token(i)
        if piece is None or i in special:
            out.append(None)
        elif byte_level and all(c in to_byte for c in piece):
            out.append(bytes(to_byte[c] for c in piece))
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return tuple(out)


def dense_table(states: int, src, tok, dst, finals, vocab: Vocabulary) -> np.ndarray:
    """The dense table (states, V) int32 of an automaton's edges (the worker's answer: `worker.edges`);
    end-of-sequence ids stay put in final states. SamplingError when it would pass MAX_TABLE_BYTES."""
    if states * vocab.size * 4 > MAX_TABLE_BYTES:
        raise SamplingError(f"{FIELD}: the constraint's automaton has {states} states; its table would take "
                            f"{states * vocab.size * 4 / 2**20:.0f} MB, at most {MAX_TABLE_BYTES // 2**20} MB",
                            FIELD)  # fmt: skip
    table = np.full((states, vocab.size), -1, np.int32)
    table[src, tok] = dst
    eos = np.asarray(vocab.eos_ids)
    table[finals[:, None], eos[None]] = finals[:, None]
    return table
