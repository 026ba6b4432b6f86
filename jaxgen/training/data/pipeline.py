"""Packing token streams into fixed-length training examples, and the grain iterators over them.

Each example is a window of T + 1 tokens of the stream (documents back to back, each ending in
end-of-text). Inputs are the first T, targets the last T (teacher forcing). Documents inside a
window get their own segment id and positions restarting at 0, so attention never crosses a
document boundary; the target that would predict the next document's first token is masked out.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxgen.training.data.tokens import DOC_START, NO_LOSS


class PackedSequences:
    """Random-access source of packed examples over a memory-mapped token stream."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, seq_len: int):
        self.tokens, self.flags, self.seq_len = tokens, flags, seq_len
        self._len = (len(tokens) - 1) // seq_len
        if self._len < 1:
            raise ValueError(f"only {len(tokens)} tokens: too few for one sequence of data.seq_len={seq_len}")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        lo = int(i) * self.seq_len
        return pack_window(self.tokens[lo : lo + self.seq_len + 1], self.flags[lo : lo + self.seq_len + 1])


class PackedConversations:
    """Whole documents packed into examples of T + 1 tokens, never one split between two (chat SFT: each
    answer is trained with its conversation in view). Documents are laid out in store order, a new example
    begun when the next one does not fit; the rest of an example is padding (token 0, a segment of its own,
    no loss). A document longer than T + 1 tokens keeps its first T + 1 (`cut` counts them)."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, seq_len: int):
        self.tokens, self.flags, self.seq_len = tokens, flags, seq_len
        self.starts = np.flatnonzero(np.asarray(flags) & DOC_START)
        if len(self.starts) == 0:
            raise ValueError(f"{len(tokens)} tokens and no document: nothing to pack into data.seq_len={seq_len}")
        ends = np.append(self.starts[1:], len(tokens))
        self.lengths = np.minimum(ends - self.starts, seq_len + 1)
        self.cut = int(np.sum(ends - self.starts > seq_len + 1))
        firsts, used = [0], 0
        for d, n in enumerate(self.lengths.tolist()):
            if used + n > seq_len + 1:
                firsts.append(d)
                used = 0
            used += n
        self.bounds = np.append(firsts, len(self.starts))  # example i holds documents bounds[i]:bounds[i + 1]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        docs = range(self.bounds[int(i)], self.bounds[int(i) + 1])
        spans = [(self.starts[d], self.starts[d] + self.lengths[d]) for d in docs]
        tokens = np.zeros(self.seq_len + 1, np.int64)
        flags = np.full(self.seq_len + 1, NO_LOSS, np.uint8)
        at = 0
        for lo, hi in spans:
            tokens[at : at + hi - lo], flags[at : at + hi - lo] = self.tokens[lo:hi], self.flags[lo:hi]
            at += hi - lo
        flags[at : at + 1] |= DOC_START  # the padding is a document of its own
        return pack_window(tokens, flags)


class PreferencePairs:
    """Preference pairs (data.source=preference) packed into rows of T + 1 tokens: pair i is documents 2i
    (chosen) and 2i + 1 (rejected) of the store, each its own segment (positions from 0, attention kept
    inside it: exact), whole pairs laid out in store order and a new row begun when the next pair does not
    fit. A pair longer than T + 1 tokens in all keeps the first (T + 1) // 2 of each answer (`cut` counts
    them). An example (a row) holds up to `width` pairs (the most any row holds; `width` may be raised so
    that two sources share one shape): the (T,) arrays of `pack_window`, `answer` (T,) int32 (2k + side for
    a target token of the row's k-th pair, side 0 chosen and 1 rejected, -1 elsewhere), `pairs` (width,)
    float32 (1 for each pair the row holds) and `reference` (width, 2) float32: the frozen reference's
    summed log-probability of each answer (`set_reference`, before the first example is read)."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, seq_len: int):
        self.tokens, self.flags, self.seq_len = tokens, flags, seq_len
        starts = np.append(np.flatnonzero(np.asarray(flags) & DOC_START), len(tokens))
        if len(starts) < 3 or len(starts) % 2 == 0:
            raise ValueError(f"{len(starts) - 1} documents: preference data is whole pairs, at least one")
        lengths = np.diff(starts).reshape(-1, 2)
        self.cut = int(np.sum(lengths.sum(axis=1) > seq_len + 1))
        half = (seq_len + 1) // 2
        lengths = np.where(lengths.sum(axis=1, keepdims=True) > seq_len + 1, np.minimum(lengths, half), lengths)
        self.spans = np.stack([starts[:-1].reshape(-1, 2), starts[:-1].reshape(-1, 2) + lengths], -1)  # (N, 2, 2)
        firsts, used = [0], 0
        for k, n in enumerate(lengths.sum(axis=1).tolist()):
            if used + n > seq_len + 1:
                firsts.append(k)
                used = 0
            used += n
        self.bounds = np.append(firsts, len(lengths))  # row r holds pairs bounds[r]:bounds[r + 1]
        self.width = int(np.max(np.diff(self.bounds)))
        self.reference = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_pairs(self) -> int:
        return len(self.spans)

    def pairs_of(self, row: int) -> range:
        """The pairs (store order) row `row` holds."""
        return range(self.bounds[int(row)], self.bounds[int(row) + 1])

    def set_reference(self, reference: np.ndarray) -> None:
        """(pairs, 2) float32: the reference's summed log-probabilities of each pair's chosen, rejected answer."""
        if reference.shape != (self.num_pairs, 2):
            raise ValueError(f"a reference of shape {reference.shape} for {self.num_pairs} pairs")
        self.reference = reference

    def rows(self, i: int) -> dict[str, np.ndarray]:
        """Row i without the reference (what scoring the reference reads)."""
        tokens = np.zeros(self.seq_len + 1, np.int64)
        flags = np.full(self.seq_len + 1, NO_LOSS, np.uint8)
        answer = np.full(self.seq_len + 1, -1, np.int32)
        pairs = np.zeros(self.width, np.float32)
        at = 0
        for k, pair in enumerate(self.pairs_of(i)):
            pairs[k] = 1.0
            for side, (lo, hi) in enumerate(self.spans[pair]):
                tokens[at : at + hi - lo], flags[at : at + hi - lo] = self.tokens[lo:hi], self.flags[lo:hi]
                answer[at : at + hi - lo] = 2 * k + side
                at += hi - lo
        flags[at : at + 1] |= DOC_START  # the padding is a document of its own
        out = pack_window(tokens, flags)
        return out | {"answer": np.where(out["loss_mask"] > 0, answer[1:], -1).astype(np.int32), "pairs": pairs}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self.reference is None:
            raise RuntimeError("PreferencePairs.set_reference must be called before examples are read")
        reference = np.zeros((self.width, 2), np.float32)
        held = self.pairs_of(i)
        reference[: len(held)] = self.reference[held.start : held.stop]
        return self.rows(i) | {"reference": reference}


def pack_window(tokens: np.ndarray, flags: np.ndarray) -> dict[str, np.ndarray]:
    """One example from T + 1 tokens and their flags. All arrays are (T,) int32."""
    starts = (flags & DOC_START).astype(bool)
    segment = np.cumsum(starts) - int(starts[0]) + 1  # the window's first document is segment 1
    idx = np.arange(len(tokens))
    last_start = np.maximum.accumulate(np.where(starts, idx, 0))
    positions = idx - last_start
    same_doc = segment[1:] == segment[:-1]
    loss_mask = same_doc & ((flags[1:] & NO_LOSS) == 0)
    return {
        "inputs": tokens[:-1].astype(np.int32),
        "targets": tokens[1:].astype(np.int32),
        "positions": positions[:-1].astype(np.int32),
        "segment_ids": segment[:-1].astype(np.int32),
        "loss_mask": loss_mask.astype(np.int32),
    }


def train_iterator(source: PackedSequences, batch_size: int, seed: int, rows: slice | None = None):
    """Shuffled, repeating, deterministic batches; `get_state()` makes it resumable.

    rows: this process's rows of every global batch of `batch_size` (`sharding.process_rows`); default all.
    Every process walks the same global order and reads only its rows, so the global batches, and each
    iterator's state (global batches consumed), do not depend on how many processes share them.
    """
    rows = slice(0, batch_size) if rows is None else rows
    share = rows.stop - rows.start
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)  # every epoch sees every example once
    ds = ds.batch(share, drop_remainder=True)[rows.start // share :: batch_size // share]
    return iter(ds.to_iter_dataset())


def eval_batches(
    source: PackedSequences, batch_size: int, num_batches: int, rows: slice | None = None
) -> list[dict[str, np.ndarray]]:
    """A fixed list of held-out batches (wrapping around a small held-out set); `rows` as in train_iterator."""
    rows = slice(0, batch_size) if rows is None else rows
    batches = []
    for b in range(num_batches):
        examples = [source[(b * batch_size + i) % len(source)] for i in range(rows.start, rows.stop)]
        batches.append({k: np.stack([e[k] for e in examples]) for k in examples[0]})
    return batches
