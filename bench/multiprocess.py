"""One process x 8 devices against 2 processes x 4 devices: training tokens/s and the cross-process collectives.

    python bench/multiprocess.py [--configs tiny default] [--mesh data=8] [--steps 5]

Each row runs the same jitted train step on the same global batch (synthetic tokens) over the same mesh
shape, once as one process with 8 CPU devices and once as 2 processes with 4 (launch.py, gloo collectives
over 127.0.0.1). "all-reduce" is a gradient-sized all-reduce timed alone on that mesh: what data
parallelism adds to each step. On this machine both processes share the same CPU cores and talk over
loopback, so the 2-process run is expected to be slower: the figures say what the seam costs here, not
what a cluster does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import best_seconds  # bench/, this script's folder

ROOT = Path(__file__).resolve().parent.parent


def worker(name: str, mesh_args: list[str], batch: int, seq: int, steps: int, out: str) -> None:
    """Runs in each process (under launch.py for two): times the train step and a gradient all-reduce."""
    from jaxgen.config import DistributedConfig
    from jaxgen.distributed import initialize

    initialize(DistributedConfig())
    import jax
    from train_throughput import synthetic_batch

    from jaxgen.config import load_config
    from jaxgen.sharding import make_mesh, process_rows
    from jaxgen.training.step import create_train_state, make_train_step, put_batch

    overrides = [f"training.batch_size={batch}", f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 128)}"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides + [f"mesh.{m}" for m in mesh_args])
    mesh = make_mesh(cfg.mesh)
    state = create_train_state(cfg, mesh)
    step = make_train_step(cfg, mesh, state)
    rows = process_rows(mesh, batch)
    local = {k: v[rows] for k, v in synthetic_batch(batch, seq, cfg.model.vocab_size).items()}
    data = put_batch(local, mesh, batch)
    shapes = jax.tree.map(lambda x: x.shape, state.params)  # before the step donates the state
    carried = [state]

    def one_step():
        carried[0], metrics = step(carried[0], data)
        return metrics

    step_s = best_seconds(one_step, steps)
    reduce_s = _allreduce_seconds(mesh, shapes, steps)
    if jax.process_index() == 0:
        Path(out).write_text(json.dumps({"step_s": step_s, "reduce_s": reduce_s, "tokens": batch * seq}))


def _allreduce_seconds(mesh, shapes, steps: int) -> float:
    """A gradient-sized all-reduce over the batch axes (data x fsdp), timed alone: one (n, ...) array per
    parameter, row i on batch shard i, summed over the rows into a replicated result."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def stacked(param_shape):
        shape = (n, *param_shape)
        return jax.make_array_from_callback(shape, rows, lambda idx: np.ones(shape, np.float32)[idx])

    grads = jax.tree.map(stacked, shapes, is_leaf=lambda x: isinstance(x, tuple))
    replicated = NamedSharding(mesh, PartitionSpec())
    reduce = jax.jit(lambda g: jax.tree.map(lambda x: x.sum(0), g), out_shardings=replicated)
    return best_seconds(lambda: reduce(grads), steps)


def run(processes: int, name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        work = [sys.executable, __file__, "--worker", name, "--mesh", *args.mesh, "--batch", str(args.batch),
                "--seq", str(args.seq), "--steps", str(args.steps), "--out", str(out)]  # fmt: skip
        cmd = [sys.executable, str(ROOT / "launch.py"), "-n", str(processes), "--cpu-devices", str(8 // processes),
               "--", *work]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=os.environ | {"JAXGEN_XLA_CACHE": ""})
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tiny", "default"])
    parser.add_argument("--mesh", nargs="+", default=["data=8"], help="mesh sizes, e.g. data=2 fsdp=2 tensor=2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the best is reported)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.mesh, args.batch, args.seq, args.steps, args.out)
    print(f"mesh {' '.join(args.mesh)}, global batch {args.batch} x {args.seq} tokens, best of {args.steps} steps\n")
    print(
        "| config | 1 x 8: step, tok/s | 2 x 4: step, tok/s | tok/s 2 x 4 vs 1 x 8 | all-reduce 1 x 8 "
        "| all-reduce 2 x 4 |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.configs:
        one, two = run(1, name, args), run(2, name, args)
        print(
            f"| {name} | {one['step_s'] * 1e3:.1f} ms, {one['tokens'] / one['step_s']:,.0f} "
            f"| {two['step_s'] * 1e3:.1f} ms, {two['tokens'] / two['step_s']:,.0f} "
            f"| {one['step_s'] / two['step_s']:.2f}x "
            f"| {one['reduce_s'] * 1e3:.1f} ms | {two['reduce_s'] * 1e3:.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
