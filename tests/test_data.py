import json
import subprocess
import sys

import numpy as np
import pytest

from jaxgen.config import DataConfig
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.data.pipeline import PackedSequences, pack_window, train_iterator
from jaxgen.training.data.sources import iter_documents, stdlib_files
from jaxgen.training.data.tokens import DOC_START, NO_LOSS, load_splits
from tests.conftest import ROOT


def test_byte_tokenizer_round_trips_any_text():
    tok = Tokenizer.byte_level()
    text = "def f(x):\n    return 'héllo' + \"\\t\" # ünïcode ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 257 and tok.eos_id == 256


def test_pack_window_segments_positions_and_loss_mask():
    # a 3-token tail of a document, then a 4-token document whose first 2 tokens are prompt
    tokens = np.array([10, 11, 12, 20, 21, 22, 23])
    flags = np.array([0, 0, 0, DOC_START | NO_LOSS, NO_LOSS, 0, 0], np.uint8)
    ex = pack_window(tokens, flags)
    np.testing.assert_array_equal(ex["inputs"], [10, 11, 12, 20, 21, 22])
    np.testing.assert_array_equal(ex["targets"], [11, 12, 20, 21, 22, 23])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 0, 1, 2])
    # no loss across the boundary (12 -> 20) nor on predicting prompt tokens (20 -> 21)
    np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 0, 0, 1, 1])


def test_stdlib_corpus_is_this_interpreters_source():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "argparse.py", "dataclasses.py"} <= names
    assert not any("site-packages" in str(f) or "/test/" in str(f) for f in files)


def test_jsonl_prompt_response_masks_the_prompt(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"q": f"question {i}?", "a": f"answer {i}."} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(
        source="jsonl", paths=(str(path),), prompt_field="q", response_field="a", seq_len=8,
        eval_fraction=0.2, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    tok = Tokenizer.byte_level()
    splits = load_splits(cfg, tok)
    tokens = np.concatenate([splits[s]["tokens"] for s in ("train", "eval")])
    flags = np.concatenate([splits[s]["flags"] for s in ("train", "eval")])
    assert (flags & DOC_START).sum() == 6
    trained = tok.decode(tokens[(flags & NO_LOSS) == 0])
    assert "answer" in trained and "question" not in trained


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "oops"}\n')
    cfg = DataConfig(source="jsonl", paths=(str(path),))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'text' missing or not a string; keys: \['txt'\]"):
        list(iter_documents(cfg))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(iter_documents(DataConfig(source="files", paths=(str(tmp_path / "*.md"),))))


def test_token_store_is_built_once_and_memory_mapped(tmp_path):
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 20)
    cfg = DataConfig(source="files", paths=(str(tmp_path / "*.txt"),), cache_dir=str(tmp_path / "c"), eval_fraction=0.2)
    tok = Tokenizer.byte_level()
    first = load_splits(cfg, tok)
    assert isinstance(first["train"]["tokens"], np.memmap)
    stores = list((tmp_path / "c").iterdir())
    assert len(stores) == 1
    mtime = (stores[0] / "train.tokens.npy").stat().st_mtime_ns
    load_splits(cfg, tok)
    assert (stores[0] / "train.tokens.npy").stat().st_mtime_ns == mtime  # read back, not rebuilt
    total = sum(len(first[s]["tokens"]) for s in ("train", "eval"))
    assert total == 5 * (len("document number 0 " * 20) + 1)  # + end-of-text per document
    assert len(first["eval"]["tokens"]) > 0


def ten_documents() -> PackedSequences:
    """1000 tokens in 10 documents, packed 16 to an example (62 examples)."""
    tokens = np.arange(1000, dtype=np.uint16) % 250
    flags = np.zeros(1000, np.uint8)
    flags[::100] = DOC_START
    return PackedSequences(tokens, flags, seq_len=16)


def test_iterator_is_deterministic_and_resumable():
    src = ten_documents()
    it = train_iterator(src, batch_size=4, seed=3)
    seen = [next(it)["inputs"] for _ in range(5)]
    state = it.get_state()
    rest = [next(it)["inputs"] for _ in range(20)]  # crosses an epoch boundary (62 examples)
    again = train_iterator(src, batch_size=4, seed=3)
    np.testing.assert_array_equal(next(again)["inputs"], seen[0])
    again.set_state(state)
    for a, b in zip(rest, (next(again)["inputs"] for _ in range(20))):
        np.testing.assert_array_equal(a, b)
    other = train_iterator(src, batch_size=4, seed=4)
    assert not np.array_equal(next(other)["inputs"], seen[0])


def test_process_shares_of_each_batch_make_the_global_batch_at_any_position():
    """What several processes load: each its rows of every global batch, and the same iterator state."""
    src = ten_documents()
    whole = train_iterator(src, batch_size=8, seed=3)
    shares = [train_iterator(src, batch_size=8, seed=3, rows=slice(i * 2, i * 2 + 2)) for i in range(4)]
    for _ in range(10):  # crosses an epoch boundary (62 examples)
        got = np.concatenate([next(it)["inputs"] for it in shares])
        np.testing.assert_array_equal(got, next(whole)["inputs"])
    state = whole.get_state()
    assert all(it.get_state() == state for it in shares)  # restores into any number of processes
    resumed = train_iterator(src, batch_size=8, seed=3, rows=slice(4, 6))
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["inputs"], next(whole)["inputs"][4:6])


def test_bpe_tokenizer_command(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = tmp_path / "bpe" / "tokenizer.json"
    proc = subprocess.run(
        [sys.executable, "train_tokenizer.py", "--vocab-size", "300", "--out", str(out),
         "data.source=files", f"data.paths=[{corpus}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_file(out)
    assert 257 < tok.vocab_size <= 300
    ids = tok.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox")  # merges learned
    assert tok.decode(ids) == "the quick brown fox"
