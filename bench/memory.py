"""Memory of attention and the planner's tables, from programs compiled on this machine.

    python bench/memory.py                 # all three parts
    python bench/memory.py --part peak     # gpt2-124m train step peak bytes, dense vs blockwise
    python bench/memory.py --part time     # gpt2-124m train step time, dense vs blockwise
    python bench/memory.py --part remat    # Llama 3.2 1B train step per remat policy (the planner)
    python bench/memory.py --part planner  # Llama 3.2 1B / 3.1 8B / 3.1 70B on 8 x H100, 8 x H200, v5p-64

Peak bytes are XLA:CPU's buffer assignment for the compiled step (arguments + temporaries): nothing is
run, so a step too big for this machine still compiles. Times are the best of a few steps of the same
run (see bench/timing.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ as a package-less folder: timing.py beside this file
sys.path.insert(0, str(ROOT / "bench"))

# (config, mesh, device, overrides): a v5p-64 slice is 32 chips (64 TensorCores, two per chip)
PLANS = [
    (name, mesh, device, extra)
    for name in ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b")
    for mesh, device, extra in (
        ("fsdp=8", "h100-80gb", []),
        ("fsdp=8", "h200-141gb", []),
        ("fsdp=32", "v5p", ["training.batch_size=32"]),
    )
]


def gpt2(seq: int, impl: str, batch: int = 1):
    from jaxgen.config import MeshConfig, load_config

    overrides = [f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 1024)}", f"training.batch_size={batch}"]
    cfg = load_config(ROOT / "configs" / "gpt2-124m.yaml", [*overrides, f"model.attention_impl={impl}"])
    return dataclasses.replace(cfg, mesh=MeshConfig(data=1))


def peak_table(lengths=(1024, 4096, 16384)) -> None:
    from jaxgen import plan
    from jaxgen.sharding import make_mesh

    print("| tokens | dense peak | blockwise peak | dense / blockwise |\n|---|---|---|---|")
    for t in lengths:
        peaks = {}
        for impl in ("dense", "blockwise"):
            cfg = gpt2(t, impl)
            try:
                peaks[impl] = plan.train_program(cfg, make_mesh(cfg.mesh)).peak
            except Exception as e:  # say what happens when a program does not compile
                peaks[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        d, b = peaks["dense"], peaks["blockwise"]
        ratio = f"{d / b:.1f}x" if all(isinstance(x, float) for x in (d, b)) else "-"
        print(f"| {t} | {_gb(d)} | {_gb(b)} | {ratio} |", flush=True)


def _gb(x) -> str:
    return f"{x / 1e9:.2f} GB" if isinstance(x, float) else x


def time_table(lengths=(256, 2048), repeats: int = 3) -> None:
    from timing import best_seconds
    from train_throughput import synthetic_batch

    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_train_state, make_train_step, put_batch

    print("| tokens | dense step | blockwise step | blockwise / dense |\n|---|---|---|---|")
    for t in lengths:
        times = {}
        for impl in ("dense", "blockwise"):
            cfg = gpt2(t, impl)
            mesh = make_mesh(cfg.mesh)
            state = create_train_state(cfg, mesh)
            step = make_train_step(cfg, mesh, state)
            batch = put_batch(synthetic_batch(1, t, cfg.model.vocab_size), mesh)
            box = [state]

            def run(step=step, batch=batch, box=box):
                box[0], metrics = step(box[0], batch)
                return metrics["loss"]

            times[impl] = best_seconds(run, repeats)
            del state, box
        ratio = times["blockwise"] / times["dense"]
        print(f"| {t} | {times['dense']:.3f} s | {times['blockwise']:.3f} s | {ratio:.2f} |", flush=True)


def planner_tables() -> None:
    for name, mesh, device, extra in PLANS:
        cmd = [sys.executable, "-m", "jaxgen.plan", "--config", f"configs/{name}.yaml", "--mesh", mesh,
               "--device", device, "--slots", "64", "--cache-len", "8192", *extra]  # fmt: skip
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(out.stdout + (out.stderr if out.returncode not in (0, 1) else ""), flush=True)


def remat_table(policies=("none", "dots", "dots_no_batch", "full")) -> None:
    """The train step of Llama 3.2 1B on 8 x H100 (fsdp=8) under each remat policy, from the planner."""
    print("| model.remat | train step peak per device | temporaries |\n|---|---|---|")
    for policy in policies:
        cmd = [sys.executable, "-m", "jaxgen.plan", "--config", "configs/llama-3.2-1b.yaml", "--mesh", "fsdp=8",
               "--device", "h100-80gb", "--slots", "1", "--cache-len", "128", f"model.remat={policy}"]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout
        train = out.split("train step: ")[1].split("\n")
        temps = next(line for line in train if "temporaries" in line).split()[2:4]
        print(f"| {policy} | {train[0].split(' per device')[0]} | {' '.join(temps)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["peak", "time", "remat", "planner", "all"], default="all")
    args = parser.parse_args()
    if args.part in ("peak", "all"):
        print("## gpt2-124m train step at batch 1: peak bytes per device (XLA:CPU buffer assignment)")
        peak_table()
    if args.part in ("time", "all"):
        print("\n## gpt2-124m train step at batch 1: time (best of 3)")
        time_table()
    if args.part in ("remat", "all"):
        print("\n## Llama 3.2 1B train step (8 x 8192 tokens) on 8 x H100, fsdp=8, per remat policy (planner)")
        remat_table()
    if args.part in ("planner", "all"):
        print("\n## python -m jaxgen.plan: Llama shapes, 64 slots x 8192 for serving, bfloat16 weights and cache")
        planner_tables()


if __name__ == "__main__":
    main()
