"""Speculative decoding: tokens/s with and without, acceptance rate, tokens per target step, at batch
1 and 8, with n-gram drafts and (with --draft) a draft model.

    python bench/speculative.py [--run runs/default] [--window 4] [--new-tokens 96] [--draft RUN]

--draft RUN: a run folder whose model (same tokenizer) drafts for --run's; --draft runs/default with
the default --run drafts with the target itself, the upper bound of acceptance at the draft's full cost.

The workload is copy-heavy: each prompt is a passage of a Python standard-library file followed by the
start of the same passage again, so a model that learned to copy (the one `python train.py` trains, on
those files) continues by reproducing it, and n-gram lookup over the prompt finds the drafts. Greedy and
sampled (temperature 0.7) rows; the output is the same with and without speculation (tested in
tests/test_speculative.py), so only the time differs. Compare rows as ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sysconfig
import time
from pathlib import Path

from jaxgen.config import load_config
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.training.checkpoint import load_model

ROOT = Path(__file__).resolve().parent.parent


def copy_prompts(tok, count: int, passage: int, again: int) -> list[list[int]]:
    """`count` prompts: `passage` tokens of a stdlib file, a newline, then its first `again` tokens."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    for f in files:
        ids = tok.encode(f.read_text(errors="replace"), special=False)
        if len(ids) >= passage:
            out.append(ids[:passage] + tok.encode("\n", special=False) + ids[:again])
        if len(out) == count:
            return out
    raise SystemExit("not enough stdlib files")


def _copied(params, cfg, tok, passage: int, new: int, count: int = 8) -> None:
    """How far the model's greedy continuation reproduces the passage (what n-gram drafts can win)."""
    prompts = copy_prompts(tok, count, passage, passage // 4)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    outs = Generator(params, cfg, tok, GeneratorConfig(max_batch=count)).generate(prompts, greedy)
    again = passage // 4
    same = [  # tokens until the continuation leaves the passage (whose next tokens follow its first `again`)
        next((i for i, (a, b) in enumerate(zip(o.tokens, p[again:passage], strict=False)) if a != b), len(o.tokens))
        for o, p in zip(outs, prompts, strict=True)
    ]
    print(f"greedy continuations follow the passage for {sum(same) / count:.1f} of {new} tokens on average")
    print(f"e.g. {tok.decode(prompts[0][-24:])!r} -> {outs[0].text[:48]!r}\n")


def run(gen: Generator, prompts, sampling: SamplingConfig, repeats: int = 2) -> tuple[float, dict]:
    gen.generate(prompts, sampling)  # compiles
    before = dict(gen.speculation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = gen.generate(prompts, sampling)
        best = min(best, time.perf_counter() - t0)
    tokens = sum(len(o.tokens) for o in outs)
    delta = {k: (gen.speculation[k] - before[k]) / repeats for k in before}
    return tokens / best, delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "default", help="a trained run folder")
    parser.add_argument("--window", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="at most half the run's data.seq_len")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft", type=Path, default=None, help="a run folder with a draft model")
    args = parser.parse_args()
    cfg, tok, params = load_model(args.run)
    # the model learned positions up to its training length only: prompt and output stay within it
    trained = load_config(args.run / "config.yaml").data.seq_len
    new = min(args.new_tokens, trained // 2)
    draft = None
    if args.draft is not None:
        draft_cfg, _, draft_params = load_model(args.draft)
        draft = (draft_params, draft_cfg)
    passage = (min(cfg.max_seq_len, trained) - new - 4) * 4 // 5
    print(f"{args.run}: prompts of {passage} tokens + the first {passage // 4} again; {new} new tokens")
    _copied(params, cfg, tok, passage, new)
    print(
        "| drafter | batch | sampling | plain tok/s | speculative tok/s | speedup | acceptance | tokens / target step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    drafters = [("n-gram", None)] + ([(f"model {args.draft.name}", draft)] if draft else [])
    for (drafter, d), b in itertools.product(drafters, args.batches):
        prompts = copy_prompts(tok, b, passage, passage // 4)
        gen = Generator(params, cfg, tok, GeneratorConfig(max_batch=b, chunk_steps=new), draft=d)
        for name, temp in (("greedy", 0.0), ("t=0.7", 0.7)):
            plain = SamplingConfig(temperature=temp, max_new_tokens=new, ignore_eos=True, seed=1)
            base, _ = run(gen, prompts, plain)
            fast, c = run(gen, prompts, dataclasses.replace(plain, num_speculative_tokens=args.window))
            rate = c["accepted"] / max(c["proposed"], 1)
            per_step = c["tokens"] / max(c["target_steps"], 1)
            print(
                f"| {drafter} | {b} | {name} | {base:.1f} | {fast:.1f} | {fast / base:.2f}x | {rate:.2f} "
                f"| {per_step:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
