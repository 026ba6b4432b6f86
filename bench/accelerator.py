"""The accelerator check: one call, at most ~8 minutes on one GPU (written for an H200), that measures jaxgen
against the chip's limits and against Hugging Face transformers on the same device.

    python bench/accelerator.py --trace-dir runs/trace     # on the accelerator: every part, then the tables
    python bench/accelerator.py --smoke                     # anywhere: tiny shapes, the same code paths (CPU)
    python bench/accelerator.py --parts decode-jax engine-jax   # some parts only

Parts, in this order (each in its own process with a time budget, so a part that fails or hangs prints its
error and the rest still run; GPU memory is whole again for the next part; then the tables):
  cudnn          cuDNN attention equals the dense reference, forward and gradients (GPU only)
  decode-jax     `Generator` at batch 1, 1B and 8B shapes, against the memory floor; a device trace of a step
  engine-jax     the engine at 64 slots, 256 fresh requests of 128 + 128 (warmed up on other prompts of the
                 same lengths), compilations in the timed run counted; a device trace of engine steps
  batch-jax      `Generator`, a static batch of 64 prompts of 128 + 128 tokens
  train-jax      the Llama 3.2 1B train step at the most rows that fit: tokens/s and MFU
  decode-torch   transformers at batch 1 (1B): eager, and a static cache + torch.compile
  batch-torch    transformers' eager `generate`, the same batch
  train-torch    the same train step through transformers (SDPA, bfloat16 autocast, no remat), most rows that fit
The floor of a decode step is (bytes of weights + bytes of the cache read) / HBM bandwidth (the datasheet's).
Random weights throughout, bfloat16 (speed does not depend on the values). The configurations every part
loads come from `part_configs`, which tests/test_bench_accelerator.py checks without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# device kind (substring of jax's device_kind) -> (dense bf16 FLOP/s, HBM bytes/s), the vendors' figures
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "TPU v5p": (459e12, 2.76e12)}
RESULT = "@@result "  # a child's line carrying its part's figures (JSON) to the parent
TOP_OPS = 15


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the parts run; `SMOKE` swaps in tiny shapes for a CPU check of the same code."""

    small: str = "llama-3.2-1b"  # configs/NAME.yaml
    large: str = "llama-3.1-8b"
    train_seq: int = 4096
    train_rows: tuple[int, ...] = (16, 8, 4, 2, 1)  # tried in turn: the first that fits is measured
    remat: str = "dots_no_batch"  # jaxgen's model.remat in the train step
    prompt: int = 64  # batch-1 decode: prompt tokens, new tokens (1B), new tokens (8B)
    new_tokens: int = 256
    new_tokens_large: int = 128
    batch: int = 64  # the static batch and the engine's slots
    batch_prompt: int = 128
    batch_new: int = 128
    requests: int = 256
    kv_memory_gb: float = 16.0
    trace_steps: int = 16  # decode steps in the traced window
    repeats: int = 3


SMOKE = Shapes(
    small="tiny", large="tiny", train_seq=64, train_rows=(4, 2), prompt=16, new_tokens=16, new_tokens_large=8,
    batch=4, batch_prompt=16, batch_new=32, requests=8, kv_memory_gb=0.05, trace_steps=4, repeats=2,
)  # fmt: skip

# issue 50's CPU acceptance: the engine against the static batch on a tiny model, whose device time is small
# as a GPU's is, so that the host's overhead shows as it would there
CPU_PROXY = dataclasses.replace(SMOKE, batch=64, batch_prompt=128, batch_new=128, requests=256, kv_memory_gb=0.5)


@dataclasses.dataclass(frozen=True)
class PartConfig:
    """One run's configuration: the model (a whole `Config`, as loaded), and what generation asks of it."""

    run: object  # jaxgen.config.Config
    prompt: int = 0  # prompt tokens and new tokens per sequence (generation parts)
    new_tokens: int = 0
    serve: object = None  # jaxgen.config.ServeConfig of the engine part


