"""One GRPO iteration taken apart, rollouts vs the offline engine, and the built-in task's reward curve.

    python bench/rl.py                        # configs/rl-arithmetic.yaml into runs/bench-rl (resumable)
    python bench/rl.py --steps 20 rl.prompts_per_step=4

Runs (or resumes) `rl.py`'s loop, then reads its metrics.jsonl: the seconds a step spends generating,
scoring rewards, scoring the reference, updating and swapping the weights into the engine (the first step,
which compiles, left out), and the rollout tokens/s. The same prompts and sampling settings of the last
steps are then generated again by a fresh offline engine (`LLM`) on the final weights: the loop's rollout
tokens/s over the offline engine's (target >= 0.9x). The reward curve is the run's reward.png.
"""

from __future__ import annotations

import argparse
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
         loop._sampling(run_cfg, rec["step"] - 1, r.prompts_per_step))
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


if __name__ == "__main__":
    main()
