"""Outputs of every generation path on a fixed tiny model, written down to compare two trees of jaxgen
(a refactor's before and after): tokens must be equal, log-probabilities equal to float32 rounding
(1e-4: an int8 cache's scales round too).

    python bench/same_outputs.py --out after.json                   # run the paths, write their outputs
    PYTHONPATH=/tmp/before python bench/same_outputs.py --out before.json   # the same on another tree
    python bench/same_outputs.py --compare before.json after.json   # a table: case, tokens, max |dlogp|

Paths: the Generator (contiguous cache: greedy ragged prompts, sampled n=2 with penalties and alternatives,
int8 cache, n-gram speculation, a regex constraint), and the engine (paged cache: the same settings, prefill
in small chunks, preemption under a pool too small for all, int8 cache, speculation, a regex constraint, two
LoRA adapters and the base model in one batch).
Random weights scaled up (sharp logits: no near-ties in argmax). Reads only APIs both trees share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import LoraConfig, ModelConfig, ServeConfig
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

try:
    from jaxgen.inference.structured import Structured
except ImportError:  # trees before structured output became a package
    from jaxgen.inference.grammar import Structured

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128)
PROMPTS = [list(range(10, 30)), list(range(50, 62)), list(range(100, 141)), list(range(3, 20)), [7, 8, 9]]
GREEDY = SamplingConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=5, n=2, top_p=0.9, repetition_penalty=1.3,
                         presence_penalty=0.4, frequency_penalty=0.2, ignore_eos=True, logprobs=2)  # fmt: skip
SPECULATIVE = dataclasses.replace(GREEDY, num_speculative_tokens=3, logprobs=0)
REGEX = SamplingConfig(max_new_tokens=12, temperature=0.0, structured=Structured(regex=r"[a-f]{3}-[0-9]{2,4}"))
# ([0-9], not \d: since issue 44 \d is ASCII, before it a Unicode class)
SETTINGS = {"greedy": GREEDY, "sampled": SAMPLED, "speculative": SPECULATIVE, "regex": REGEX}


def _params():
    p = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, p)


def _adapter(seed: int, rank: int, targets: tuple[str, ...]) -> tuple[dict, float]:
    """Random LoRA factors of `lora_specs`' shapes (B nonzero: the adapter changes the outputs), its scale."""
    from jaxgen.model import lora

    cfg = dataclasses.replace(CFG, lora=LoraConfig(rank=rank, alpha=16.0, targets=targets))
    rng = np.random.default_rng(seed)
    draw = lambda k, shape: rng.uniform(-0.2, 0.2, shape) if k.startswith("a") else rng.normal(0, 0.05, shape)
    specs = lora.lora_specs(cfg)
    factors = {t: {k: draw(k, s.shape).astype(np.float32) for k, s in pair.items()} for t, pair in specs.items()}
    return factors, cfg.lora.scale


def _record(completions) -> dict:
    return {"tokens": [list(map(int, c.tokens)) for c in completions],
            "logprobs": [[float(x) for x in c.logprobs] for c in completions]}  # fmt: skip


def run() -> dict:
    from jaxgen.inference.engine import Engine

    params, tok, out = _params(), Tokenizer.byte_level(), {}
    for cache in ("float32", "int8"):
        gen = Generator(params, CFG, tok, max_batch=len(PROMPTS), cache_dtype=cache)
        for name, s in SETTINGS.items():
            if cache == "int8" and name != "greedy":
                continue
            out[f"generator/{cache}/{name}"] = _record(gen.generate(PROMPTS, s))
    serves = {
        "engine/chunked": ServeConfig(slots=4, page_size=16, num_pages=64, chunk_steps=4, prefill_chunk=16),
        "engine/preempted": ServeConfig(slots=4, page_size=8, num_pages=14, chunk_steps=4, prefill_chunk=32),
        "engine/int8": ServeConfig(slots=4, page_size=16, num_pages=64, chunk_steps=4, cache_dtype="int8"),
        "engine/multi-lora": ServeConfig(slots=4, page_size=16, num_pages=64, chunk_steps=4, max_loras=2,
                                         max_lora_rank=4),
    }  # fmt: skip
    for where, serve in serves.items():
        engine = Engine(params, CFG, tok, serve)
        try:
            if serve.max_loras:  # each prompt with one of two adapters or the base model, in one batch
                engine.load_lora("a", *_adapter(1, 2, ("q", "v")))
                engine.load_lora("b", *_adapter(2, 4, ("q", "k", "v", "o", "gate", "up", "down")))
                loras = ["a", None, "b", "a", "b"]
                out[f"{where}/greedy"] = _record(engine.generate(PROMPTS, GREEDY, lora=loras))
                out[f"{where}/sampled"] = _record(engine.generate(PROMPTS, SAMPLED, lora=loras))
                continue
            for name, s in SETTINGS.items():
                if where != "engine/chunked" and name not in ("greedy", "sampled"):
                    continue
                out[f"{where}/{name}"] = _record(engine.generate(PROMPTS, s))
            print(f"{where}: {engine.stats.value('requests_preempted'):.0f} preemptions", file=sys.stderr)
        finally:
            engine.stop()
    return out


def compare(a: dict, b: dict) -> bool:
    print(f"{'case':<34} {'tokens':>8} {'max |dlogp|':>12}")
    ok = True
    for case in sorted(a.keys() | b.keys()):
        if case not in a or case not in b:
            print(f"{case:<34} {'missing in ' + ('first' if case not in a else 'second'):>21}")
            ok = False
            continue
        same = a[case]["tokens"] == b[case]["tokens"]
        pairs = zip(a[case]["logprobs"], b[case]["logprobs"], strict=True)
        d = max((abs(x - y) for p, q in pairs for x, y in zip(p, q, strict=True)), default=0.0)
        ok &= same and d <= 1e-4  # float32 rounding, through an int8 cache's dequantization
        print(f"{case:<34} {'equal' if same else 'DIFFER':>8} {d:>12.2e}")
    print("all equal" if ok else "NOT all equal")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write this tree's outputs here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two outputs files")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        return 0 if compare(a, b) else 1
    if not args.out:
        parser.error("give --out FILE or --compare A B")
    outputs = run()
    Path(args.out).write_text(json.dumps(outputs))
    print(f"{len(outputs)} cases written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