def load(name: str, max_len: int, *overrides: str):
    """configs/NAME.yaml in bfloat16 with model.max_seq_len = data.seq_len = max_len: the YAMLs' own
    data.seq_len (8192 for the Llama shapes) must not exceed a lowered max_seq_len."""
    from jaxgen.config import load_config

    fixed = ["model.dtype=bfloat16", f"model.max_seq_len={max_len}", f"data.seq_len={max_len}"]
    return load_config(ROOT / "configs" / f"{name}.yaml", [*fixed, *overrides])


def part_configs(shapes: Shapes) -> dict[str, PartConfig]:
    """Every configuration the parts run, keyed by what they call it; loading them checks them all."""
    from jaxgen.config import ServeConfig
    from jaxgen.inference.decode import bucket

    def generation(name, prompt, new):
        return PartConfig(load(name, bucket(prompt + new + 1)), prompt, new)

    out = {
        f"train {rows}": PartConfig(
            load(shapes.small, shapes.train_seq, f"training.batch_size={rows}", f"model.remat={shapes.remat}")
        )
        for rows in shapes.train_rows
    }
    out["decode small"] = generation(shapes.small, shapes.prompt, shapes.new_tokens)
    out["decode large"] = generation(shapes.large, shapes.prompt, shapes.new_tokens_large)
    out["batch"] = generation(shapes.small, shapes.batch_prompt, shapes.batch_new)
    serve = ServeConfig(slots=shapes.batch, kv_memory_gb=shapes.kv_memory_gb, cache_dtype="bfloat16")
    engine = generation(shapes.small, shapes.batch_prompt, shapes.batch_new)
    out["engine"] = dataclasses.replace(engine, serve=serve)
    return out


def peaks() -> tuple[float, float, str]:
    import jax

    kind = jax.devices()[0].device_kind
    for name, (flops, bandwidth) in PEAKS.items():
        if name in kind:
            return flops, bandwidth, kind
    return float("nan"), float("nan"), kind


def report(**figures) -> None:
    """Hands this part's figures to the parent process (one JSON line)."""
    print(RESULT + json.dumps(figures), flush=True)


def _random_params(cfg):
    """Random weights in bfloat16, drawn and cast on the device in one program (no float32 copy kept)."""
    import jax
    import jax.numpy as jnp

    from jaxgen import model

    draw = jax.jit(lambda: jax.tree.map(lambda p: p.astype(jnp.bfloat16), model.init_params(cfg, jax.random.key(0))))
    return draw()


def _timed(fn) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# --- the jaxgen parts -----------------------------------------------------------------------------------------


def part_cudnn(shapes: Shapes, args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgen.config import ModelConfig
    from jaxgen.model import attention, kernels

    print("## cuDNN attention vs dense (bfloat16, B=2, T=1024, 16 heads over 4 kv heads, packed segments)")
    if jax.default_backend() != "gpu":
        print(f"skipped: the backend is {jax.default_backend()}")
        return
    cfg = ModelConfig(num_heads=16, num_kv_heads=4, d_model=2048, head_dim=128, dtype="bfloat16", max_seq_len=1024)
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(2, 1024, h, 128)), jnp.bfloat16) for h in (16, 4, 4))
    pos = np.tile(np.arange(1024, dtype=np.int32), (2, 1))
    seg = np.ones((2, 1024), np.int32)
    seg[:, 600:], pos[:, 600:] = 2, pos[:, 600:] - 600
    pos, seg = jnp.asarray(pos), jnp.asarray(seg)
    w = jnp.asarray(r.normal(size=q.shape), jnp.float32)
    mask = attention.attention_mask(pos, pos, seg, seg)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    dense = loss(lambda q, k, v: attention.dense_attention(q, k, v, mask, cfg))
    scale = attention.logit_scale(cfg)
    fused = loss(lambda q, k, v: kernels.cudnn_attention(q, k, v, kernels.cudnn_mask(pos, seg), None, cfg, scale=scale))
    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v) for f in (dense, fused))
    print(f"loss dense {float(a):.4f} cudnn {float(b):.4f}")
    worst = 0.0
    for name, x, y in zip("qkv", ga, gb, strict=True):
        err = float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
        largest = float(jnp.abs(x.astype(jnp.float32)).max())
        worst = max(worst, err / largest)
        print(f"d{name}: max |cudnn - dense| = {err:.3g} ({err / largest:.2%} of the largest)")
    report(loss_dense=float(a), loss_cudnn=float(b), grad_error=worst)


