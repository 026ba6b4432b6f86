"""jaxgen's programs compiled ahead of time for TPU slices and GPU nodes this machine does not have.

    python bench/aot.py                                   # the default rows below (tens of minutes on 2 cores)
    python bench/aot.py --rows llama-3.2-1b:tpu-v5p-8:fsdp=4 --rows llama-3.1-8b:h100x8:fsdp=8:model.remat=full

Each row is CONFIG:TARGET:MESH[:OVERRIDE...]. For each: the train step (memory from the target compiler's
own analysis, or its out-of-memory refusal; counts from compiles with the layers unrolled at 1 and 2
layers, `plan.train_costs`), and one decode step at batch 1 and 64 over a cache of `--cache-len` slots, and
at batch 1 with int8 weights (`serve.quantize=int8`; with how many int8 x int8 products the compiler kept).
Every time in the table is an ESTIMATE from the compiler's counts at the chip's published peaks
(`jaxgen.targets.roofline`: perfect overlap, so a lower bound), never a measurement; the compile
seconds are measured here. Needs the `tpu-compile` extra for TPU rows and `gpu-compile` for GPU rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROWS = [
    "llama-3.2-1b:tpu-v5p-8:fsdp=4:model.remat=full",
    "llama-3.1-8b:tpu-v5p-8:fsdp=4:model.remat=full",
    "llama-3.1-8b:tpu-v6e-8:fsdp=8:model.remat=full",
    "llama-3.1-8b:h100x8:fsdp=8:model.remat=full",
    "llama-3.1-8b:h200x8:fsdp=8:model.remat=full",
]


def row(spec: str, cache_len: int) -> dict:
    """The figures of one CONFIG:TARGET:MESH[:OVERRIDES] row."""
    from jaxgen import plan
    from jaxgen.config import load_config
    from jaxgen.model import count_params, flops_per_token
    from jaxgen.targets import catalog, devices
    from jaxgen.targets.roofline import estimate

    name, target_name, mesh_text, *overrides = spec.split(":")
    target = catalog.get(target_name)
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
    sizes = plan.parse_mesh(mesh_text)
    mesh = devices.target_mesh(target, sizes)
    out = {"row": spec, "params": count_params(cfg.model), "device": target.chip.kind}
    began = time.perf_counter()
    with devices.traced_for(devices.backend_of(target)):
        train = plan.train_program(cfg, mesh, costs=True)
        out["compile_s"] = time.perf_counter() - began
        decodes = {b: plan.inference_programs(cfg.model, mesh, b, cache_len, 1, "bfloat16")[1] for b in (1, 64)}
        decodes["1 int8"] = plan.inference_programs(cfg.model, mesh, 1, cache_len, 1, "bfloat16", quantize="int8")[1]
    out["train_gb"] = train.peak / 1e9
    out["oom"] = train.oom
    if train.costs is not None:
        est = estimate(train.costs, target.chip)
        tokens = cfg.training.batch_size * cfg.data.seq_len
        model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        out |= {
            "step_s": est.seconds, "bound": est.bound, "tokens_per_chip": tokens / est.seconds / target.chips,
            "mfu": model_flops / (est.seconds * target.chip.peak_flops * target.chips),
            "kernels": ",".join(sorted(k for k in train.costs.kernels if not k[0].isupper())) or "-",
        }  # fmt: skip
    for b, p in decodes.items():
        floor = sum(p.parts.values()) / target.chip.hbm_bandwidth
        out[f"decode{b}_ms"] = estimate(p.costs, target.chip).seconds * 1e3 if p.costs else float("nan")
        out[f"floor{b}_ms"] = floor * 1e3
    out["int8_products"] = decodes["1 int8"].costs.int8_products if decodes["1 int8"].costs else 0
    return out


def table(rows: list[dict], cache_len: int) -> str:
    head = (
        "| row | chip | train GB/device | compile s | est. step s | est. tokens/s/chip | est. MFU | bound | "
        f"kernels | est. decode ms b=1 (floor) | b=64 (floor) | b=1, int8 weights (floor; int8 products) | "
        f" (cache {cache_len})"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        train = f"OOM: {r['oom']}" if r["oom"] else f"{r['train_gb']:.1f}"
        est = (
            f"{r['step_s']:.3g} | {r['tokens_per_chip']:,.0f} | {r['mfu']:.0%} | {r['bound']} | {r['kernels']}"
            if "step_s" in r
            else "- | - | - | - | -"
        )
        decode = " | ".join(f"{r[f'decode{b}_ms']:.3g} ({r[f'floor{b}_ms']:.3g})" for b in (1, 64))
        decode += f" | {r['decode1 int8_ms']:.3g} ({r['floor1 int8_ms']:.3g}; {r['int8_products']})"
        lines.append(f"| {r['row']} | {r['device']} | {train} | {r['compile_s']:.0f} | {est} | {decode} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", action="append", help="CONFIG:TARGET:MESH[:OVERRIDE...] (repeatable)")
    parser.add_argument("--cache-len", type=int, default=8192, help="decode cache slots (8192)")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")  # the compilers' devices come from jax.experimental.topologies
    from jaxgen.targets import catalog, devices

    rows = []
    for spec in args.rows or DEFAULT_ROWS:
        target = catalog.get(spec.split(":")[1])
        if reason := devices.unavailable(target):
            print(f"skipped {spec}: {reason}", file=sys.stderr)
            continue
        print(f"compiling {spec} ...", file=sys.stderr, flush=True)
        rows.append(row(spec, args.cache_len))
    print(table(rows, args.cache_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
