"""One GRPO iteration taken apart, rollouts vs the offline engine, and the built-in task's reward curve.

    python bench/rl.py                        # configs/rl-arithmetic.yaml into runs/bench-rl (resumable)
    python bench/rl.py --steps 20 rl.prompts_per_step=4

Runs (or resumes) `rl.py`'s loop, then reads its metrics.jsonl: the seconds a step spends generating,
scoring rewards, scoring the reference, updating and swapping the weights into the engine (the first step,
which compiles, left out), and the rollout tokens/s. The same prompts and sampling settings of the last
steps are then generated again by a fresh offline engine (`LLM`) on the final weights: the loop's rollout
tokens/s over the offline engine's (target >= 0.9x). The reward curve is the run's reward.png.

`--overlap K` then measures the optional rollout/update overlap on the final weights: K iterations run in
turn (generate, reward, update, swap) against K with the next step's rollouts generated on a thread while
the current update runs (one step off-policy: the swap waits for that generation, and the clipped ratio over
the sampler's log-probabilities is what corrects for it). Only measured here; the loop runs in turn.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("generate_s", "reward_s", "score_s", "update_s", "swap_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "rl-arithmetic.yaml"))
    parser.add_argument("--run-dir", default="runs/bench-rl")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's training.steps)")
    parser.add_argument("--compare", type=int, default=5, help="last steps whose rollouts the offline engine redoes")
    parser.add_argument("--overlap", type=int, default=10, help="iterations of the overlap measurement (0: skip)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args()

    import jax

    from jaxgen.config import load_config
    from jaxgen.rl import loop, tasks
    from jaxgen.training.metrics import read_metrics

    overrides = args.overrides + ([f"training.steps={args.steps}"] if args.steps else [])
    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    result = loop.run_rl(cfg, args.run_dir, progress=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {result.status} at step {result.step} "
          f"in {time.perf_counter() - t0:.0f} s (warm start included when it ran)")  # fmt: skip
    records = sorted({r["step"]: r for r in read_metrics(args.run_dir)}.values(), key=lambda r: r["step"])
    steady = records[1:] or records
    means = {k: statistics.mean(r[k] for r in steady) for k in PARTS}
    total = sum(means.values())
    r = cfg.rl
    print(f"\none GRPO iteration: {r.prompts_per_step} prompts x {r.group_size} samples, up to {r.max_new_tokens} "
          f"new tokens; mean over steps 2..{records[-1]['step']}")  # fmt: skip
    print(f"{'part':<12}{'seconds':>10}{'share':>8}")
    for k in PARTS:
        print(f"{k[:-2]:<12}{means[k]:>10.4f}{means[k] / total:>8.1%}")
    print(f"{'iteration':<12}{total:>10.4f}{1:>8.0%}")

    # the same rollouts through a fresh offline engine on the final weights
    from jaxgen.inference.llm import LLM

    run_cfg = load_config(Path(args.run_dir) / "config.yaml")
    records_all = tasks.load_prompts(run_cfg.rl, run_cfg.training.seed)
    last = records[-args.compare :]
    seed = run_cfg.training.seed
    batches = [
        ([c["prompt"] for c in tasks.step_prompts(records_all, seed, rec["step"] - 1, r.prompts_per_step)],
         loop.sampling_for(run_cfg, rec["step"] - 1, r.prompts_per_step))
        for rec in last
    ]  # fmt: skip
    offline = {}
    for caching in (True, False):  # the loop empties the prefix cache at every swap
        llm = LLM(args.run_dir, slots=r.prompts_per_step * r.group_size, max_logprobs=0, prefix_caching=caching)
        llm.generate(*batches[0])  # compiles
        rates = []
        for prompts, sampling in batches:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sampling)
            rates.append(sum(len(c.tokens) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
        offline[caching] = statistics.mean(rates)
    in_loop = statistics.mean(rec["tokens_per_s"] for rec in last)
    print(f"\nrollout tokens/s over the last {len(last)} steps: in the loop {in_loop:.0f}; a fresh offline engine "
          f"on the final weights {offline[True]:.0f} ({in_loop / offline[True]:.2f}x), with no prefix cache "
          f"{offline[False]:.0f} ({in_loop / offline[False]:.2f}x)")  # fmt: skip
    print(f"swap: {means['swap_s'] * 1e3:.1f} ms a step, {means['swap_s'] / total:.2%} of an iteration")
    rewards = [rec["reward"] for rec in records]
    k = max(len(rewards) // 10, 1)
    first, final = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
    print(
        f"reward: first {k} steps {first:.3f}, last {k} steps {final:.3f}; curve: {Path(args.run_dir) / 'reward.png'}"
    )
    if args.overlap:
        overlap(args.run_dir, args.overlap)


def overlap(run_dir: str, iterations: int) -> None:
    """Seconds an iteration, in turn vs the next rollouts generated beside the update (see the module doc)."""
    import jax
    import numpy as np

    from jaxgen.config import load_config
    from jaxgen.inference.loading import load_model
    from jaxgen.rl import loop, tasks
    from jaxgen.rl.policy import Policy
    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_train_state

    cfg = load_config(Path(run_dir) / "config.yaml")
    r = cfg.rl
    mesh = make_mesh(cfg.mesh)
    _, tokenizer, params = load_model(run_dir, mesh, param_dtype="float32")
    state = create_train_state(cfg, mesh, params)
    policy = Policy.of(cfg, mesh, params)
    update = loop.make_rl_update(cfg, mesh, state, base=policy.base)
    llm = policy.engine(state, tokenizer, slots=r.prompts_per_step * r.group_size,
                        num_pages=loop.rollout_pages(cfg), max_logprobs=0)  # fmt: skip
    records, reward_fn = tasks.load_prompts(r, cfg.training.seed), tasks.load_reward(r)

    def rollout(step: int) -> dict:
        chosen = tasks.step_prompts(records, cfg.training.seed, step, r.prompts_per_step)
        outputs = llm.generate([c["prompt"] for c in chosen], loop.sampling_for(cfg, step, r.prompts_per_step),
                               policy.adapter)  # fmt: skip
        rewards = np.asarray(
            [[reward_fn(rec["prompt"], c.text, **loop.fields_of(rec)) for c in out.outputs]
             for rec, out in zip(chosen, outputs, strict=True)], np.float32,
        )  # fmt: skip
        return loop.rollout_batch(cfg, outputs, rewards)

    def train(state, batch):
        state, m = update(state, batch, np.zeros_like(batch["mask"]))
        jax.block_until_ready(m)
        return state

    def in_turn(state, steps):
        for s in steps:
            state = train(state, rollout(s))
            policy.swap(llm, state)
        return state

    def overlapped(state, steps, pool):
        batch = rollout(steps[0])  # as many rollouts and updates as in turn: only the first is not hidden
        for i in range(len(steps)):
            ahead = pool.submit(rollout, steps[i + 1]) if i + 1 < len(steps) else None  # on the old weights
            state = train(state, batch)
            batch = ahead.result() if ahead else None
            policy.swap(llm, state)
        return state

    seconds = {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        state = in_turn(state, [0])  # compiles generation, update and swap
        state = overlapped(state, [1, 2], pool)
        for name, run in (("in turn", in_turn), ("overlapped", lambda st, ss: overlapped(st, ss, pool))):
            t0 = time.perf_counter()
            state = run(state, list(range(3, 3 + iterations)))
            seconds[name] = (time.perf_counter() - t0) / iterations
    print(f"\nrollout/update overlap ({iterations} iterations each, final weights, {jax.device_count()} device(s)):")
    print(f"{'schedule':<12}{'s/iteration':>12}{'vs in turn':>12}")
    for name, s in seconds.items():
        print(f"{name:<12}{s:>12.4f}{s / seconds['in turn']:>11.2f}x")


if __name__ == "__main__":
    main()
