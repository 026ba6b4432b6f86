"""Where documents come from: the Python standard library, text files, JSONL records, or chat JSONL."""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jaxgen.config import DataConfig
from jaxgen.training.data.chat import read_conversations

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Document:
    text: str  # trained on
    prompt: str = ""  # context only (fine-tuning): no loss on these tokens


def stdlib_files() -> list[Path]:
    """The running interpreter's own standard-library sources (tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def resolve_paths(cfg: DataConfig) -> list[Path]:
    """The files a data config reads, in a fixed order; an error if a glob matches nothing."""
    if cfg.source == "stdlib":
        return stdlib_files()
    paths = []
    for pattern in cfg.paths:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise FileNotFoundError(f"data.paths entry {pattern!r} matches no file")
        paths += [Path(p) for p in matched if Path(p).is_file()]
    return paths


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    for path in resolve_paths(cfg):
        if cfg.source == "jsonl":
            yield from _jsonl_documents(path, cfg)
        elif cfg.source == "chat":  # the messages' text (train_tokenizer.py); training renders them (chat.py)
            yield from (Document("\n".join(m["content"] or "" for m in c.messages)) for c in read_conversations(path))
        else:
            yield Document(path.read_text(encoding="utf-8", errors="replace"))


def jsonl_records(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSONL file; ValueError naming file and line
    for a line that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e


def _jsonl_documents(path: Path, cfg: DataConfig) -> Iterator[Document]:
    for lineno, record in jsonl_records(path):
        fields = [cfg.prompt_field, cfg.response_field] if cfg.prompt_field else [cfg.text_field]
        missing = [k for k in fields if not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{lineno}: field {missing[0]!r} missing or not a string; keys: {sorted(record)}")
        if cfg.prompt_field:
            yield Document(record[cfg.response_field], prompt=record[cfg.prompt_field])
        else:
            yield Document(record[cfg.text_field])
