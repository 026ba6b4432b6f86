"""How a decode step's cached attention should lay out keys and run its two products, by measurement.

    python bench/attention_layout.py [--configs gpt2-124m llama-small] [--batches 1 8 32] [--repeats 10]

One decode step's attention as the model runs it: 12 layers chained (each layer's output feeds the
next layer's queries, so XLA cannot overlap or drop them), two cache blocks per layer folded by the
online softmax. Three ways of running each block's products, timed in turns, best of --repeats:

    keys (S, H)      einsum over keys stored as values are (the layout before keys went (H, S))
    keys (H, S)      einsum over keys stored (H, S), as `KVCache` stores them
    as sums          keys (H, S), both products written out as sums of broadcast products
                     (`kernels.cpu.scores_as_sums`, `kernels.cpu.values_as_sums`)

"picked" is what `kernels.cpu.products_as_sums` chooses for that shape on this backend. Random float32
data; the model's shapes (batch, kv heads, query groups, head dim) and a block of --block slots.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import load_config
from jaxgen.model.kernels import cpu

ROOT = Path(__file__).resolve().parent.parent
LAYERS, BLOCKS = 12, 2


def _scores(kind):
    if kind == "keys (S, H)":
        return lambda q, k: jnp.einsum("btkgh,bksh->bkgts", q, k)
    if kind == "keys (H, S)":
        return lambda q, k: jnp.einsum("btkgh,bkhs->bkgts", q, k)
    return cpu.scores_as_sums


def _values(kind):
    return cpu.values_as_sums if kind == "as sums" else lambda p, v: jnp.einsum("bkgts,bksh->bkgth", p, v)


def chained(kind: str):
    """A jitted 12-layer chain of one step's blocks: q (B, 1, K, G, H), keys and values per block."""
    scores, values = _scores(kind), _values(kind)

    @jax.jit
    def run(q, keys, values_):
        for layer in range(LAYERS):
            b, _, kv_heads, g, _ = q.shape
            m = jnp.full((b, kv_heads, g, 1), -1e30)  # running max, (B, K, G, T = 1)
            l, acc = jnp.zeros_like(m), jnp.zeros((*m.shape, q.shape[-1]))
            for j in range(BLOCKS):
                k, v = keys[BLOCKS * layer + j], values_[BLOCKS * layer + j]
                s = scores(q, k) * 0.125
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                acc = acc * corr[..., None] + values(p, v)
                l, m = l * corr + p.sum(-1), m_new
            out = acc / l[..., None]  # (B, K, G, 1, H)
            q = q + 0.1 * jnp.moveaxis(out, 3, 1)
        return q

    return run


def bench_shape(name: str, b: int, block: int, repeats: int) -> None:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml").model
    k_heads, g, h = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_size
    rng = np.random.default_rng(0)
    keys_sh = [jnp.asarray(rng.standard_normal((b, k_heads, block, h), np.float32)) for _ in range(LAYERS * BLOCKS)]
    keys_hs = [jnp.swapaxes(k, 2, 3).copy() for k in keys_sh]
    values = [jnp.asarray(rng.standard_normal((b, k_heads, block, h), np.float32)) for _ in range(LAYERS * BLOCKS)]
    q = jnp.asarray(rng.standard_normal((b, 1, k_heads, g, h), np.float32))
    kinds = {"keys (S, H)": keys_sh, "keys (H, S)": keys_hs, "as sums": keys_hs}
    runs = {kind: chained(kind) for kind in kinds}
    ref = np.asarray(runs["keys (S, H)"](q, keys_sh, values))
    for kind, run in runs.items():  # compile, and check the three agree
        np.testing.assert_allclose(np.asarray(run(q, kinds[kind], values)), ref, rtol=1e-4, atol=1e-4)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):  # in turns, so a slow spell does not fall on one side
        for kind, run in runs.items():
            t0 = time.perf_counter()
            run(q, kinds[kind], values).block_until_ready()
            best[kind] = min(best[kind], time.perf_counter() - t0)
    picked = "as sums" if cpu.products_as_sums(q) else "keys (H, S)"
    cells = "".join(f"{best[kind] * 1e3:>14.2f}" for kind in runs)
    print(f"{name:>12}{b:>6}{k_heads:>4}{g:>4}{h:>4}{cells}   {picked}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["gpt2-124m", "llama-small"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--block", type=int, default=64, help="slots per cache block (default 64, KVCache's)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    kinds = ("keys (S, H)", "keys (H, S)", "as sums")
    print(f"ms for {LAYERS} layers x {BLOCKS} blocks of {args.block} slots, best of {args.repeats}")
    print(f"{'config':>12}{'batch':>6}{'K':>4}{'G':>4}{'H':>4}" + "".join(f"{k:>14}" for k in kinds) + "   picked")
    for name in args.configs:
        for b in args.batches:
            bench_shape(name, b, args.block, args.repeats)


if __name__ == "__main__":
    main()
