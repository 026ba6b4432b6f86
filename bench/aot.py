"""jaxgen's programs compiled ahead of time for TPU slices and GPU nodes this machine does not have.

    python bench/aot.py                                   # the default rows below (tens of minutes on 2 cores)
    python bench/aot.py --rows llama-3.2-1b:tpu-v5p-8:fsdp=4 --rows llama-3.1-8b:h100x8:fsdp=8:model.remat=full

Each row is CONFIG:TARGET:MESH[:OVERRIDE...]. For each: the train step (memory from the target compiler's
own analysis, or its out-of-memory refusal; counts from compiles with the layers unrolled at 1 and 2
layers, `plan.train_costs`), and one decode step at batch 1 and 64 over a cache of `--cache-len` slots, and
at batch 1 with int8 weights (`serve.quantize=int8`; with how many int8 x int8 products the compiler kept),
on a tensor-parallel serving mesh (`serving_mesh`: the chips on tensor as far as the heads divide), not the
row's training mesh. `--decode-only` skips the train step.
Every time in the table is an ESTIMATE from the compiler's counts at the chip's published peaks
(`jaxgen.targets.roofline`: perfect overlap, so a lower bound), never a measurement; the compile
seconds are measured here. Needs the `tpu-compile` extra for TPU rows and `gpu-compile` for GPU rows.

    python bench/aot.py --rows llama-3.1-8b:tpu-v5p-8:fsdp=4:model.remat=full --peer maxtext --maxtext-python PY

MaxText's own train step for the same TPU rows (its `train_compile`, run in its own environment, PY its
interpreter) beside jaxgen's: per-device memory from each side's compiler analysis, and the versions; and
jaxgen's step compiled again by PY (MaxText's jax and libtpu), so that one column pair differs by the
programs alone.
"""

from __future__ import annotations

import argparse
import os
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


