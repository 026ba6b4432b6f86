"""Speculative decoding: tokens/s with and without, acceptance rate (overall and by draft position),
tokens per target step, at batch 1 and 8, with n-gram drafts, (with --draft) a draft model and (with
--eagle) an EAGLE-3 head trained for the run.

    python bench/speculative.py [--run runs/default] [--windows 4 8] [--new-tokens 48] [--draft RUN]
    python bench/speculative.py --eagle runs/default-eagle3 --workload text --windows 4 --batches 1 8 32

--eagle HEAD: a head run folder (`python train.py draft.target=runs/default`) or an EAGLE-3 folder in
vLLM's layout. --workload text prompts with 32 tokens from a third of the way into stdlib files (no copy
to find: what a head is for); the default, copy, is described below.

--draft RUN: a run folder whose model (same tokenizer) drafts for --run's; --draft runs/default with
the default --run drafts with the target itself, the upper bound of acceptance at the draft's full cost.

The workload is copy-heavy: each prompt holds a passage of a stdlib file, a newline, and the passage's
first 8 tokens again, so a continuation that reproduces the passage is what n-gram lookup over the
prompt drafts. Whether the model continues that way is its own business; the script prints how far
greedy continuations follow the passage. The default run's model does not copy (it never learned
to). A model that does, trained by train.py on these very documents (it memorises them):

    python bench/speculative.py --write-corpus runs/copy64.jsonl         # 64 documents, for seq_len 128
    python train.py --run-dir runs/copy64 data.source=jsonl "data.paths=[runs/copy64.jsonl]" \
        data.eval_fraction=0.05 data.seed=3 training.steps=1000          # 6 min on 2 cores
    python bench/speculative.py --run runs/copy64

(data.seed=3 holds out documents 20 and 28, none of the 8 prompts used here.) A run trained on its own
files (data.source=files) is prompted with their first 16 tokens instead, the files' next tokens as
the reference: the issue's "code file continued from its start".

Greedy and sampled (--temperatures, default 0 and 0.7) rows; with the exact rule (the default) the output
is the same with and without speculation (tested in tests/test_speculative.py), so only the time differs.
`--rules exact standard` adds standard speculative sampling's rows (exact in distribution, not token for
token: `GeneratorConfig.spec_rule`):

    python bench/speculative.py --eagle runs/default-eagle3 --workload text --windows 4 --batches 1 \
        --no-ngram --rules exact standard --temperatures 0.7 1.0

Compare rows as ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import sysconfig
import time
from pathlib import Path

from jaxgen.config import load_config
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.inference.loading import load_model
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.speculative import RULES
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
HEAD = 8  # tokens of the copy in the prompt: the rest is to be reproduced


def room_for(length: int, new: int) -> int:
    """Tokens a prompt and its reference may take in a context of `length` with `new` tokens to make."""
    return length - new - 4


def passage_for(room: int) -> int:
    """The passage's tokens: a prompt of the passage, a newline and HEAD tokens of it fits in `room`."""
    return room * 4 // 5


