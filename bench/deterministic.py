"""What deterministic mode (`model.deterministic`) costs: a train step and the engine's throughput, with the
flag off and on, on the same weights in one process.

    python bench/deterministic.py                  # both models below, medians
    python bench/deterministic.py --repeats 9 --models tiny
    python bench/deterministic.py --dtype bfloat16       # a bfloat16 model with a bfloat16 page pool
    python bench/deterministic.py --block 64 --page-size 64

Train step: forward and backward of the RL loss's `token_logprobs` (jitted, one compiled shape), seconds
a call. Engine: `Engine.generate` of one request a slot, each a fixed number of sampled tokens (end-of-text
ignored), tokens/s. Both compiled first; the flag-off and flag-on calls then alternate, and the ratio
columns are the medians of the per-pair ratios (on / off), the figures to read on a noisy machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (config file, train batch B x T, engine slots, prompt tokens, new tokens a request)
MODELS = {
    "tiny": ("configs/tiny.yaml", (8, 64), 8, 16, 96),
    "demo": ("configs/rl-arithmetic.yaml", (128, 12), 32, 8, 32),
}


def _train_steps(params, cfgs, batch: tuple[int, int]) -> list:
    """A jitted forward + backward of `token_logprobs` for each config, compiled, as zero-argument callables."""
    import jax
    import numpy as np

    from jaxgen.rl.objectives import token_logprobs

    b, t = batch
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (b, t)).astype(np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    calls = []
    for cfg in cfgs:
        step = jax.jit(jax.value_and_grad(lambda p, cfg=cfg: token_logprobs(p, tokens, positions, cfg=cfg)[0].mean()))
        jax.block_until_ready(step(params))
        calls.append(lambda step=step: jax.block_until_ready(step(params)) and None)
    return calls


def _engine_rounds(params, cfgs, slots: int, prompt: int, new: int, page_size: int) -> list:
    """For each config an engine, warmed up, and a callable generating one round (one request a slot, `new`
    tokens each, other seeds every round) that returns the tokens it generated."""
    import itertools

    import numpy as np

    from jaxgen.config import ServeConfig
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    pages = slots * (-(-(prompt + new) // page_size) + 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, prompt).tolist() for _ in range(slots)]
    calls = []
    for cfg in cfgs:
        serve = ServeConfig(slots=slots, page_size=page_size, num_pages=pages, cache_dtype=cfg.dtype)  # pool as model
        engine = Engine(params, cfg, Tokenizer.byte_level(), serve)
        seeds = itertools.count()

        def round_(engine=engine, seeds=seeds):
            sc = [SamplingConfig(max_new_tokens=new, temperature=1.0, seed=next(seeds), ignore_eos=True)
                  for _ in range(slots)]  # fmt: skip
            return sum(len(o.tokens) for o in engine.generate(prompts, sc))

        round_()  # compiles
        calls.append(round_)
    return calls


def _interleaved(calls: list, repeats: int) -> tuple[list[float], float]:
    """Each callable timed `repeats` times, in turn (on, off, off, on, ...), so that a machine slowing down
    slows both: the median seconds (or the median of what a call returns per second) of each, and the median
    of the per-round ratios (the second over the first)."""
    times = [[] for _ in calls]
    for r in range(repeats):
        for i in range(len(calls))[:: 1 if r % 2 else -1]:  # the order swapped every round
            call = calls[i]
            t0 = time.perf_counter()
            out = call()
            dt = time.perf_counter() - t0
            times[i].append(dt if out is None else out / dt)
    ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
    return [statistics.median(t) for t in times], statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=7, help="engine rounds (train steps: 3x as many); median")
    parser.add_argument("--block", type=int, default=16, help="model.attention_block (a divisor of --page-size)")
    parser.add_argument("--page-size", type=int, default=16, help="the engine's serve.page_size (both sides)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model.dtype, the pool too")
    args = parser.parse_args()

    from jaxgen.runtime import quiet_libtpu_off_tpu

    quiet_libtpu_off_tpu()  # (the test extra installs libtpu)
    import jax

    from jaxgen import model
    from jaxgen.config import load_config

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {jax.device_count()} device(s)")
    print("| model | train B x T | train step off | on | ratio | engine slots x new | tokens/s off | on | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        path, batch, slots, prompt, new = MODELS[name]
        cfg = load_config(ROOT / path, [f"model.attention_block={args.block}", f"model.dtype={args.dtype}"]).model
        params = model.init_params(cfg, jax.random.key(0))
        cfgs = [dataclasses.replace(cfg, deterministic=on) for on in (False, True)]
        (t0, t1), train = _interleaved(_train_steps(params, cfgs, batch), 3 * args.repeats)
        (e0, e1), engine = _interleaved(_engine_rounds(params, cfgs, slots, prompt, new, args.page_size), args.repeats)
        print(f"| {name} | {batch[0]} x {batch[1]} | {t0 * 1e3:.1f} ms | {t1 * 1e3:.1f} ms | {train:.2f}x "
              f"| {slots} x {new} | {e0:.0f} | {e1:.0f} | {engine:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