def serving_mesh(target, model_cfg) -> dict:
    """The mesh a decode step runs on here for `target`: the chips on `tensor` as far as the heads divide
    over them (what `serve.tensor_parallel` sets, 1 by default), the rest on `data`. (A training mesh is a
    poor layout for decoding: on fsdp, batch-1 decode keeps a whole cache per chip and at batch 64 gathers
    the weights.)"""
    chips = target.chips
    tensor = max(d for d in range(1, chips + 1)
                 if chips % d == 0 and model_cfg.kv_heads % d == 0 and model_cfg.num_heads % d == 0)  # fmt: skip
    return {"data": chips // tensor, "fsdp": 1, "tensor": tensor}


def row(spec: str, cache_len: int, train: bool = True) -> dict:
    """The figures of one CONFIG:TARGET:MESH[:OVERRIDES] row (`train`: the train step's too)."""
    from jaxgen import plan
    from jaxgen.config import load_config
    from jaxgen.model import count_params, flops_per_token
    from jaxgen.targets import catalog, devices
    from jaxgen.targets.roofline import estimate

    name, target_name, mesh_text, *overrides = spec.split(":")
    target = catalog.get(target_name)
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
    mesh = devices.target_mesh(target, plan.parse_mesh(mesh_text))
    serving = serving_mesh(target, cfg.model)
    out = {"row": spec, "params": count_params(cfg.model), "device": target.chip.kind, "oom": None,
           "serving_mesh": ",".join(f"{k}={v}" for k, v in serving.items() if v > 1) or "one chip"}  # fmt: skip
    began = time.perf_counter()
    with devices.traced_for(devices.backend_of(target)):
        trained = plan.train_program(cfg, mesh, costs=True) if train else None
        out["compile_s"] = time.perf_counter() - began
        served = devices.target_mesh(target, serving)
        decodes = {b: plan.inference_programs(cfg.model, served, b, cache_len, 1, "bfloat16")[1] for b in (1, 64)}
        decodes["1 int8"] = plan.inference_programs(cfg.model, served, 1, cache_len, 1, "bfloat16", quantize="int8")[1]
    if trained is not None:
        out["train_gb"] = trained.peak / 1e9
        out["train_args_gb"], out["train_temp_gb"] = trained.arguments / 1e9, trained.temporaries / 1e9
        out["oom"] = trained.oom
    if trained is not None and trained.costs is not None:
        est = estimate(trained.costs, target.chip)
        tokens = cfg.training.batch_size * cfg.data.seq_len
        model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        out |= {
            "step_s": est.seconds, "bound": est.bound, "tokens_per_chip": tokens / est.seconds / target.chips,
            "mfu": model_flops / (est.seconds * target.chip.peak_flops * target.chips),
            "kernels": ",".join(sorted(k for k in trained.costs.kernels if not k[0].isupper())) or "-",
        }  # fmt: skip
    for b, p in decodes.items():
        floor = sum(p.parts.values()) / target.chip.hbm_bandwidth
        out[f"decode{b}_ms"] = estimate(p.costs, target.chip).seconds * 1e3 if p.costs else float("nan")
        out[f"floor{b}_ms"] = floor * 1e3
    out["int8_products"] = decodes["1 int8"].costs.int8_products if decodes["1 int8"].costs else 0
    return out


# jaxgen's configs -> MaxText's model names (its configs/models/*.yml)
MAXTEXT_MODELS = {"llama-3.1-8b": "llama3.1-8b", "llama-3.1-70b": "llama3.1-70b"}


def maxtext_row(spec: str, python: str) -> dict:
    """MaxText's own train step for the same TPU topology, global batch, sequence length, remat and fsdp axis as
    row `spec`, compiled by its `train_compile` in its own environment (`python`: that environment's
    interpreter; MaxText needs Python >= 3.12 and its own jax), its memory analysis per device read from
    what it prints."""
    import re
    import subprocess

    from jaxgen.config import load_config
    from jaxgen.targets import catalog

    name, target_name, mesh_text, *overrides = spec.split(":")
    target = catalog.get(target_name)
    if name not in MAXTEXT_MODELS or target.platform != "tpu":
        raise ValueError(f"--peer maxtext: no MaxText equivalent of {name} on {target_name} "
                         f"(models {', '.join(MAXTEXT_MODELS)}, TPU targets)")  # fmt: skip
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
    fsdp = dict(kv.split("=") for kv in mesh_text.split(",")).get("fsdp", "-1")
    probe = "import maxtext, os, importlib.metadata as m; print(os.path.dirname(maxtext.__file__), m.version('libtpu'))"
    base, libtpu = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    remat = {"none": "minimal", "full": "full"}.get(cfg.model.remat, "full")
    args = [
        f"{base}/configs/base.yml", f"compile_topology={target_name.removeprefix('tpu-')}",
        "compile_topology_num_slices=1", f"model_name={MAXTEXT_MODELS[name]}",
        f"per_device_batch_size={cfg.training.batch_size / target.chips:g}", f"max_target_length={cfg.data.seq_len}",
        f"remat_policy={remat}", f"ici_fsdp_parallelism={fsdp}", "dataset_type=synthetic",
        "enable_checkpointing=false", "base_output_directory=/tmp/jaxgen-maxtext", "run_name=aot",
    ]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run([python, "-m", "maxtext.trainers.pre_train.train_compile", *args], capture_output=True,
                          text=True, env=_peer_env(), timeout=3600)  # fmt: skip
    out = done.stdout + done.stderr
    memory = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", out)
    if done.returncode or memory is None:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return {"row": spec, "peer": "maxtext", "error": f"exit {done.returncode}: {tail}"}
    stats = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", memory.group(1))}
    versions = [*re.findall(r"(Jax|Jaxlib) Version: (\S+)", out), ("libtpu", libtpu)]
    peak = stats["argument_size_in_bytes"] + stats["temp_size_in_bytes"] + stats["output_size_in_bytes"]
    return {
        "row": spec, "peer": "maxtext", "peak_gb": (peak - stats["alias_size_in_bytes"]) / 1e9,
        "temp_gb": stats["temp_size_in_bytes"] / 1e9, "args_gb": stats["argument_size_in_bytes"] / 1e9,
        "compile_s": time.perf_counter() - began, "remat": remat, "versions": " ".join(f"{a} {b}" for a, b in versions),
    }  # fmt: skip


def _peer_env() -> dict:
    """The environment a peer's interpreter compiles in: its own libtpu, not the one jax loaded here
    (TPU_LIBRARY_PATH, which jax sets: MaxText's jax then fed our older libtpu its Mosaic kernels, "Could not
    convert JSON string"), nor the TPU-VM defaults set for it."""
    from jaxgen.runtime import NO_TPU_VM

    unset = {*NO_TPU_VM, "TPU_LIBRARY_PATH"}
    return {k: v for k, v in os.environ.items() if k not in unset} | {"JAX_PLATFORMS": "cpu"}


def train_memory(spec: str) -> dict:
    """The memory per device of row `spec`'s train step (no counts), and which jax and libtpu compiled it."""
    import importlib.metadata

    import jax

    from jaxgen import plan
    from jaxgen.config import load_config
    from jaxgen.targets import catalog, devices

    jax.config.update("jax_platforms", "cpu")
    name, target_name, mesh_text, *overrides = spec.split(":")
    target = catalog.get(target_name)
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
    with devices.traced_for(devices.backend_of(target)):
        trained = plan.train_program(cfg, devices.target_mesh(target, plan.parse_mesh(mesh_text)))
    return {"train_gb": trained.peak / 1e9, "train_args_gb": trained.arguments / 1e9,
            "train_temp_gb": trained.temporaries / 1e9,
            "versions": f"jax {jax.__version__}, libtpu {importlib.metadata.version('libtpu')}"}  # fmt: skip


def jaxgen_under(spec: str, python: str) -> dict:
    """`train_memory(spec)` run by `python` (MaxText's environment): jaxgen's step compiled by the same jax and
    libtpu as MaxText's, so the two differ by their programs alone. An error dict where jaxgen cannot run
    there (jaxgen needs jax 0.10.2 to 0.12 and its own dependencies importable in that environment)."""
    import json
    import subprocess

    code = f"import json, bench.aot as a; print(json.dumps(a.train_memory({spec!r})))"
    env = _peer_env() | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        return {"error": " | ".join((done.stdout + done.stderr).strip().splitlines()[-2:])}
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_table(rows: list[dict], peers: list[dict]) -> str:
    """jaxgen's train step beside MaxText's, per device: jaxgen's compiled by this environment's jax and libtpu
    and again by MaxText's (`jaxgen_under`, the like-for-like column), MaxText's by its own."""
    import importlib.metadata

    import jax

    gb = lambda r: f"{r['train_gb']:.1f} ({r['train_args_gb']:.1f}, {r['train_temp_gb']:.1f})"
    mine = {r["row"]: r for r in rows}
    here = f"jax {jax.__version__}, libtpu {importlib.metadata.version('libtpu')}"
    lines = [
        f"| row | jaxgen GB/device (arguments, temporaries), {here} | jaxgen, MaxText's jax | MaxText GB/device "
        "(arguments, temporaries) | MaxText remat | MaxText compile s | MaxText's jax |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in peers:
        r, under = mine.get(p["row"], {}), p.get("jaxgen_under", {})
        ours = gb(r) if r else "-"
        again = f"failed: {under['error'][:120]}" if "error" in under else gb(under) if under else "-"
        if "error" in p:
            lines.append(f"| {p['row']} | {ours} | {again} | failed: {p['error'][:200]} | - | - | - |")
            continue
        theirs = f"{p['peak_gb']:.1f} ({p['args_gb']:.1f}, {p['temp_gb']:.1f})"
        lines.append(f"| {p['row']} | {ours} | {again} | {theirs} | {p['remat']} | {p['compile_s']:.0f} | "
                     f"{p['versions']} |")  # fmt: skip
    return "\n".join(lines)


def table(rows: list[dict], cache_len: int) -> str:
    head = (
        "| row | chip | train GB/device | compile s | est. step s | est. tokens/s/chip | est. MFU | bound | "
        "kernels | decode mesh | est. decode ms b=1 (floor) | b=64 (floor) | b=1, int8 weights (floor; int8 "
        f"products) | (cache {cache_len})"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        train = f"OOM: {r['oom']}" if r["oom"] else f"{r['train_gb']:.1f}" if "train_gb" in r else "-"
        est = (
            f"{r['step_s']:.3g} | {r['tokens_per_chip']:,.0f} | {r['mfu']:.0%} | {r['bound']} | {r['kernels']}"
            if "step_s" in r
            else "- | - | - | - | -"
        )
        compiled = f"{r['compile_s']:.0f}" if "train_gb" in r else "-"
        decode = " | ".join(f"{r[f'decode{b}_ms']:.3g} ({r[f'floor{b}_ms']:.3g})" for b in (1, 64))
        decode += f" | {r['decode1 int8_ms']:.3g} ({r['floor1 int8_ms']:.3g}; {r['int8_products']})"
        lines.append(f"| {r['row']} | {r['device']} | {train} | {compiled} | {est} | {r['serving_mesh']} | {decode} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", action="append", help="CONFIG:TARGET:MESH[:OVERRIDE...] (repeatable)")
    parser.add_argument("--cache-len", type=int, default=8192, help="decode cache slots (8192)")
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="compile the decode steps only, not the train step (minutes instead of tens of them)",
    )
    parser.add_argument("--peer", choices=["maxtext"], default=None,
                        help="also compile MaxText's train step for each TPU row whose model it has, in its own "
                        "environment (--maxtext-python), and print its memory beside jaxgen's")  # fmt: skip
    parser.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON"),
                        help="the interpreter of an environment with maxtext installed (pip install maxtext and "
                        "its requirements; Python >= 3.12); default $MAXTEXT_PYTHON")  # fmt: skip
    args = parser.parse_args(argv)
    if args.peer and args.decode_only:
        parser.error("--peer maxtext compares train steps: it cannot go with --decode-only")
    if args.peer and not args.maxtext_python:
        parser.error("--peer maxtext needs --maxtext-python (or $MAXTEXT_PYTHON): MaxText runs in its own environment")
    import jax

    jax.config.update("jax_platforms", "cpu")  # the compilers' devices come from jax.experimental.topologies
    from jaxgen.targets import catalog, devices

    rows = []
    for spec in args.rows or DEFAULT_ROWS:
        parts = spec.split(":")
        if len(parts) < 3:
            parser.error(f"--rows {spec!r}: expected CONFIG:TARGET:MESH[:OVERRIDE...], e.g. {DEFAULT_ROWS[0]}")
        if not (ROOT / "configs" / f"{parts[0]}.yaml").exists():
            parser.error(f"--rows {spec!r}: no configs/{parts[0]}.yaml")
        try:
            target = catalog.get(parts[1])
        except ValueError as e:
            parser.error(f"--rows {spec!r}: {e}")
        if reason := devices.unavailable(target):
            print(f"skipped {spec}: {reason}", file=sys.stderr)
            continue
        print(f"compiling {spec} ...", file=sys.stderr, flush=True)
        rows.append(row(spec, args.cache_len, train=not args.decode_only))
    print(table(rows, args.cache_len))
    if args.peer:
        specs = [r["row"] for r in rows if r["row"].split(":")[0] in MAXTEXT_MODELS]
        peers = []
        for spec in specs:
            print(f"compiling MaxText's step for {spec} ...", file=sys.stderr, flush=True)
            peer = maxtext_row(spec, args.maxtext_python)
            print(f"compiling jaxgen's step for {spec} with MaxText's jax ...", file=sys.stderr, flush=True)
            peers.append(peer | {"jaxgen_under": jaxgen_under(spec, args.maxtext_python)})
        print()
        print(peer_table(rows, peers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
