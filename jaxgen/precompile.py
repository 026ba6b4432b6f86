"""Compiles a deployment's programs ahead, into the store that serve.py and train.py load them from (issue 45).

    python -m jaxgen.precompile serve --checkpoint runs/default [--config configs/serve.yaml] [key=value ...]
    python -m jaxgen.precompile train [--config configs/default.yaml] [key=value ...]

`serve` builds the engine exactly as `serve.py http` does with the same settings (the same flags and
overrides) and runs its start's precompile (`jaxgen.inference.precompile`): every program a request can
reach is compiled, or found in the store, and kept there. `train` builds the run as `train.py` does (in a
scratch folder: nothing is written to a run folder) and compiles its train and evaluation steps without taking
a step. The store is the folder $JAXGEN_EXECUTABLES names (`jaxgen.executables`; default
~/.cache/jaxgen/executables, as for serve.py and train.py): run this on the machine kind that will load
them (an executable is refused on another jax, another device kind or another device count, and compiled
there again).
"""

from __future__ import annotations

import argparse
import sys
import time


def parser() -> argparse.ArgumentParser:
    from jaxgen.serving import cli

    top = argparse.ArgumentParser(
        prog="python -m jaxgen.precompile",
        description="Compile a deployment's programs into jaxgen's store of executables ($JAXGEN_EXECUTABLES, "
        "default ~/.cache/jaxgen/executables), "
        "so that serve.py and train.py load them at start instead of compiling.",
    )
    sub = top.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="the engine's programs, as `serve.py http` with the same settings loads them",
                       epilog=cli.PRECEDENCE)  # fmt: skip
    cli._engine_args(s)
    t = sub.add_parser("train", help="a run's train and evaluation steps, as `train.py` with the same config")
    t.add_argument("--config", default="configs/default.yaml", help="the run's YAML config, as train.py takes it "
                   "(default: configs/default.yaml)")  # fmt: skip
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as train.py takes them")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from jaxgen import executables
    from jaxgen.config import ConfigError
    from jaxgen.runtime import enable_compilation_cache

    enable_compilation_cache()
    store = executables.current()
    if store is None:
        print("error: JAXGEN_EXECUTABLES is empty (the store is off): name the folder to compile into, or "
              "unset it for ~/.cache/jaxgen/executables (serve.py and train.py load from the same folder)",
              file=sys.stderr)  # fmt: skip
        return 2
    t0 = time.perf_counter()
    try:
        _serve(args) if args.command == "serve" else _train(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{store.saved} programs compiled and stored, {store.loaded} already stored, in {store.root} "
          f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return 0


def _serve(args) -> None:
    from jaxgen.inference.precompile import precompile
    from jaxgen.serving import cli

    settings = cli.command_config(args)
    engine = cli._engine(args, settings)
    precompile(engine, progress=True)


def _train(args) -> None:
    import tempfile

    from jaxgen.config import load_config
    from jaxgen.training.trainer import train

    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory(prefix="jaxgen-precompile-") as scratch:
        train(cfg, scratch, progress=True, compile_only=True)


if __name__ == "__main__":
    sys.exit(main())
