"""Decoding's weight layout, A/B in one process: the same random weights decoded by two Generators,
one holding the matrix products' weights as trained, (I, O), the other output-major, (O, I)
(`jaxgen.model.layout`). Greedy, 32-token prompts, 128 new tokens, no early stop; tokens/s of the 127
steps after the first (a full run minus a one-token run), each side run in turn, best of --repeats.

    python bench/layout.py [--configs gpt2-124m llama-small] [--batches 1 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import load_config
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import layout
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def decode_rate(gen: Generator, prompts, new_tokens: int) -> float:
    def run(n):
        t0 = time.perf_counter()
        gen.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    full, one = run(new_tokens), run(1)
    return len(prompts) * (new_tokens - 1) / (full - one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["gpt2-124m", "llama-small"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| config | batch | (I, O) tok/s | (O, I) tok/s | ratio |")
    print("|---|---|---|---|---|")
    for name in args.configs:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml").model
        params = model.init_params(cfg, jax.random.key(0))
        for b in args.batches:
            prompts = np.random.default_rng(0).integers(0, 256, (b, 32)).tolist()
            sides = {}
            for label, rows in (("in", 1), ("out", layout.OUT_MAJOR_ROWS)):  # rows: what decode_params sees
                weights = model.decode_params(params, rows)
                gen = Generator(weights, cfg, Tokenizer.byte_level(), max_batch=b, chunk_steps=args.new_tokens)
                gen.params = weights  # as laid out here, whatever max_batch would choose
                decode_rate(gen, prompts, args.new_tokens)  # compiles
                sides[label] = gen
            best = {label: 0.0 for label in sides}
            for _ in range(args.repeats):
                for label, gen in sides.items():
                    best[label] = max(best[label], decode_rate(gen, prompts, args.new_tokens))
            ratio = best["out"] / best["in"]
            print(f"| {name} | {b} | {best['in']:.1f} | {best['out']:.1f} | {ratio:.2f}x |", flush=True)
            del sides


if __name__ == "__main__":
    main()
