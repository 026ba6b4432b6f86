"""int8 inference: bytes held, decode step time and held-out perplexity for float32, bfloat16 and int8
weights and an int8 KV cache.

    python bench/quantize.py [--configs gpt2-124m llama-small] [--batches 1 8 32] [--run runs/default]

Step times use random weights of each config's shapes (the Generator's decode loop, greedy, 32 new tokens
after 32-token prompts; a step = (time for 32 tokens - time for 1) / 31). Perplexity needs a trained
model: `--run` (default runs/default, what `python train.py` writes; skipped when absent), scored on a
held-out text (this repository's README: not in the training corpus) with `Generator.score_shared`, so
the continuation reads the prompt's KV cache and its own. Compare rows as ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import load_config
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import quant
from jaxgen.model.kvcache import cache_memory_bytes
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
NEW = 32
# name: (weights, KV cache dtype)
VARIANTS = {
    "float32": ("float32", "float32"),
    "bfloat16 weights": ("bfloat16", "float32"),
    "int8 weights": ("int8", "float32"),
    "int8 weights + head": ("int8e", "float32"),  # the embedding and the head too (serve.quantize_embedding)
    "int8 KV": ("float32", "int8"),
    "int8 weights + KV": ("int8", "int8"),
}


def variant(params, cfg, weights: str):
    """(params, cfg) holding the weights as `weights` (int8e: int8 with the embedding and head too)."""
    if weights == "bfloat16":
        return jax.tree.map(lambda x: x.astype("bfloat16"), params), dataclasses.replace(cfg, dtype="bfloat16")
    if weights in ("int8", "int8e"):
        return quant.quantize_params(params, embedding=weights == "int8e"), cfg
    return params, cfg


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def step_times(params, cfg, cache_dtype: str, batches: list[int]) -> list[float]:
    rng = np.random.default_rng(0)
    gen = Generator(params, cfg, Tokenizer.byte_level(), GeneratorConfig(max_batch=max(batches), chunk_steps=NEW,
                                                                          cache_dtype=cache_dtype))  # fmt: skip
    full = SamplingConfig(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    one = dataclasses.replace(full, max_new_tokens=1)
    out = []
    for b in batches:
        prompts = [rng.integers(0, 256, 32).tolist() for _ in range(b)]
        gen.generate(prompts, full)  # compiles
        t_full = min(_timed(gen.generate, prompts, full) for _ in range(2))
        t_one = min(_timed(gen.generate, prompts, one) for _ in range(2))
        out.append((t_full - t_one) / (NEW - 1))
    return out


def speed_table(name: str, batches: list[int]) -> None:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml").model
    params = model.unstack_layers(model.init_params(cfg, jax.random.key(0)))
    kv_len = 256
    print(f"\n{name} (random weights): KV bytes for 32 sequences x {kv_len} tokens")
    cols = "".join(f"{f'b={b} ms':>10}" for b in batches)
    print(f"{'variant':<20}{'weights MB':>11}{'KV MB':>8}{cols}{'b=1 vs f32':>11}")
    base = None
    for label, (weights, kv) in VARIANTS.items():
        p, c = variant(params, cfg, weights)
        times = step_times(p, c, kv, batches)
        base = base or times[0]
        kv_mb = cache_memory_bytes(cfg, 32, kv_len, kv) / 1e6
        row = "".join(f"{t * 1e3:>10.2f}" for t in times)
        print(f"{label:<20}{quant.weight_bytes(p) / 1e6:>11.1f}{kv_mb:>8.1f}{row}{base / times[0]:>10.2f}x", flush=True)


def perplexity_table(run: Path) -> None:
    from jaxgen.inference.loading import load_model

    cfg, tok, params = load_model(run)
    text = (ROOT / "README.md").read_text()
    ids = tok.encode(text, special=False)
    n = cfg.max_seq_len // 2
    pieces = [ids[i : i + cfg.max_seq_len] for i in range(0, len(ids) - cfg.max_seq_len, cfg.max_seq_len)][:32]
    prompts, rests = [p[:n] for p in pieces], [p[n:] for p in pieces]
    print(f"\n{run}: held-out perplexity, {len(pieces)} README passages, {n} prompt + {n} scored tokens each")
    print(f"{'variant':<32}{'perplexity':>11}{'vs float32':>11}{'greedy agreement':>18}")
    base, base_tokens = None, None
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    for label, (weights, kv) in VARIANTS.items():
        p, c = variant(params, cfg, weights)
        gen = Generator(p, c, tok, GeneratorConfig(max_batch=32, cache_dtype=kv))
        scores = gen.score_shared(prompts, rests)
        ppl = float(np.exp(np.mean([s["nll"] for s in scores])))
        tokens = [o.tokens for o in gen.generate(prompts[:8], greedy)]
        base, base_tokens = base or ppl, base_tokens or tokens
        agree = np.mean([_agreement(a, b) for a, b in zip(tokens, base_tokens, strict=True)])
        print(f"{label:<32}{ppl:>11.3f}{(ppl / base - 1) * 100:>10.2f}%{agree:>12.1f} of 64", flush=True)


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens until two greedy continuations first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["gpt2-124m", "llama-small"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "default", help="a trained run folder")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    if (args.run / "config.yaml").exists():
        perplexity_table(args.run)
    else:
        print(f"\n{args.run} has no run: `python train.py` writes one (perplexity table skipped)")
    for name in args.configs:
        speed_table(name, args.batches)


if __name__ == "__main__":
    main()
