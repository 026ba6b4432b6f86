"""Reinforcement learning with rollouts from the live engine: `python rl.py --config configs/rl-arithmetic.yaml
[--run-dir DIR] [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from jaxgen.config import ConfigError, load_config
from jaxgen.distributed import add_distributed_flags, describe, distributed_overrides, initialize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="GRPO or REINFORCE on a policy: prompts sampled from the serving engine, rewards from a Python "
        "function (or multi-turn episodes with tool calls, rewarded by an environment), the update with the training "
        "forward, the new weights swapped into the same engine. Everything "
        "goes to one run folder (checkpoints, config, tokenizer, metrics.jsonl, TensorBoard, reward.png); running "
        "the same command again resumes from its latest checkpoint.",
        epilog="examples:\n  python rl.py\n  python rl.py --config configs/rl-arithmetic.yaml training.steps=20\n"
        "  python rl.py rl.algorithm=reinforce rl.kl_coef=0.05 rl.init_from=runs/sft\n"
        "  python rl.py rl.max_staleness=1   # the next rollouts generated while the update runs (docs/rl.md)\n"
        "  JAX_NUM_CPU_DEVICES=8 python rl.py rl.sampler_devices=4 mesh.data=4 rl.max_staleness=1\n"
        "  python rl.py --config configs/rl-calculator.yaml   # multi-turn rollouts with a tool (docs/rl.md)\n"
        "  python launch.py -n 2 -- python rl.py mesh.fsdp=2   # two processes (docs/rl.md)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default="configs/rl-arithmetic.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--run-dir", help="run folder (default: runs/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    add_distributed_flags(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rl.group_size=4")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides + distributed_overrides(args))
        joined = initialize(cfg.distributed)  # before anything else touches JAX
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxgen.rl.loop import run_rl  # after parsing: --help and errors need no jax
    from jaxgen.runtime import enable_compilation_cache, quiet_libtpu_off_tpu

    quiet_libtpu_off_tpu()
    enable_compilation_cache()
    if joined:
        print(describe(joined))
    try:
        result = run_rl(cfg, args.run_dir or f"runs/{cfg.name}", progress=not args.no_progress)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.rewards:
        print(f"step {result.step}: mean reward {result.rewards[0]:.3f} at the first step of this call, "
              f"{result.rewards[-1]:.3f} at the last")  # fmt: skip
    else:
        print(f"step {result.step}: {result.status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
