"""Compiles a deployment's programs ahead, into the store that serve.py and train.py load them from (issue 45).

    python -m jaxgen.precompile serve --checkpoint runs/default [--config configs/serve.yaml] [key=value ...]
    python -m jaxgen.precompile train [--config configs/default.yaml] [key=value ...]
    python -m jaxgen.precompile train --target tpu-v5p-8 --config configs/llama-3.2-1b.yaml mesh.fsdp=4

`serve` builds the engine exactly as `serve.py http` does with the same settings (the same flags and
overrides) and runs its start's precompile (`jaxgen.inference.precompile`): every program a request can
reach is compiled, or found in the store, and kept there. `train` builds the run as `train.py` does (in a
scratch folder: nothing is written to a run folder) and compiles its train and evaluation steps without taking
a step. The store is the folder $JAXGEN_EXECUTABLES names (`jaxgen.executables`; default
~/.cache/jaxgen/executables, as for serve.py and train.py): run this on the machine kind that will load
them (an executable is refused on another jax, another device kind or another device count, and compiled
there again).

`train --target T` compiles the steps for a TPU slice or GPU node this machine does not have, with that
target's own compiler and its compile-only devices (`jaxgen.targets`: the `tpu-compile` / `gpu-compile`
extras), from the run's abstract state (`plan.abstract_train_state`: no weights are made, so a model of any
size compiles here), and stores them under the target's fingerprint; copy the folder to the target and set
JAXGEN_EXECUTABLES there. Single-host targets only (the store serves one process). Tested here: the abstract
path's programs are the ones a run loads (on this machine's devices) and a target's entries are refused on
another machine with their reason; never loaded on a real TPU or GPU yet.
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
    t.add_argument("--target", metavar="T", help="compile for this TPU slice or GPU node instead of this machine's "
                   "devices, with its own compiler (one host: " + ", ".join(_one_host()) + ")")  # fmt: skip
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
    store = executables.current()  # `--target`'s, where given
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
    from jaxgen.training.trainer import resolve_init_from, train

    cfg = load_config(args.config, args.overrides)
    if args.target is None:
        with tempfile.TemporaryDirectory(prefix="jaxgen-precompile-") as scratch:
            train(cfg, scratch, progress=True, compile_only=True)
        return
    from jaxgen import executables
    from jaxgen.sharding import make_mesh
    from jaxgen.targets import catalog, devices

    target = catalog.get(args.target)
    if target.name not in _one_host():
        raise ValueError(f"--target {target.name} is not allowed: it spans several hosts, and the store serves one "
                         f"process; one of {', '.join(_one_host())}")  # fmt: skip
    cfg = resolve_init_from(cfg)[0]
    chips = devices.compile_devices(target)  # ValueError naming the extra to install where its compiler is missing
    backend = devices.backend_of(target)
    executables.use(executables.current().root, target=(backend, chips))
    with devices.traced_for(backend):
        compile_train_steps(cfg, make_mesh(cfg.mesh, chips))
    print(f"compiled by {devices.compiler_name(target)}")


def compile_train_steps(cfg, mesh) -> None:
    """train.py's train and evaluation steps for `cfg` on `mesh`, compiled (into the store in use) from the
    run's abstract state and batch: the programs a run of `cfg` on those devices calls (next-token objective)."""
    import jax

    from jaxgen import plan
    from jaxgen.training.step import make_eval_step, make_train_step

    if cfg.training.objective != "sft":
        raise ValueError(f"training.objective={cfg.training.objective!r} is not allowed with --target: its batch's "
                         "shape comes from the data; 'sft' (run precompile on the target instead)")  # fmt: skip
    state, base = plan.abstract_train_state(cfg, mesh)
    batch = plan.abstract_batch(cfg, mesh)
    extra = () if base is None else (base,)
    with jax.set_mesh(mesh):
        make_train_step(cfg, mesh, state, base).jitted.compile(state, batch, *extra)
        make_eval_step(cfg, mesh, state, base).jitted.compile(state.params, batch, *extra)


def _one_host() -> list[str]:
    """The catalog's targets of one host (8 chips at most), the ones the store can serve."""
    from jaxgen.targets import catalog

    return [name for name, t in catalog.TARGETS.items() if t.chips <= 8]


if __name__ == "__main__":
    sys.exit(main())