def part_train_jax(shapes: Shapes, args) -> None:
    """The train step at the most rows of `shapes.train_rows` that fit."""
    from jaxgen.model import kernels

    configs = part_configs(shapes)
    for rows in shapes.train_rows:
        cfg = configs[f"train {rows}"].run
        print(f"## train step (jaxgen): {shapes.small}, {rows} x {shapes.train_seq} tokens, bfloat16, "
              f"remat={shapes.remat}, attention={kernels.choose(cfg.model)}", flush=True)  # fmt: skip
        try:
            figures = _train_jax(cfg, shapes.repeats)
        except Exception as e:  # only running out of memory moves on to fewer rows
            if not _out_of_memory(e):
                raise
            print(f"{rows} rows do not fit: {str(e).splitlines()[0][:200]}", flush=True)
            continue  # the failed try's state goes with the exception, at the end of this block
        report(**figures)
        return
    raise RuntimeError(f"no row count of {shapes.train_rows} fits")


def _train_jax(cfg, repeats: int) -> dict:
    """One row count: a fresh state (a step that ran out of memory may have consumed its donated state)."""
    from timing import best_seconds
    from train_throughput import synthetic_batch

    from jaxgen import model
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_train_state, make_train_step, put_batch

    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
    rows, seq = cfg.training.batch_size, cfg.data.seq_len
    mesh = make_mesh(cfg.mesh)
    box = [create_train_state(cfg, mesh)]
    step = make_train_step(cfg, mesh, box[0])
    data = put_batch(synthetic_batch(rows, seq, cfg.model.vocab_size), mesh)

    def run():
        box[0], metrics = step(box[0], data)
        return metrics["loss"]

    first = _timed(run)
    seconds = best_seconds(run, repeats)
    flops, _, kind = peaks()
    achieved = model.flops_per_token(cfg.model, seq) * rows * seq / seconds
    print(f"first step (compile + run) {first:.1f} s; best of {repeats}: {seconds:.3f} s", flush=True)
    return {"rows": rows, "seq": seq, "step_s": seconds, "tok_s": rows * seq / seconds, "mfu": achieved / flops,
            "first_s": first, "device": kind}  # fmt: skip


