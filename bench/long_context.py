"""Context parallelism on 8 fake CPU devices: a train step's per-device peak memory and step time over
sequence length x context size x ring / allgather, and the causal load balance of the zig-zag assignment.

    python bench/long_context.py                               # 8k, 16k, 32k tokens; context 1, 2, 4, 8
    python bench/long_context.py --lengths 8192 --contexts 1 4 --repeats 2
    python bench/long_context.py --time-lengths 0              # memory and balance only (no step run)

One row of T tokens a step on a mesh of `context=C` (C = 1: one device, `blockwise` attention), a small
model (configs/tiny.yaml's shape: 2 layers, D=64, 4 heads, 2 kv heads) so that 32k tokens run on two
cores. Memory: the compiled step's arguments + temporaries + new outputs per device (XLA:CPU's buffer
assignment, as `python -m jaxgen.plan` counts it). Time: the best of --repeats steps after one warm-up
(bench/timing.py), for the lengths in --time-lengths (each step is O(T^2 / C) attention work per device;
the 8 fake devices share this machine's cores, so compare ratios within one run, not absolute times).
Balance: `context.causal_work`, the visible (query block, key block) pairs per device under the causal
mask, zig-zag against contiguous chunks.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from timing import best_seconds  # noqa: E402
from train_throughput import synthetic_batch  # noqa: E402

from jaxgen.config import MeshConfig, load_config  # noqa: E402
from jaxgen.model import context  # noqa: E402
from jaxgen.sharding import make_mesh  # noqa: E402
from jaxgen.training.step import create_train_state, make_train_step, put_batch  # noqa: E402


def config(t: int, c: int, impl: str, block: int):
    overrides = [f"data.seq_len={t}", f"model.max_seq_len={t}", "training.batch_size=1",
                 f"model.attention_impl={impl}", f"model.attention_block={block}"]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    return dataclasses.replace(cfg, mesh=MeshConfig(data=1, context=c))


def measure(t: int, c: int, impl: str, block: int, repeats: int) -> tuple[float, float | None]:
    """(peak bytes per device, best step seconds or None when repeats is 0) of one train step."""
    cfg = config(t, c, impl, block)
    mesh = make_mesh(cfg.mesh, jax.devices()[:c])
    state = create_train_state(cfg, mesh)
    batch = put_batch(synthetic_batch(1, t, cfg.model.vocab_size), mesh)
    step = make_train_step(cfg, mesh, state)
    with jax.set_mesh(mesh):
        compiled = step.jitted.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    new_out = max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0)
    peak = float(mem.argument_size_in_bytes + mem.temp_size_in_bytes + new_out)
    if not repeats:
        return peak, None
    box = [state]

    def run():
        with jax.set_mesh(mesh):
            box[0], metrics = compiled(box[0], batch)
        return metrics["loss"]

    return peak, best_seconds(run, repeats)


def balance_table(lengths, contexts, block: int) -> None:
    print("\nCausal load balance: visible (query block, key block) pairs per device, block", block)
    print("| T | C | zig-zag (max / min) | contiguous (max / min) |\n|---|---|---|---|")
    for t in lengths:
        for c in (c for c in contexts if c > 1):
            zig, flat = context.causal_work(t, c, block), context.causal_work(t, c, block, zigzag=False)
            print(f"| {t} | {c} | {'/'.join(map(str, zig))} ({max(zig) / min(zig):.2f}) | "
                  f"{'/'.join(map(str, flat))} ({max(flat) / min(flat):.2f}) |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="tokens T")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8], help="context sizes C (<= 8)")
    parser.add_argument("--impls", nargs="+", default=["ring", "allgather"], choices=["ring", "allgather"])
    parser.add_argument("--block", type=int, default=512, help="model.attention_block (default 512)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up (best of)")
    parser.add_argument("--time-lengths", type=int, nargs="*", default=None,
                        help="lengths whose steps are run and timed (default: all of --lengths; 0: none)")  # fmt: skip
    args = parser.parse_args()
    for c in args.contexts:
        if not 1 <= c <= 8:
            parser.error(f"--contexts {c} is not allowed: 1 to 8 (8 fake devices)")
    timed = set(args.lengths if args.time_lengths is None else args.time_lengths)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; model configs/tiny.yaml, one row a step")
    print("| T | C | impl | peak per device | vs C=1 | step | ring / allgather |\n|---|---|---|---|---|---|---|")
    for t in args.lengths:
        base = None
        for c in args.contexts:
            steps = {}
            for impl in ["blockwise"] if c == 1 else args.impls:
                peak, secs = measure(t, c, impl, args.block, args.repeats if t in timed else 0)
                base = peak if c == 1 else base
                steps[impl] = secs
                less = f"{base / peak:.2f}x less" if base and c > 1 else ""
                ratio = ""
                if impl == "allgather" and steps.get("ring") and secs:
                    ratio = f"{steps['ring'] / secs:.2f}"
                step = f"{secs * 1e3:.0f} ms" if secs else ""
                print(f"| {t} | {c} | {impl} | {peak / 2**20:.1f} MiB | {less} | {step} | {ratio} |", flush=True)
    balance_table(args.lengths, args.contexts, args.block)


if __name__ == "__main__":
    main()
