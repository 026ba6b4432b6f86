"""The sampling part of a decode step alone: `decode.decode_loop` with the model's forward replaced by
fixed logits, at the engine's buffer width for top alternatives, for a batch where no row asks for
alternatives or penalties and one where a row does.

    python bench/sampling_step.py [--vocab 384 32768] [--batches 1 64] [--steps 64] [--repeats 7]

Process CPU time, best of `--repeats` (the machine may be shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import MAX_STOPS, DecodeState, decode_loop
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig
from jaxgen.model.kvcache import KVCache


def fixed_forward(params, tokens_bt, positions_bt, cache, cfg):
    """Logits that depend on the token fed (so nothing is loop-invariant), and the cache unchanged."""
    logits = params["logits_v"][None, None] + 0.01 * jax.nn.one_hot(tokens_bt, cfg.vocab_size)
    return logits, cache


def state(cfg: ModelConfig, configs, columns: int, alternatives: int) -> DecodeState:
    b, v = len(configs), cfg.vocab_size
    return DecodeState(
        step=jnp.int32(0), limit=jnp.int32(columns), tokens=jnp.zeros((b, columns), jnp.int32),
        logprobs=jnp.zeros((b, columns), jnp.float32), top_ids=jnp.zeros((b, columns, alternatives), jnp.int32),
        top_logprobs=jnp.zeros((b, columns, alternatives), jnp.float32),
        logits=jax.random.normal(jax.random.key(1), (b, v)), positions=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool), generated=jnp.zeros((b,), jnp.int32), finish=jnp.zeros((b,), jnp.int32),
        max_new=jnp.full((b,), 10**6, jnp.int32), stop_seqs=jnp.full((b, MAX_STOPS, 4), -1, jnp.int32),
        recent=jnp.full((b, 4), -1, jnp.int32), seen=jnp.zeros((b, v), bool), counts=jnp.zeros((b, v), jnp.int32),
        grammar=jnp.zeros((b,), jnp.int32), grammar_table=jnp.zeros((1, v), jnp.int32),
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack(configs, v)),
        cache=KVCache.init(cfg, b, 16),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--alternatives", type=int, default=5)
    args = ap.parse_args()
    model.forward = fixed_forward  # decode_loop calls model.forward
    loop = jax.jit(decode_loop, static_argnames="cfg", donate_argnums=1)
    plain = SamplingConfig(temperature=0.0)
    asks = {
        "none": plain,
        "logprobs": dataclasses.replace(plain, logprobs=args.alternatives),
        "penalty": dataclasses.replace(plain, repetition_penalty=1.2, frequency_penalty=0.5),
    }
    print(f"{'vocab':>6}{'batch':>6}" + "".join(f"{'row 0 asks ' + k:>22}" for k in asks) + "   (us per step)")
    for v in args.vocab:
        cfg = ModelConfig(vocab_size=v, num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128)
        params = {"logits_v": jax.random.normal(jax.random.key(0), (v,))}
        for b in args.batches:
            best = dict.fromkeys(asks, float("inf"))
            rows = {k: [c] + [plain] * (b - 1) for k, c in asks.items()}
            make = {k: functools.partial(state, cfg, rows[k], args.steps, args.alternatives) for k in asks}
            for k in asks:
                jax.block_until_ready(loop(params, make[k](), cfg=cfg))
            for _ in range(args.repeats):
                for k in asks:
                    s = jax.block_until_ready(make[k]())
                    t0 = time.process_time()
                    jax.block_until_ready(loop(params, s, cfg=cfg))
                    best[k] = min(best[k], (time.process_time() - t0) / args.steps)
            print(f"{v:>6}{b:>6}" + "".join(f"{best[k] * 1e6:>22.1f}" for k in asks), flush=True)


if __name__ == "__main__":
    main()