def copy_documents(tok, count: int, passage: int) -> list[str]:
    """`count` copy-heavy texts: `passage` tokens of a stdlib file, a newline, the same again."""
    docs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = tok.encode(f.read_text(errors="replace"), special=False)
        if len(ids) >= 3 * passage:  # from a third of the way in: file headers are much alike
            text = tok.decode(ids[len(ids) // 3 :][:passage])
            docs.append(text + "\n" + text)
        if len(docs) == count:
            return docs
    raise SystemExit(f"fewer than {count} stdlib files of {3 * passage} tokens")


def workload(tok, data, count: int, room: int) -> tuple[list[list[int]], list[list[int]]]:
    """`count` prompts and what a copying continuation reproduces, within `room` tokens in all.

    A run trained on its own files (data.source=files): each prompt is the start of one of those files,
    and the file's next tokens are the reference (the model learned them). Otherwise: a copy document
    (`copy_documents`) cut HEAD tokens into the second copy; the rest of it is the reference."""
    if data.source == "files":
        files = sorted({Path(p) for g in data.paths for p in glob.glob(g, recursive=True)})
        starts = [tok.encode(f.read_text(errors="replace"), special=False)[:room] for f in files]
        pairs = [(ids[:16], ids[16:]) for ids in starts if len(ids) > 16]
    else:
        docs = [tok.encode(d, special=False) for d in copy_documents(tok, count, passage_for(room))]
        cuts = [len(ids) // 2 + 1 + HEAD for ids in docs]  # the passage, the newline, HEAD tokens of the copy
        pairs = [(ids[:c], ids[c:]) for ids, c in zip(docs, cuts, strict=True)]
    if len(pairs) < count:
        raise SystemExit(f"fewer than {count} usable files in {data.source}")
    return [p for p, _ in pairs[:count]], [r for _, r in pairs[:count]]


def write_corpus(path: Path, seq_len: int, new: int, count: int) -> None:
    """The copy documents as a JSONL corpus, to train a model that reproduces them (see the docstring)."""
    docs = copy_documents(Tokenizer.byte_level(), count, passage_for(room_for(seq_len, new)))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(f"wrote {len(docs)} documents to {path}")


def _copied(params, cfg, tok, prompts, refs, new: int) -> None:
    """How far the model's greedy continuations reproduce the references (what n-gram drafts can win)."""
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    outs = Generator(params, cfg, tok, GeneratorConfig(max_batch=len(prompts))).generate(prompts, greedy)
    same = [  # tokens until the continuation leaves the reference
        next((i for i, (a, b) in enumerate(zip(o.tokens, r, strict=False)) if a != b), len(o.tokens))
        for o, r in zip(outs, refs, strict=True)
    ]
    print(f"greedy continuations follow the reference for {sum(same) / len(same):.1f} of {new} tokens on average")
    print(f"e.g. {tok.decode(prompts[0][-24:])!r} -> {outs[0].text[:48]!r}\n")


def text_workload(tok, count: int, length: int = 32) -> list[list[int]]:
    """`count` prompts of `length` tokens from a third of the way into stdlib files (in the default run's
    training corpus: the text the model and its head were trained on)."""
    prompts = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = tok.encode(f.read_text(errors="replace"), special=False)
        if len(ids) >= 3 * length:
            prompts.append(ids[len(ids) // 3 :][:length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"fewer than {count} stdlib files of {3 * length} tokens")


def ab(gen: Generator, prompts, plain: SamplingConfig, fast: SamplingConfig, repeats: int) -> tuple:
    """tokens/s without and with speculation, each the best of `repeats` runs taken in turn (this
    machine's speed drifts between runs, so the two sides alternate), and the speculating runs' counts."""
    gen.generate(prompts, plain), gen.generate(prompts, fast)  # compiles
    best = {"plain": float("inf"), "fast": float("inf")}
    counts = {k: 0 for k in gen.speculation}
    for _ in range(repeats):
        for side, sampling in (("plain", plain), ("fast", fast)):
            before = dict(gen.speculation)
            t0 = time.perf_counter()
            outs = gen.generate(prompts, sampling)
            best[side] = min(best[side], time.perf_counter() - t0)
            if side == "fast":
                counts = {k: counts[k] + gen.speculation[k] - before[k] for k in counts}
    tokens = sum(len(o.tokens) for o in outs)
    return tokens / best["plain"], tokens / best["fast"], counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "default", help="a trained run folder")
    parser.add_argument("--windows", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens values")
    parser.add_argument("--new-tokens", type=int, default=48, help="at most half the run's data.seq_len")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft", type=Path, default=None, help="a run folder with a draft model")
    parser.add_argument("--eagle", type=Path, default=None, help="an EAGLE-3 head (a head run or a vLLM-layout folder)")
    parser.add_argument("--no-ngram", action="store_true", help="skip the n-gram drafter's rows")
    parser.add_argument("--no-gate", action="store_true", help="speculate in every chunk (spec_gate off)")
    parser.add_argument("--workload", choices=("copy", "text"), default="copy", help="copy-heavy or plain text prompts")
    parser.add_argument(
        "--rules",
        nargs="+",
        choices=RULES,
        default=["exact"],
        help="spec_rule values: exact (token for token) and/or standard (in distribution)",
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="0 = greedy")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each side, taken in turn")
    parser.add_argument("--write-corpus", type=Path, default=None, help="write copy documents as JSONL and exit")
    parser.add_argument("--corpus-docs", type=int, default=64, help="documents --write-corpus writes")
    parser.add_argument("--seq-len", type=int, default=128, help="the data.seq_len --write-corpus sizes them for")
    args = parser.parse_args()
    if args.write_corpus is not None:
        write_corpus(args.write_corpus, args.seq_len, min(args.new_tokens, args.seq_len // 2), args.corpus_docs)
        return
    cfg, tok, params = load_model(args.run)
    # the model learned positions up to its training length only: prompt and output stay within it
    data = load_config(args.run / "config.yaml").data
    trained = data.seq_len
    new = min(args.new_tokens, trained // 2)
    draft = None
    if args.draft is not None:
        draft_cfg, _, draft_params = load_model(args.draft)
        draft = (draft_params, draft_cfg)
    room = room_for(min(cfg.max_seq_len, trained), new)
    if args.workload == "text":
        prompts = text_workload(tok, max(8, *args.batches))
        print(f"{args.run}: prompts of {len(prompts[0])} tokens of stdlib text; {new} new tokens")
    else:
        prompts, refs = workload(tok, data, max(8, *args.batches), room)
        print(f"{args.run}: prompts of {len(prompts[0])} tokens; {new} new tokens")
        _copied(params, cfg, tok, prompts[:8], refs[:8], new)
    print(
        "| drafter | rule | window | batch | sampling | plain tok/s | speculative tok/s | speedup | acceptance "
        "| tokens / target step | kept drafts 1..i (share of steps) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    drafters = ([] if args.no_ngram else [("n-gram", None)]) + ([(f"model {args.draft.name}", draft)] if draft else [])
    if args.eagle is not None:
        head = _eagle(args.eagle, cfg, tok)
        drafters.append((f"eagle {args.eagle.name}", head))
        _sampled_acceptance(head, params, cfg, tok, load_config(args.run / "config.yaml"))
    for (drafter, d), rule, b in itertools.product(drafters, args.rules, args.batches):
        config = GeneratorConfig(max_batch=b, chunk_steps=16, spec_gate=not args.no_gate, spec_rule=rule)
        gen = Generator(params, cfg, tok, config, draft=d)
        for w, temp in itertools.product(args.windows, args.temperatures):
            name = "greedy" if temp == 0 else f"t={temp:g}"
            plain = SamplingConfig(temperature=temp, max_new_tokens=new, ignore_eos=True, seed=1)
            spec = dataclasses.replace(plain, num_speculative_tokens=w)
            base, fast, c = ab(gen, prompts[:b], plain, spec, args.repeats)
            rate = c["accepted"] / max(c["proposed"], 1)
            per_step = c["tokens"] / max(c["target_steps"], 1)
            at = " ".join(f"{n / max(c['target_steps'], 1):.2f}" for n in c["kept_at"][:w])
            print(
                f"| {drafter} | {rule} | {w} | {b} | {name} | {base:.1f} | {fast:.1f} | {fast / base:.2f}x "
                f"| {rate:.2f} | {per_step:.2f} | {at} |",
                flush=True,
            )


def _sampled_acceptance(head, params, cfg, tok, run_cfg) -> None:
    """The head's first draft on held-out text: kept by jaxgen's exact rule (greedy draft) against standard
    speculative sampling's expected acceptance (drafts drawn from the head), per temperature."""
    from jaxgen.training.data.pipeline import PackedSequences, eval_batches
    from jaxgen.training.data.tokens import load_splits
    from jaxgen.training.eagle import sampled_acceptance

    split = load_splits(run_cfg.data, tok)["eval"]
    held = eval_batches(PackedSequences(split["tokens"], split["flags"], run_cfg.data.seq_len), 8, 4)
    rows = sampled_acceptance(head, params, cfg, held, (0.7, 1.0))
    print("first draft kept on held-out text\n")
    print("| temperature | exact rule (greedy draft) | standard rule (sum min(p, q)) |")
    print("|---|---|---|")
    for t, (exact, standard) in rows.items():
        print(f"| {t} | {exact:.3f} | {standard:.3f} |")
    print()


def _eagle(path: Path, cfg, tok):
    """The EAGLE-3 head at `path`: a head run folder (head.json) or a folder in vLLM's layout."""
    if (path / "head.json").exists():
        from jaxgen.training.eagle import load_head

        return load_head(path)
    from jaxgen.hf import eagle3

    return eagle3.load(path, cfg, tok)


if __name__ == "__main__":
    main()
