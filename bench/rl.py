"""One GRPO iteration taken apart, rollouts vs the offline engine, and the built-in task's reward curve.

    python bench/rl.py                        # configs/rl-arithmetic.yaml into runs/bench-rl (resumable)
    python bench/rl.py --steps 20 rl.prompts_per_step=4

Runs (or resumes) `rl.py`'s loop, then reads its metrics.jsonl: the seconds a step spends generating,
scoring rewards, scoring the reference, updating and swapping the weights into the engine (the first step,
which compiles, left out), and the rollout tokens/s. The same prompts and sampling settings of the last
steps are then generated again by a fresh offline engine (`LLM`) on the final weights: the loop's rollout
tokens/s over the offline engine's (target >= 0.9x). The reward curve is the run's reward.png.

`--overlap K` then runs K steps from the same warm start under each schedule (`SCHEDULES`): in turn
(generate, reward, update, swap) or overlapped (rl.max_staleness=1: the next step's rollouts generated while
the update runs, corrected by truncated importance sampling), on one device, on 8 CPU devices split 4 sampler
+ 4 trainer (rl.sampler_devices), and as 2 processes of 4 devices: seconds an iteration, the swap's bytes/s,
the staleness and the importance weights.

`--tools K` runs the calculator task (configs/rl-calculator.yaml: multi-turn, a tool to call) for K steps with
the tool and, from the same warm start, with every call answered by an error (rl.tools=false): the reward and
the tool calls an episode, in bins of steps, and both reward curves in `<run-dir>/tools/reward.png`.

What deterministic mode (`model.deterministic`) costs a train step and the engine: `bench/deterministic.py`.
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
    parser.add_argument("--overlap", type=int, default=10, help="iterations of the overlap measurement (0: skip)")
    parser.add_argument("--tools", type=int, default=0, help="steps of the calculator task with and without its "
                        "tool (0: skip)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args()

    import jax

    from jaxgen.config import load_config
    from jaxgen.rl import loop, rollouts, tasks
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
         rollouts.sampling_for(run_cfg, rec["step"] - 1, r.prompts_per_step))
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
    if args.tools:
        tools(args.run_dir, args.tools)


SCHEDULES = (  # name, processes, CPU devices a process, overrides
    ("in turn, one device", 1, 1, ["rl.max_staleness=0", "mesh.data=1"]),
    ("overlapped (staleness 1), one device", 1, 1, ["rl.max_staleness=1", "mesh.data=1"]),
    ("in turn, 4 sampler + 4 trainer devices", 1, 8, ["rl.max_staleness=0", "rl.sampler_devices=4", "mesh.data=4"]),
    ("overlapped, 4 sampler + 4 trainer devices", 1, 8, ["rl.max_staleness=1", "rl.sampler_devices=4", "mesh.data=4"]),
    ("overlapped, 2 processes x (2 sampler + 2 trainer)", 2, 4,
     ["rl.max_staleness=1", "rl.sampler_devices=2", "mesh.data=4"]),
)  # fmt: skip


def overlap(run_dir: str, iterations: int) -> None:
    """Seconds an iteration under each schedule (`SCHEDULES`): rl.py runs of `iterations` steps from the main
    run's warm start, each in its own processes (the CPU device count is fixed when jax starts)."""
    import json
    import os
    import re
    import shutil
    import subprocess
    import sys

    from jaxgen.config import load_config
    from jaxgen.training.metrics import read_metrics

    cfg = load_config(Path(run_dir) / "config.yaml")
    warm = cfg.rl.init_from or str(Path(run_dir) / "warm_start")
    base = ["--config", str(Path(run_dir) / "config.yaml"), "--no-progress", f"rl.init_from={warm}",
            f"training.steps={iterations}", f"checkpoint.every={iterations}"]  # fmt: skip
    rows = []
    for name, processes, devices, overrides in SCHEDULES:
        folder = Path(run_dir) / "schedules" / re.sub(r"\W+", "_", name)
        shutil.rmtree(folder, ignore_errors=True)  # a fresh run each time, not a resumed (finished) one
        rl = [sys.executable, str(ROOT / "rl.py"), "--run-dir", str(folder), *base, *overrides]
        cmd = rl if processes == 1 else [sys.executable, str(ROOT / "launch.py"), "-n", str(processes),
                                         "--cpu-devices", str(devices), "--", *rl]  # fmt: skip
        env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: rl.py failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            continue
        records = sorted({r["step"]: r for r in read_metrics(folder)}.values(), key=lambda r: r["step"])
        records = records[2:] or records  # the first two compile
        mean = {
            k: statistics.mean(r[k] for r in records)
            for k in (
                "step_s",
                "generate_s",
                "update_s",
                "swap_s",
                "swap_bytes_per_s",
                "staleness",
                "ratio",
                "corrected",
            )
        }
        mean["ratio_max"] = max(r["ratio_max"] for r in records)
        rows.append((name, mean))
        print(json.dumps({"schedule": name, **mean}), file=sys.stderr)
    first = rows[0][1]["step_s"] if rows else 1.0
    print(f"\nschedules: {iterations} steps each from the warm start; means over steps 3..{iterations}")
    print(
        "| schedule | s/iteration | vs in turn | generate s | update s not hidden | swap MB/s | staleness "
        "| importance weight mean / max | tokens truncated |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in rows:
        print(
            f"| {name} | {m['step_s']:.4f} | {m['step_s'] / first:.2f}x | {m['generate_s']:.4f} | "
            f"{m['update_s']:.4f} | {m['swap_bytes_per_s'] / 1e6:.0f} | {m['staleness']:.2f} | "
            f"{m['ratio']:.3f} / {m['ratio_max']:.2f} | {m['corrected']:.2%} |"
        )


def tools(run_dir: str, steps: int) -> None:
    """The calculator task with its tool and without (rl.tools=false), from one warm start (the first run's)."""
    import os
    import subprocess
    import sys

    from jaxgen.training.metrics import read_metrics, save_plot

    folder = Path(run_dir) / "tools"
    base = [sys.executable, str(ROOT / "rl.py"), "--config", str(ROOT / "configs" / "rl-calculator.yaml"),
            "--no-progress", f"training.steps={steps}"]  # fmt: skip
    runs = {"with the tool": [], "without (rl.tools=false)": [f"rl.init_from={folder / 'with' / 'warm_start'}",
                                                               "rl.tools=false"]}  # fmt: skip
    curves = {}
    for (name, overrides), sub in zip(runs.items(), ("with", "without"), strict=True):
        done = subprocess.run([*base, "--run-dir", str(folder / sub), *overrides], capture_output=True, text=True,
                              env=os.environ | {"JAX_PLATFORMS": "cpu"})  # fmt: skip
        if done.returncode:
            print(f"{name}: rl.py failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            return
        curves[name] = sorted({r["step"]: r for r in read_metrics(folder / sub)}.values(), key=lambda r: r["step"])
    width = max(steps // 6, 1)
    print(f"\nthe calculator task, {steps} steps each from one warm start: mean reward / tool calls an episode")
    print("| steps | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for lo in range(0, steps, width):
        cells = []
        for records in curves.values():
            part = records[lo : lo + width]
            cells.append(f"{statistics.mean(r['reward'] for r in part):.2f} / "
                         f"{statistics.mean(r['tool_calls'] for r in part):.2f}")  # fmt: skip
        print(f"| {lo + 1}-{min(lo + width, steps)} | " + " | ".join(cells) + " |")

    def draw(ax):
        for name, records in curves.items():
            ax.plot([r["step"] for r in records], [r["reward"] for r in records], lw=1.5, label=f"reward, {name}")
            ax.plot([r["step"] for r in records], [r["tool_calls"] for r in records], lw=1, ls="--",
                    label=f"tool calls an episode, {name}")  # fmt: skip

    print(f"curves: {save_plot(folder / 'reward.png', draw, 'the calculator task', 'RL step', 'mean')}")


if __name__ == "__main__":
    main()
