"""Tokenize a corpus once into cached, memory-mapped token files, split into train and held-out.

A store is a folder `<cache_dir>/<key>/` with, per split, `tokens.npy` (uint16 or uint32) and
`flags.npy` (uint8 per token: bit 0 = first token of a document, bit 1 = no loss: a prompt, or a chat's
turns other than the assistant's). Preference pairs are two documents each, chosen then rejected, held out
or not together; `meta.json` counts the bad lines skipped and names the first (`bad_lines`).
The key hashes the files (path, size, mtime), the tokenizer and the split settings, so a changed
corpus or tokenizer is tokenized again, and an unchanged one is read back at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxgen.config import DataConfig
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.data.chat import encode_conversations
from jaxgen.training.data.preference import encode_pairs
from jaxgen.training.data.sources import iter_documents, resolve_paths

DOC_START = 1
NO_LOSS = 2
_BATCH_DOCS = 256


def store_key(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    h = hashlib.sha256()
    for p in resolve_paths(cfg):
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(tokenizer.tok.to_str().encode())
    settings = (cfg.source, cfg.text_field, cfg.prompt_field, cfg.response_field, cfg.eval_fraction, cfg.seed)
    h.update(repr(settings).encode())
    if cfg.source in ("chat", "preference"):  # the template decides the text and which tokens are trained
        h.update(repr(tokenizer.chat_template).encode())
    return h.hexdigest()[:16]


def store_folder(cfg: DataConfig, tokenizer: Tokenizer) -> Path:
    """The store's folder (what is cached beside the data, e.g. preference tuning's reference, goes there)."""
    return Path(os.path.expanduser(cfg.cache_dir)) / store_key(cfg, tokenizer)


def load_meta(cfg: DataConfig, tokenizer: Tokenizer) -> dict:
    return json.loads((store_folder(cfg, tokenizer) / "meta.json").read_text())


def load_splits(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, dict[str, np.ndarray]]:
    """{'train': {'tokens', 'flags'}, 'eval': {...}} as read-only memory maps, building them if needed."""
    folder = store_folder(cfg, tokenizer)
    if not (folder / "meta.json").exists():
        _build(cfg, tokenizer, folder)
    return {
        split: {name: np.load(folder / f"{split}.{name}.npy", mmap_mode="r") for name in ("tokens", "flags")}
        for split in ("train", "eval")
    }


def _encode_document_batch(docs, tokenizer: Tokenizer):
    prompts = tokenizer.encode_batch([d.prompt for d in docs]) if any(d.prompt for d in docs) else None
    texts = tokenizer.encode_batch([d.text for d in docs], special=prompts is None)  # one BOS, before the prompt
    for i, ids in enumerate(texts):
        prompt = prompts[i] if prompts else []
        tokens = np.asarray(prompt + ids + [tokenizer.eos_id], np.uint32)
        flags = np.zeros(len(tokens), np.uint8)
        flags[: len(prompt)] |= NO_LOSS
        flags[0] |= DOC_START
        yield tokens, flags


def _chat_documents(cfg: DataConfig, tokenizer: Tokenizer) -> list:
    """(tokens, flags) per conversation: only the assistant's tokens trained (`chat.py`)."""
    out, conversations = [], encode_conversations(cfg, tokenizer, resolve_paths(cfg))
    for tokens, trained in tqdm(conversations, desc="rendering", unit="chat", leave=False):
        flags = np.where(trained, 0, NO_LOSS).astype(np.uint8)
        flags[0] |= DOC_START
        out.append((tokens, flags))
    return out


def _preference_documents(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[list, list[str]]:
    """(tokens, flags) of each pair's chosen then rejected answer (`preference.py`); the bad lines skipped."""
    data = encode_pairs(tokenizer, resolve_paths(cfg), cfg.tokenizer)
    out = []
    for pair in data.pairs:
        for tokens, trained in pair:
            flags = np.where(trained, 0, NO_LOSS).astype(np.uint8)
            flags[0] |= DOC_START
            out.append((tokens, flags))
    return out, data.bad


def _text_documents(cfg: DataConfig, tokenizer: Tokenizer) -> list:
    docs, out = list(iter_documents(cfg)), []
    with tqdm(total=len(docs), desc="tokenizing", unit="doc", leave=False) as bar:
        for start in range(0, len(docs), _BATCH_DOCS):
            out += _encode_document_batch(docs[start : start + _BATCH_DOCS], tokenizer)
            bar.update(min(_BATCH_DOCS, len(docs) - start))
    return out


def _build(cfg: DataConfig, tokenizer: Tokenizer, folder: Path) -> None:
    bad, per = [], 1  # documents kept together (a pair's two)
    if cfg.source == "preference":
        (docs, bad), per = _preference_documents(cfg, tokenizer), 2
    else:
        docs = _chat_documents(cfg, tokenizer) if cfg.source == "chat" else _text_documents(cfg, tokenizer)
    units = len(docs) // per
    if units < 2:
        what = "pair(s)" if per == 2 else "document(s)"
        raise ValueError(f"the corpus has {units} {what}; at least 2 are needed (one held out)")
    is_eval = np.random.default_rng(cfg.seed).random(units) < cfg.eval_fraction
    if not is_eval.any():
        is_eval[-1] = True
    if is_eval.all():
        is_eval[0] = False
    is_eval = np.repeat(is_eval, per)
    parts = {"train": ([], []), "eval": ([], [])}
    for (tokens, flags), held_out in zip(docs, is_eval, strict=True):
        parts["eval" if held_out else "train"][0].append(tokens)
        parts["eval" if held_out else "train"][1].append(flags)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    meta = {
        "documents": {},
        "tokens": {},
        "vocab_size": tokenizer.vocab_size,
        "bad_lines": {"count": len(bad), "first": bad[:20]},
    }
    for split, (tokens, flags) in parts.items():
        np.save(tmp / f"{split}.tokens.npy", np.concatenate(tokens).astype(dtype))
        np.save(tmp / f"{split}.flags.npy", np.concatenate(flags))
        meta["documents"][split] = len(tokens)
        meta["tokens"][split] = int(sum(len(t) for t in tokens))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(folder)  # atomic: a killed build leaves only a .tmp- folder, never half a store
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
