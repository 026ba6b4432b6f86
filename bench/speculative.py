"""Speculative decoding: tokens/s with and without, acceptance rate, tokens per target step, at batch
1 and 8, with n-gram drafts and (with --draft) a draft model.

    python bench/speculative.py [--run runs/default] [--window 4] [--new-tokens 96] [--draft RUN]

--draft RUN: a run folder whose model (same tokenizer) drafts for --run's; --draft runs/default with
the default --run drafts with the target itself, the upper bound of acceptance at the draft's full cost.

The workload is copy-heavy, in one of two ways, by what the run trained on:
- the standard library (the default run): each prompt is a passage of a stdlib file, a newline, then
  the passage's first quarter again, so a model that copies continues by reproducing the passage and
  n-gram lookup over the prompt finds the drafts;
- its own files (data.source=files): each prompt is the start of one of them, continued by a model that
  memorised them (the issue's "code file continued from its start"), e.g. eleven small stdlib files:
      python train.py --run-dir runs/copy data.source=files "data.paths=[$LIB/bisect.py,...]" \
          data.eval_fraction=0.1 training.steps=720
The script prints how far greedy continuations follow the reference text. Greedy and sampled
(temperature 0.7) rows; the output is the same with and without speculation (tested in
tests/test_speculative.py), so only the time differs. Compare rows as ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import sysconfig
import time
from pathlib import Path

from jaxgen.config import load_config
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.training.checkpoint import load_model

ROOT = Path(__file__).resolve().parent.parent


def workload(tok, data, count: int, room: int) -> tuple[list[list[int]], list[list[int]]]:
    """`count` prompts and what a copying continuation reproduces, within `room` tokens in all.

    A run trained on its own files (data.source=files): each prompt is the start of one of those files,
    and the file's next tokens are the reference (the model learned them). Otherwise (the standard
    library): a passage of a file, a newline, then the passage's first quarter again; the rest of the
    passage is the reference."""
    if data.source == "files":
        files = sorted({Path(p) for g in data.paths for p in glob.glob(g, recursive=True)})
        head = 16
    else:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        passage = room * 4 // 5
        head = passage // 4
    prompts, refs = [], []
    for f in files:
        ids = tok.encode(f.read_text(errors="replace"), special=False)
        if data.source == "files":
            prompts.append(ids[:head])
            refs.append(ids[head:room])
        elif len(ids) >= passage:
            prompts.append(ids[:passage] + tok.encode("\n", special=False) + ids[:head])
            refs.append(ids[head:passage])
        if len(prompts) == count:
            return prompts, refs
    raise SystemExit(f"fewer than {count} usable files in {data.source}")


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
    parser.add_argument("--window", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="at most half the run's data.seq_len")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft", type=Path, default=None, help="a run folder with a draft model")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each side, taken in turn")
    args = parser.parse_args()
    cfg, tok, params = load_model(args.run)
    # the model learned positions up to its training length only: prompt and output stay within it
    data = load_config(args.run / "config.yaml").data
    trained = data.seq_len
    new = min(args.new_tokens, trained // 2)
    draft = None
    if args.draft is not None:
        draft_cfg, _, draft_params = load_model(args.draft)
        draft = (draft_params, draft_cfg)
    room = min(cfg.max_seq_len, trained) - new - 4
    prompts, refs = workload(tok, data, max(8, *args.batches), room)
    print(f"{args.run}: prompts of {len(prompts[0])} tokens; {new} new tokens")
    _copied(params, cfg, tok, prompts[:8], refs[:8], new)
    print(
        "| drafter | batch | sampling | plain tok/s | speculative tok/s | speedup | acceptance | tokens / target step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    drafters = [("n-gram", None)] + ([(f"model {args.draft.name}", draft)] if draft else [])
    for (drafter, d), b in itertools.product(drafters, args.batches):
        gen = Generator(params, cfg, tok, GeneratorConfig(max_batch=b, chunk_steps=new), draft=d)
        for name, temp in (("greedy", 0.0), ("t=0.7", 0.7)):
            plain = SamplingConfig(temperature=temp, max_new_tokens=new, ignore_eos=True, seed=1)
            spec = dataclasses.replace(plain, num_speculative_tokens=args.window)
            base, fast, c = ab(gen, prompts[:b], plain, spec, args.repeats)
            rate = c["accepted"] / max(c["proposed"], 1)
            per_step = c["tokens"] / max(c["target_steps"], 1)
            print(
                f"| {drafter} | {b} | {name} | {base:.1f} | {fast:.1f} | {fast / base:.2f}x | {rate:.2f} "
                f"| {per_step:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