def _decode_per_token(gen, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Seconds per decode step at batch 1: a run of new_tokens minus a run of one token (prefill and the
    first token), best of `repeats` each, so prefill is not counted."""
    from jaxgen.inference.sampling import SamplingConfig

    full = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    short = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], full)  # compile
    gen.generate([prompt], short)
    t_full = min(_timed(lambda: gen.generate([prompt], full)) for _ in range(repeats))
    t_short = min(_timed(lambda: gen.generate([prompt], short)) for _ in range(repeats))
    return (t_full - t_short) / (new_tokens - 1)


def part_decode_jax(shapes: Shapes, args) -> None:
    configs = part_configs(shapes)
    figures = {key: _decode_jax(configs[key], name, shapes, args if key == "decode small" else None)
               for key, name in (("decode small", shapes.small), ("decode large", shapes.large))}  # fmt: skip
    report(**figures)


def _decode_jax(part: PartConfig, name: str, shapes: Shapes, trace_args) -> dict:
    """ms per token of one model at batch 1 and its floor; with trace_args.trace_dir, a step's device trace."""
    import jax

    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.model.kvcache import cache_memory_bytes
    from jaxgen.tokenizer import Tokenizer

    cfg = part.run.model
    print(f"## decode at batch 1 (jaxgen Generator): {name}, {part.prompt} + {part.new_tokens} tokens", flush=True)
    params = _random_params(cfg)
    gen = Generator(params, cfg, Tokenizer.byte_level(), max_batch=1, chunk_steps=part.new_tokens,
                    cache_dtype="bfloat16")  # fmt: skip
    prompt = list(range(1, part.prompt + 1))
    per_token = _decode_per_token(gen, prompt, part.new_tokens, shapes.repeats)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    cache = cache_memory_bytes(cfg, 1, part.prompt + part.new_tokens // 2, "bfloat16")  # the average read
    _, bandwidth, kind = peaks()
    floor = (weights + cache) / bandwidth
    print(f"{per_token * 1e3:.2f} ms per token; floor {floor * 1e3:.3f} ms ({kind})", flush=True)
    if trace_args is not None and trace_args.trace_dir:
        steps = min(shapes.trace_steps, part.new_tokens - 1)
        traced = SamplingConfig(max_new_tokens=1 + steps, temperature=0.0, ignore_eos=True)
        short = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        folder = Path(trace_args.trace_dir) / "decode"
        with_steps = _trace(folder / "steps", lambda: gen.generate([prompt], traced))
        without = _trace(folder / "prefill", lambda: gen.generate([prompt], short))
        _print_ops(f"one decode step, batch 1, {name} (the difference of two traced runs / {steps})",
                   _per_step(with_steps, without, steps), folder / "summary.md")  # fmt: skip
    return {"ms": per_token * 1e3, "floor_ms": floor * 1e3, "model": name}


def part_batch_jax(shapes: Shapes, args) -> None:
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    part = part_configs(shapes)["batch"]
    cfg, b = part.run.model, shapes.batch
    print(f"## static batch (jaxgen Generator): {shapes.small}, {b} x ({part.prompt} + {part.new_tokens})", flush=True)
    gen = Generator(_random_params(cfg), cfg, Tokenizer.byte_level(), max_batch=b, chunk_steps=part.new_tokens,
                    cache_dtype="bfloat16")  # fmt: skip
    prompts = _prompts(b, part.prompt, seed=0)
    sampling = SamplingConfig(max_new_tokens=part.new_tokens, temperature=0.0, ignore_eos=True)
    first = _timed(lambda: gen.generate(prompts, sampling))
    seconds = min(_timed(lambda: gen.generate(prompts, sampling)) for _ in range(shapes.repeats))
    print(f"first call {first:.1f} s; best of {shapes.repeats}: {seconds:.2f} s", flush=True)
    report(tok_s=b * part.new_tokens / seconds, seconds=seconds, first_s=first)


def part_engine_jax(shapes: Shapes, args) -> None:
    """The engine through its public API: warm-up on one set of prompts, the timed run on fresh ones (none
    of their pages is in the prefix cache), compilations counted across the timed window."""
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    part = part_configs(shapes)["engine"]
    cfg, serve = part.run.model, part.serve
    print(f"## engine: {shapes.small}, {serve.slots} slots, {shapes.requests} fresh requests of "
          f"{part.prompt} + {part.new_tokens}", flush=True)  # fmt: skip
    engine = Engine(_random_params(cfg), cfg, Tokenizer.byte_level(), serve)
    sampling = SamplingConfig(max_new_tokens=part.new_tokens, temperature=0.0, ignore_eos=True)

    def run(seed: int, n: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        handles = [h for p in _prompts(n, part.prompt, seed) for h in engine.submit(p, sampling)]
        engine.run_until_idle()
        return sum(len(h.tokens) for h in handles), time.perf_counter() - t0

    _, warm = run(seed=1, n=shapes.requests)  # the same lengths: every program the timed run needs
    before = engine.compilations
    tokens, wall = run(seed=2, n=shapes.requests)
    compiled = engine.compilations - before
    print(f"warm-up {warm:.1f} s; timed {wall:.2f} s, {tokens} tokens; compilations in the timed run: {compiled}")
    report(tok_s=tokens / wall, seconds=wall, tokens=tokens, compilations=compiled, warmup_s=warm)
    if args.trace_dir:
        _trace_engine(engine, part, sampling, shapes, Path(args.trace_dir) / "engine")


def _trace_engine(engine, part: PartConfig, sampling, shapes: Shapes, folder: Path) -> None:
    """A device trace of a few engine steps once every slot holds a request (all admitted: the steady state)."""
    for p in _prompts(part.serve.slots, part.prompt, seed=3):
        engine.submit(p, sampling)
    while engine.queue_length() and not engine.idle():
        engine.step()
    steps = 3

    def window():
        for _ in range(steps):
            engine.step()

    events = _trace(folder / "steps", window, warm_up=False)  # compiled by the timed run
    engine.run_until_idle()
    _print_ops(f"one engine step, {part.serve.slots} slots busy (a traced window / {steps})",
               _per_step(events, {}, steps), folder / "summary.md")  # fmt: skip


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


# --- device traces ----------------------------------------------------------------------------------------------


def _trace(folder: Path, fn, warm_up: bool = True) -> dict[str, tuple[int, float]]:
    """Runs fn under `jax.profiler.trace` into `folder` (after one untraced call, so that nothing compiles
    inside, unless warm_up=False); returns {op: (calls, µs)} of the device's operations (of XLA's executor
    threads on a host backend, which has no device plane)."""
    import glob
    import gzip

    import jax

    folder.mkdir(parents=True, exist_ok=True)
    if warm_up:
        jax.block_until_ready(fn())
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    path = sorted(glob.glob(str(folder / "**" / "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    ops, source = _device_ops(data["traceEvents"] if isinstance(data, dict) else data)
    print(f"(operations from {source})", flush=True)
    return ops


def _device_ops(events: list[dict]) -> tuple[dict[str, tuple[int, float]], str]:
    """{op name: (calls, µs)} of a Chrome-format trace's events, and where they were taken from: the device
    planes, or without one (XLA:CPU, or no CUPTI) the executor threads of the host."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    devices = {pid for (kind, pid, _), name in names.items() if kind == "process_name" and "/device:" in name}

    def counted(e) -> bool:
        if devices:
            return e["pid"] in devices
        thread = names.get(("thread_name", e["pid"], e.get("tid")), "")
        # XLA:CPU's executor threads, less Python's frames ($...) and the runtime's own spans (Class::method)
        return thread != "python" and not e["name"].startswith(("$", "end: ")) and "::" not in e["name"]

    ops: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("ph") == "X" and counted(e):
            calls, us = ops.get(e["name"], (0, 0.0))
            ops[e["name"]] = (calls + 1, us + float(e.get("dur", 0.0)))
    return ops, "the device's trace" if devices else "the host's executor threads: the trace has no device plane"


def _per_step(ops: dict, baseline: dict, steps: int) -> dict[str, tuple[float, float]]:
    """(ops - baseline) / steps per op name: {op: (calls per step, µs per step)}, those left > 0."""
    out = {}
    for name, (calls, us) in ops.items():
        base_calls, base_us = baseline.get(name, (0, 0.0))
        if calls > base_calls:  # an op the steps add (same count, other time: noise between the two runs)
            out[name] = ((calls - base_calls) / steps, max(us - base_us, 0.0) / steps)
    return out


def _print_ops(title: str, ops: dict[str, tuple[float, float]], path: Path) -> None:
    """The top operations by time as a table, printed and written to `path`."""
    total_calls = sum(c for c, _ in ops.values())
    total_us = sum(us for _, us in ops.values())
    lines = [f"### {title}", f"{total_calls:.0f} operations, {total_us:.0f} µs of operation time per step", "",
             "| operation | calls/step | µs/step | share |", "|---|---|---|---|"]  # fmt: skip
    for name, (calls, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]:
        lines.append(f"| `{name[:80]}` | {calls:.1f} | {us:.1f} | {us / max(total_us, 1e-9):.1%} |")
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(text + f"\n(trace and summary: {path.parent})", flush=True)


# --- the transformers parts -------------------------------------------------------------------------------------


def torch_config(cfg):
    """The transformers config of `cfg`'s shapes: the config.json jaxgen's export writes."""
    import transformers

    from jaxgen.hf.config import family_of, hf_config

    fields = hf_config(cfg, family_of(cfg))
    fields.pop("architectures", None)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _torch_model(cfg, train: bool = False):
    """A randomly initialised transformers model of `cfg`'s shapes, on the GPU if there is one: bfloat16
    weights for inference, float32 (under bfloat16 autocast) for training."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            torch_config(cfg), dtype=torch.float32 if train else torch.bfloat16, attn_implementation="sdpa"
        )
    return model, device


def part_train_torch(shapes: Shapes, args) -> None:
    import gc

    import torch
    from vs_transformers import bench_train_torch

    configs = part_configs(shapes)
    seq = shapes.train_seq
    for rows in shapes.train_rows:
        cfg = configs[f"train {rows}"].run.model
        print(f"## train step (transformers): {shapes.small}, {rows} x {seq} tokens, SDPA, bfloat16 autocast, "
              "no remat, AdamW", flush=True)  # fmt: skip
        try:
            model, device = _torch_model(cfg, train=True)
            tok_s = bench_train_torch(model, rows, seq, shapes.repeats, cfg.vocab_size, autocast=torch.bfloat16)
        except torch.OutOfMemoryError as e:
            print(f"{rows} rows do not fit: {str(e).splitlines()[0][:200]}", flush=True)
        else:
            report(rows=rows, seq=seq, tok_s=tok_s, device=device)
            return
        model = None  # the failed try's model, gradients and optimizer state, freed before the next
        gc.collect()
        torch.cuda.empty_cache()
    raise RuntimeError(f"no row count of {shapes.train_rows} fits")


class _Stamps:
    """A `generate` streamer that keeps the time of each put (the prompt, then every new token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _torch_per_token(side, prompt: list[int], new_tokens: int, repeats: int, warm_ups: int, **options) -> float:
    """Seconds per decode step: the time between the first and the last new token / their distance (the
    first token comes from prefill), best of `repeats` after `warm_ups` runs (compiling, graph capture).
    generate waits for each token on the host either way (its stopping check), so the stamps cost nothing."""
    best = float("inf")
    for i in range(warm_ups + repeats):
        stamps = _Stamps()
        side.generate([prompt], new_tokens, streamer=stamps, **options)
        if i >= warm_ups:
            best = min(best, (stamps.times[-1] - stamps.times[1]) / (len(stamps.times) - 2))
    return best


def part_decode_torch(shapes: Shapes, args) -> None:
    from vs_transformers import TorchSide

    part = part_configs(shapes)["decode small"]
    model, device = _torch_model(part.run.model)
    side = TorchSide(model, device)
    prompt = list(range(1, part.prompt + 1))
    print(f"## decode at batch 1 (transformers): {shapes.small}, {part.prompt} + {part.new_tokens}, {device}",
          flush=True)  # fmt: skip
    eager = _torch_per_token(side, prompt, part.new_tokens, shapes.repeats, warm_ups=1)
    print(f"eager {eager * 1e3:.2f} ms per token", flush=True)
    report(eager_ms=eager * 1e3)
    # on a GPU, generate compiles the forward itself for a static cache (torch.compile, CUDA graphs)
    static = _torch_per_token(side, prompt, part.new_tokens, shapes.repeats, 2, cache_implementation="static")
    label = "static cache + torch.compile" if device == "cuda" else "static cache (compiled on a GPU only)"
    print(f"{label} {static * 1e3:.2f} ms per token", flush=True)
    report(eager_ms=eager * 1e3, compiled_ms=static * 1e3, compiled=device == "cuda")


def part_batch_torch(shapes: Shapes, args) -> None:
    from vs_transformers import TorchSide

    part = part_configs(shapes)["batch"]
    model, device = _torch_model(part.run.model)
    side = TorchSide(model, device)
    b = shapes.batch
    print(f"## static batch (transformers eager generate): {b} x ({part.prompt} + {part.new_tokens})", flush=True)
    prompts = _prompts(b, part.prompt, seed=0)
    side.generate(prompts, part.new_tokens)  # warm-up
    best = float("inf")
    for _ in range(shapes.repeats):
        t0 = time.perf_counter()
        side.generate(prompts, part.new_tokens)
        best = min(best, time.perf_counter() - t0)
    report(tok_s=b * part.new_tokens / best, seconds=best)


# --- the parent: parts in child processes, then the tables --------------------------------------------------------

# name -> (function, time budget in seconds on the accelerator, uses torch). jaxgen's parts first: should the
# whole budget run out, what goes is a comparison, not a figure of jaxgen's. The budgets are caps; estimated
# from issue 50's H200 figures (first calls 12-15 s), the parts take about 15, 90, 90, 30, 45, 100, 25, 35 s.
PARTS = {
    "cudnn": (part_cudnn, 60, False),
    "decode-jax": (part_decode_jax, 150, False),
    "engine-jax": (part_engine_jax, 150, False),
    "batch-jax": (part_batch_jax, 60, False),
    "train-jax": (part_train_jax, 120, False),
    "decode-torch": (part_decode_torch, 150, True),
    "batch-torch": (part_batch_torch, 60, True),
    "train-torch": (part_train_torch, 90, True),
}


def run_part(name: str, args, budget: float) -> tuple[list[dict], str]:
    """Runs one part in a child process, its output passed through as it comes; returns (its reports,
    its error or ''). A child past `budget` seconds is killed."""
    command = [sys.executable, __file__, "--part", name, "--remat", args.remat]
    command += ["--smoke"] if args.smoke else []
    command += ["--cpu-proxy"] if args.cpu_proxy else []
    command += ["--trace-dir", str(args.trace_dir)] if args.trace_dir else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if PARTS[name][2]:
        env["JAX_PLATFORMS"] = "cpu"  # torch's part: jax (imported with jaxgen) must not take device memory
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the rows that fit: most of the chip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pipe, args=(child.stdout, lines), daemon=True).start()
    deadline, reports, tail = time.monotonic() + budget, [], []
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            child.kill()
            child.wait()
            return reports, f"over its budget of {budget:.0f} s: stopped"
        if line is None:  # the child closed its output
            break
        if line.startswith(RESULT):
            reports.append(json.loads(line[len(RESULT) :]))
        else:
            print(line, end="", flush=True)
            tail = [*tail, line.strip()][-3:]
    child.wait()
    return reports, "" if child.returncode == 0 else f"exit {child.returncode}: {' / '.join(tail)}"


def _pipe(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def print_tables(results: dict[str, dict], errors: dict[str, str], shapes: Shapes) -> None:
    def get(part, key, fmt="{:,.0f}"):
        value = results.get(part, {}).get(key)
        if value is None:
            return f"({errors.get(part) or 'not run'})"[:60]
        return "n/a" if value != value else fmt.format(value)  # NaN: no peak known for this device

    print("\n# Summary\n\n## Training, one step (rows x tokens)")
    print("| | rows | tokens/s | MFU |\n|---|---|---|---|")
    ours = [get("train-jax", "rows"), get("train-jax", "tok_s"), get("train-jax", "mfu", "{:.1%}")]
    print("| jaxgen | " + " | ".join(ours) + " |")
    print(f"| transformers | {get('train-torch', 'rows')} | {get('train-torch', 'tok_s')} | |")
    print("\n## Decode at batch 1, ms per token")
    print("| model | jaxgen | transformers eager | transformers static + compile | floor | jaxgen / floor |")
    print("|---|---|---|---|---|---|")
    for key in ("decode small", "decode large"):
        row = results.get("decode-jax", {}).get(key)
        theirs = [get("decode-torch", k, "{:.2f}") for k in ("eager_ms", "compiled_ms")] if "small" in key else ["", ""]
        ours = [f"{row['ms']:.2f}", f"{row['floor_ms']:.2f}", f"{row['ms'] / row['floor_ms']:.1f}x"] if row else []
        ours = ours or [get("decode-jax", "ms"), "", ""]
        print(f"| {row['model'] if row else key} | " + " | ".join([ours[0], *theirs, *ours[1:]]) + " |")
    print(f"\n## Batches of {shapes.batch_prompt} + {shapes.batch_new} tokens ({shapes.batch} rows or slots, "
          f"the engine {shapes.requests} requests), output tokens/s")  # fmt: skip
    print("| jaxgen Generator, static batch | transformers eager, static batch | jaxgen engine, fresh prompts | "
          "engine / static | compilations in the timed run |\n|---|---|---|---|---|")  # fmt: skip
    gen, eng = results.get("batch-jax", {}).get("tok_s"), results.get("engine-jax", {}).get("tok_s")
    ratio = f"{eng / gen:.2f}x" if gen and eng else ""
    print(f"| {get('batch-jax', 'tok_s')} | {get('batch-torch', 'tok_s')} | {get('engine-jax', 'tok_s')} | {ratio} "
          f"| {get('engine-jax', 'compilations')} |")  # fmt: skip
    if "cudnn" in results:
        print(f"\ncuDNN vs dense: gradients within {results['cudnn']['grad_error']:.2%} of the largest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
    parser.add_argument(
        "--cpu-proxy",
        action="store_true",
        help="the tiny model at the full batch shapes (64 x 128 + 128, 256 requests): engine / static on CPU",
    )
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="default: all")
    parser.add_argument("--trace-dir", type=Path, help="write device traces and their summaries under this folder")
    parser.add_argument("--remat", default="dots_no_batch", help="model.remat of jaxgen's train step")
    parser.add_argument("--budget", type=float, help="seconds for every part together (480; --smoke: 3600)")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # a child process: run this part
    args = parser.parse_args()
    shapes = dataclasses.replace(CPU_PROXY if args.cpu_proxy else SMOKE if args.smoke else Shapes(), remat=args.remat)
    if args.part:
        from jaxgen.runtime import enable_compilation_cache

        enable_compilation_cache()
        PARTS[args.part][0](shapes, args)
        return
    part_configs(shapes)  # every configuration checked before any part starts
    budget = args.budget or (3600.0 if args.smoke or args.cpu_proxy else 480.0)
    start, results, errors = time.monotonic(), {}, {}
    for name in args.parts:
        left = budget - (time.monotonic() - start)
        if left < 10:
            errors[name] = "skipped: the time budget is spent"
            print(f"\n[{name}] {errors[name]}")
            continue
        print(f"\n[{name}]", flush=True)
        t0 = time.monotonic()
        reports, error = run_part(name, args, left if args.smoke or args.cpu_proxy else min(PARTS[name][1], left))
        for r in reports:
            results.setdefault(name, {}).update(r)
        if error:
            errors[name] = error
            print(f"[{name}] failed: {error}")
        print(f"[{name}] {time.monotonic() - t0:.0f} s", flush=True)
    print_tables(results, errors, shapes)


if __name__ == "__main__":
    main()
