"""The mixture-of-experts layer's dispatches against each other: time per call, forward and forward +
backward, at decode and training token counts.

    python bench/moe.py [--d-model 512] [--d-ff 1024] [--experts 8] [--top-k 2] [--tokens 1 8 32 512 2048]

grouped runs only the (token, expert) pairs the router chose (about k / E of dense's expert FLOPs plus
padding to whole tiles); dense runs every expert on every token (the reference); ragged_dot is
jax.lax.ragged_dot, a kernel on GPU and TPU but dense under a mask on XLA:CPU. Ratios are dense time /
grouped time (higher: grouped is faster), measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from timing import best_seconds  # bench/, this script's folder

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.model import moe

IMPLS = ("grouped", "dense", "ragged_dot")


def bench(cfg: ModelConfig, tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    p = jax.tree.map(lambda w: w[0], model.init_params(cfg, jax.random.key(0))["layers"]["mlp"])
    x = jax.random.normal(jax.random.key(1), (1, tokens, cfg.d_model))
    valid = jnp.ones((1, tokens), bool)
    out = {}
    for impl in IMPLS:
        c = dataclasses.replace(cfg, moe_impl=impl)
        fwd = jax.jit(lambda p, x, c=c: moe.mlp(x, p, valid, c)[0])
        grad = jax.jit(jax.grad(lambda p, x, c=c: jnp.sum(moe.mlp(x, p, valid, c)[0] ** 2)))
        out[impl] = (best_seconds(lambda f=fwd: f(p, x), repeats), best_seconds(lambda g=grad: g(p, x), repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = ModelConfig(
        d_model=args.d_model, num_heads=8, d_ff=args.d_ff, num_experts=args.experts, experts_per_token=args.top_k
    )
    print(f"MoE layer, D={cfg.d_model} F={cfg.d_ff} E={cfg.num_experts} k={cfg.experts_per_token}, float32, "
          f"{jax.default_backend()}, best of {args.repeats} (ms)")  # fmt: skip
    head = f"{'tokens':>7}" + "".join(f"{impl + ' fwd':>16}{impl + ' f+b':>16}" for impl in IMPLS)
    print(head + f"{'dense/grouped fwd':>19}{'f+b':>7}")
    for n in args.tokens:
        r = bench(cfg, n, args.repeats)
        cells = "".join(f"{r[i][0] * 1e3:>16.2f}{r[i][1] * 1e3:>16.2f}" for i in IMPLS)
        ratios = f"{r['dense'][0] / r['grouped'][0]:>18.2f}x{r['dense'][1] / r['grouped'][1]:>6.2f}x"
        print(f"{n:>7}{cells}{ratios}", flush=True)


if __name__ == "__main__":
    main()
