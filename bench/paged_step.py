"""One decode step of the engine (paged cache) against the Generator's (contiguous cache), device time only.

    python bench/paged_step.py [--config tiny] [--set model.max_seq_len=512] [--batches 1 16 64] [--steps 32]

Both run `decode.decode_loop` jitted with the state donated, from the same params and settings, every
row live, `--steps` steps per call, starting at position `--start`; the engine's state is built by
`steps.init_state` (its page tables filled, every slot active) and the Generator's by a `KVCache` of the
length the Generator would allocate. Calls alternate between the two and the best of `--repeats` is
kept (the machine may be shared). `--alternatives` is the top-logprobs width the engine's buffers carry
(`serve.max_logprobs`); the Generator's carries as many as a batch asks (0 here). `--sampling` times the
sampling part alone: greedy vs. a row asking for logprobs / penalties.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxgen import model
from jaxgen.config import ServeConfig, load_config
from jaxgen.inference import steps
from jaxgen.inference.decode import MAX_STOPS, RUNNING, DecodeState, bucket, decode_loop
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig
from jaxgen.model.kvcache import KVCache

ROOT = Path(__file__).resolve().parent.parent


def contiguous_state(cfg, b: int, cache_len: int, columns: int, alternatives: int, start: int, dtype, configs):
    """A Generator-like state: every row live at position `start` of a contiguous cache."""
    v = cfg.vocab_size
    cache = KVCache.init(cfg, b, cache_len, dtype)
    cache = cache.replace(pos=jnp.where(jnp.arange(cache_len) < start, jnp.arange(cache_len), -1)[None].repeat(b, 0),
                          end=jnp.int32(start))  # fmt: skip
    return DecodeState(
        step=jnp.int32(0), limit=jnp.int32(0), tokens=jnp.zeros((b, columns), jnp.int32),
        logprobs=jnp.zeros((b, columns), jnp.float32), top_ids=jnp.zeros((b, columns, alternatives), jnp.int32),
        top_logprobs=jnp.zeros((b, columns, alternatives), jnp.float32),
        logits=jax.random.normal(jax.random.key(1), (b, v)), positions=jnp.full((b,), start, jnp.int32),
        done=jnp.zeros((b,), bool), generated=jnp.zeros((b,), jnp.int32), finish=jnp.zeros((b,), jnp.int32),
        max_new=jnp.full((b,), 10**6, jnp.int32), stop_seqs=jnp.full((b, MAX_STOPS, 4), -1, jnp.int32),
        recent=jnp.full((b, 4), -1, jnp.int32), seen=jnp.zeros((b, v), bool), counts=jnp.zeros((b, v), jnp.int32),
        grammar=jnp.zeros((b,), jnp.int32), grammar_table=jnp.zeros((1, v), jnp.int32),
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack(configs, v)), cache=cache,
    )  # fmt: skip


def paged_state(cfg, serve: ServeConfig, start: int, configs):
    """The engine's state: every slot active at position `start`, its pages allocated up to the context."""
    b, z = serve.slots, serve.page_size
    max_pages = -(-cfg.max_seq_len // z)
    num_pages = b * max_pages + 1  # page 0 is never handed out
    state = steps.init_state(cfg, serve, num_pages, max_pages)
    tables = 1 + jnp.arange(b * max_pages, dtype=jnp.int32).reshape(b, max_pages)
    state = steps.set_tables(state, tables, jnp.full((b,), max_pages * z, jnp.int32))
    return state.replace(
        logits=jax.random.normal(jax.random.key(1), (b, cfg.vocab_size)), positions=jnp.full((b,), start, jnp.int32),
        done=jnp.zeros((b,), bool), finish=jnp.full((b,), RUNNING, jnp.int32), max_new=jnp.full((b,), 10**6, jnp.int32),
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack(configs, cfg.vocab_size)),
    )  # fmt: skip


def timed_loop(params, cfg, make_state, steps_: int, loop, clock=time.perf_counter):
    """Seconds of one call of `steps_` decode steps on a fresh state (built and placed before the clock)."""
    state = jax.block_until_ready(make_state().replace(limit=jnp.int32(steps_)))
    t0 = clock()
    jax.block_until_ready(loop(params, state, cfg=cfg))
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.max_seq_len=512")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--alternatives", type=int, default=ServeConfig().max_logprobs)
    ap.add_argument("--cache-dtype", default="float32")
    ap.add_argument("--ask", choices=["none", "logprobs", "penalty"], default="none",
                    help="row 0 asks for top logprobs or a repetition penalty (the rest greedy)")  # fmt: skip
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time (a busy machine)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    cfg = load_config(ROOT / "configs" / f"{args.config}.yaml", args.set).model
    params0 = model.init_params(cfg, jax.random.key(0))
    loop = jax.jit(decode_loop, static_argnames="cfg", donate_argnums=1)
    print(f"{args.config}, {args.cache_dtype} cache, {args.steps} steps from position {args.start}, ask={args.ask}, "
          f"backend {jax.default_backend()}")  # fmt: skip
    print(f"{'batch':>6}{'generator ms':>14}{'engine ms':>11}{'ratio':>7}")
    for b in args.batches:
        params = model.decode_params(params0, b, cfg)
        configs = [SamplingConfig(temperature=0.0)] * b
        if args.ask == "logprobs":
            configs = [dataclasses.replace(configs[0], logprobs=args.alternatives), *configs[1:]]
        if args.ask == "penalty":
            configs = [dataclasses.replace(configs[0], repetition_penalty=1.3), *configs[1:]]
        serve = ServeConfig(slots=b, chunk_steps=args.steps, max_logprobs=args.alternatives,
                            cache_dtype=args.cache_dtype)  # fmt: skip
        cache_len = max(bucket(bucket(args.start) + min(args.steps, cfg.max_seq_len)), 16)
        alternatives = args.alternatives if args.ask == "logprobs" else 0
        make = {
            "generator": functools.partial(
                contiguous_state, cfg, b, cache_len, args.steps, alternatives, args.start, args.cache_dtype, configs
            ),
            "engine": functools.partial(paged_state, cfg, serve, args.start, configs),
        }
        best = {name: float("inf") for name in make}
        for name in make:  # compile
            timed_loop(params, cfg, make[name], args.steps, loop)
        for _ in range(args.repeats):
            for name in make:
                best[name] = min(best[name], timed_loop(params, cfg, make[name], args.steps, loop, clock) / args.steps)
        g, e = best["generator"], best["engine"]
        print(f"{b:>6}{g * 1e3:>14.3f}{e * 1e3:>11.3f}{e / g:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
