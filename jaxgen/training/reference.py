"""Preference tuning's frozen reference, scored once and cached beside the data.

    set_references(cfg, mesh, tokenizer, {"train": train_src, "eval": eval_src}, start)

The reference is the model training starts from (`start()`: its params as the first step reads them, LoRA's
base with the untrained adapters attached). Each pair's summed log-probability of its chosen and rejected
answer under it (`preference.sequence_logps`, the training forward) is computed once, written to
`<data store>/reference-<key>.npz` (the key hashes the store, the model config, training.init_from's weight
files and the seed) and read back by every later start, a resumed run included: the reference model is
never held beside the policy. Reference-free objectives (`preference.REFERENCE_FREE`) get zeros.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxgen.config import Config
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.data.pipeline import PreferencePairs
from jaxgen.training.data.tokens import store_folder, store_key
from jaxgen.training.preference import REFERENCE_FREE, sequence_logps


def reference_key(cfg: Config, tokenizer: Tokenizer) -> str:
    """What the reference's scores depend on: the data store, the model, the starting weights."""
    h = hashlib.sha256(store_key(cfg.data, tokenizer).encode())
    h.update(f"{cfg.model!r} seq_len {cfg.data.seq_len}".encode())  # (the length decides which answers are cut)
    if cfg.training.init_from:
        for f in sorted(Path(cfg.training.init_from).glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    else:
        h.update(f"seed {cfg.training.seed}".encode())
    return h.hexdigest()[:16]


def set_references(cfg: Config, mesh, tokenizer: Tokenizer, sources: dict[str, PreferencePairs],
                   start: Callable[[], dict], progress: bool = True) -> None:  # fmt: skip
    """Gives each source its pairs' reference scores: read from the cache, else computed with `start()`'s
    params and cached (written whole or not at all)."""
    if cfg.training.objective in REFERENCE_FREE:
        for src in sources.values():
            src.set_reference(np.zeros((src.num_pairs, 2), np.float32))
        return
    path = store_folder(cfg.data, tokenizer) / f"reference-{reference_key(cfg, tokenizer)}.npz"
    if path.exists():
        with np.load(path) as cached:
            scores = {split: cached[split] for split in sources}
    else:
        params = start()
        scores = {split: score(params, src, cfg, mesh, progress) for split, src in sources.items()}
        del params
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-reference-", suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **scores)
        os.replace(tmp, path)
    for split, src in sources.items():
        src.set_reference(scores[split])


def score(params, source: PreferencePairs, cfg: Config, mesh, progress: bool = True) -> np.ndarray:
    """(pairs, 2) float32: summed log-probabilities of every pair's answers, the source's rows
    training.batch_size a call (the last call padded with the first rows)."""
    b = cfg.training.batch_size
    fn = jax.jit(functools.partial(sequence_logps, cfg=cfg))
    out = np.zeros((source.num_pairs, 2), np.float32)
    with jax.set_mesh(mesh):
        for lo in tqdm(range(0, len(source), b), desc="reference", unit="batch", disable=not progress, leave=False):
            idx = [(lo + i) % len(source) for i in range(b)]
            rows = [source.rows(i) for i in idx]
            logp, _ = fn(params, {k: np.stack([r[k] for r in rows]) for k in rows[0]})
            logp = np.asarray(logp)  # (b, width, 2)
            for j, row in enumerate(idx[: min(b, len(source) - lo)]):
                held = source.pairs_of(row)
                out[held.start : held.stop] = logp[j, : len(held)]
    return out
