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
    """Preference pairs (data.source=preference): pair i is documents 2i (chosen) and 2i + 1 (rejected) of the
    store, each in a row of its own, padded to T + 1 tokens (`cut` counts answers longer: their first T + 1
    kept). An example is the pair's two rows, each array (2, T), and `reference` (2,) float32: the frozen
    reference's log-probability of each answer (`set_reference`, before the first example is read)."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, seq_len: int):
        self.tokens, self.flags, self.seq_len = tokens, flags, seq_len
        self.starts = np.append(np.flatnonzero(np.asarray(flags) & DOC_START), len(tokens))
        if len(self.starts) < 3 or len(self.starts) % 2 == 0:
            raise ValueError(f"{len(self.starts) - 1} documents: preference data is whole pairs, at least one")
        self.cut = int(np.sum(np.diff(self.starts) > seq_len + 1))
        self.reference = None

    def __len__(self) -> int:
        return (len(self.starts) - 1) // 2

    def set_reference(self, reference: np.ndarray) -> None:
        """(pairs, 2) float32: the reference's summed log-probabilities of each pair's chosen, rejected answer."""
        if reference.shape != (len(self), 2):
            raise ValueError(f"a reference of shape {reference.shape} for {len(self)} pairs: expected {(len(self), 2)}")
        self.reference = reference

    def rows(self, i: int) -> dict[str, np.ndarray]:
        """Pair i's two rows, each array (2, T), without the reference (what computing it reads)."""
        rows = [self._row(2 * int(i) + k) for k in (0, 1)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self.reference is None:
            raise RuntimeError("PreferencePairs.set_reference must be called before examples are read")
        return self.rows(i) | {"reference": np.asarray(self.reference[int(i)], np.float32)}

    def _row(self, d: int) -> dict[str, np.ndarray]:
        lo, hi = self.starts[d], min(self.starts[d + 1], self.starts[d] + self.seq_len + 1)
        tokens = np.zeros(self.seq_len + 1, np.int64)
        flags = np.full(self.seq_len + 1, NO_LOSS, np.uint8)
        tokens[: hi - lo], flags[: hi - lo] = self.tokens[lo:hi], self.flags[lo:hi]
        flags[hi - lo : hi - lo + 1] |= DOC_START  # the padding is a document of its own
        return pack_window(tokens, flags)


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
