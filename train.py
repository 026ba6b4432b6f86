"""Train a jaxgen model: `python train.py --config configs/default.yaml [--run-dir DIR] [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from jaxgen.config import ConfigError, load_config
from jaxgen.distributed import add_distributed_flags, describe, distributed_overrides, initialize
from jaxgen.runtime import quiet_libtpu_off_tpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train a decoder-only language model. Everything the run writes (checkpoints, config, "
        "tokenizer, metrics.jsonl, TensorBoard events, loss.png) goes to one run folder; running the same "
        "command again resumes from its latest checkpoint.",
        epilog="examples:\n  python train.py\n  python train.py --config configs/tiny.yaml training.steps=50\n"
        "  python train.py --config configs/llama-small.yaml model.num_layers=4 optimizer.learning_rate=3e-4\n"
        "  python train.py draft.target=runs/default    # an EAGLE-3 draft head for a trained model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config (default: configs/default.yaml)")
    parser.add_argument(
        "--run-dir", help="run folder (default: runs/<config name>; a draft head: <draft.target>-eagle3)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    add_distributed_flags(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model.num_layers=4")
    args = parser.parse_intermixed_args(argv)  # overrides may stand among the flags
    try:
        cfg = load_config(args.config, args.overrides + distributed_overrides(args))
        quiet_libtpu_off_tpu()  # before jax's backends start
        joined = initialize(cfg.distributed)  # before anything else touches JAX
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxgen.runtime import enable_compilation_cache
    from jaxgen.training.trainer import (  # after parsing: --help and errors need no jax
        DiskFullError,
        NonFiniteError,
        train,
    )

    enable_compilation_cache()
    if joined:
        print(describe(joined))

    try:
        if cfg.draft.target:  # a draft head for a frozen target, not the model
            from jaxgen.training.eagle import default_run_dir, train_head

            train_head(cfg, args.run_dir or default_run_dir(cfg), progress=not args.no_progress)
        else:
            train(cfg, args.run_dir or f"runs/{cfg.name}", progress=not args.no_progress)
    except (ConfigError, NonFiniteError, DiskFullError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
