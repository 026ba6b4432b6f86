"""Generation speed: prefill, decode at several batch sizes, compilations of a mixed job, and the
batch-1 decode step against its memory-bandwidth floor; and what a decode step launches on an H200.

    python bench/decode.py [--configs gpt2-124m llama-small] [--new-tokens 128] [--job-prompts 200]
        [--cache-layout auto|blocks|flat] [--sm90-slots 512]

The floor of a decode step is (bytes of weights + bytes of KV cache read) / memory bandwidth, with the
bandwidth measured in the same run (a large array copy). Models use random weights, float32.
`--cache-layout` sets `model.cache_layout` (auto: blocks on CPU). The sm_90 line: the tiny model's decode
loop compiled for an H200 without a GPU (`jaxgen.targets.gpu`, needs `.[gpu-compile]`), the
conditionals and kernels each layer adds to a step, for both layouts of the contiguous cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import load_config
from jaxgen.inference.decode import bucket
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model.kvcache import cache_memory_bytes
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def memory_bandwidth(n_bytes: int = 512 * 2**20) -> float:
    """Bytes/s of a large memory copy (numpy, read + write counted): the best this machine streams."""
    src = np.ones(n_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(np.copyto, dst, src) for _ in range(5))
    return 2 * n_bytes / best


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def sm90_counts(slots: int) -> None:
    """The conditionals and kernels a layer adds to the tiny model's decode step compiled for sm_90 (batch
    1, `slots` cache slots), per cache layout: `targets.gpu`'s command line, a process of its own
    (the CUDA plugin registers only where jax starts on the cpu platform alone)."""
    cmd = [sys.executable, "-m", "jaxgen.targets.gpu", "--slots", str(slots)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        print(f"sm_90 decode step: not compiled ({(out.stderr.strip().splitlines() or ['no output'])[-1]})")
        return
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    each = lambda k: f"{k}: {counts[k]['conditional']} conds, {counts[k]['kernels']} kernels"
    row = ", ".join(map(each, ("flat", "blocks")))
    print(f"sm_90 decode step ({counts['device']}, tiny model, batch 1, {slots} slots), per layer: {row}")


def bench_model(name: str, new_tokens: int, batches: list[int], bandwidth: float, layout: str = "auto") -> None:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"model.cache_layout={layout}"]).model
    params = model.init_params(cfg, jax.random.key(0))
    tok = Tokenizer.byte_level()
    rng = np.random.default_rng(0)
    gen = Generator(params, cfg, tok, max_batch=max(batches), chunk_steps=new_tokens)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    prompt = rng.integers(0, 256, 128).tolist()
    gen.generate([prompt], greedy)  # compile
    t = min(_timed(gen.generate, [prompt], greedy) for _ in range(3))
    print(f"{name}: prefill batch 1 x 128 tokens: {t * 1e3:.0f} ms, {128 / t:.0f} tokens/s (incl. 1 sampled token)")
    weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    print(f"{'batch':>6}{'step ms':>9}{'tokens/s':>10}{'floor ms':>10}{'step/floor':>11}")
    for b in batches:
        prompts = [rng.integers(0, 256, 32).tolist() for _ in range(b)]
        sc = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        one = SamplingConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True)
        gen.generate(prompts, sc)  # compile
        full = min(_timed(gen.generate, prompts, sc) for _ in range(2))
        pre = min(_timed(gen.generate, prompts, one) for _ in range(2))
        step = (full - pre) / (new_tokens - 1)
        cache_len = min(bucket(bucket(32) + new_tokens), bucket(cfg.max_seq_len))
        floor = (weight_bytes + cache_memory_bytes(cfg, bucket(b, 1), cache_len)) / bandwidth
        print(f"{b:>6}{step * 1e3:>9.2f}{b / step:>10.0f}{floor * 1e3:>10.2f}{step / floor:>11.2f}", flush=True)


def bench_cache_length(name: str, batch: int, used: int, lengths: list[int], repeats: int, chunk: int = 32) -> None:
    """Time per decode step while the cache fills from `used - chunk` to `used` tokens, for several
    allocated cache lengths (the Generator's `min_cache_len`): one timed chunk of the real decode loop,
    the one after prefill and its first chunk, best of `repeats` runs taken in turns."""
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"model.max_seq_len={max(lengths)}"]).model
    params = model.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, used - 2 * chunk).tolist() for _ in range(batch)]
    sc = SamplingConfig(temperature=0.0, max_new_tokens=2 * chunk + 1, ignore_eos=True)
    gens = {
        n: Generator(params, cfg, Tokenizer.byte_level(), max_batch=batch, chunk_steps=chunk, min_cache_len=n)
        for n in lengths
    }
    times = dict.fromkeys(lengths, float("inf"))
    for _ in range(repeats + 1):  # the lengths in turns, so a slow spell does not fall on one; the first compiles
        for n, gen in gens.items():
            stamps = [time.perf_counter()]
            for _ in gen.stream(prompts, sc):
                stamps.append(time.perf_counter())
            times[n] = min(times[n], (stamps[2] - stamps[1]) / chunk)
    base = times[lengths[0]]
    row = ", ".join(f"{n} slots {t * 1e3:.1f} ms ({t / base:.2f}x)" for n, t in times.items())
    print(f"{name}: decode step at batch {batch} with {used - chunk}-{used} tokens in the cache: {row}")


def bench_job(name: str, prompts: int, layers: int) -> None:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"model.num_layers={layers}"]).model
    params = model.init_params(cfg, jax.random.key(0))
    gen = Generator(params, cfg, Tokenizer.byte_level(), max_batch=32)
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 513, prompts)
    batch = sorted((rng.integers(0, 256, n).tolist() for n in lengths), key=len)
    t0 = time.perf_counter()
    compile_time = 0.0
    for i in range(0, prompts, 32):
        before = gen.compilations
        dt = _timed(gen.generate, batch[i : i + 32], SamplingConfig(temperature=0.0, max_new_tokens=8))
        if gen.compilations > before:
            compile_time += dt  # batches that compiled: their time is mostly compiling
    total = time.perf_counter() - t0
    print(
        f"{name} ({layers} layers): {prompts} prompts, lengths 1-512, 8 new tokens each: "
        f"{gen.compilations} compilations, {total:.1f} s in all, {compile_time:.1f} s in batches that compiled"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["gpt2-124m", "llama-small"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--job-prompts", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each cache length (best counts)")
    parser.add_argument("--job-layers", type=int, default=2, help="depth of the model in the mixed job")
    parser.add_argument(
        "--cache-lengths",
        type=int,
        nargs="*",
        default=[256, 4096],
        help="allocated cache lengths to compare at batch 32 with 160 tokens in use",
    )
    parser.add_argument("--cache-layout", default="auto", choices=["auto", "blocks", "flat"])
    parser.add_argument("--sm90-slots", type=int, default=512, help="cache slots of the sm_90 count (0: skip it)")
    args = parser.parse_args()
    if args.sm90_slots:
        sm90_counts(args.sm90_slots)
    bw = memory_bandwidth()
    print(f"memory bandwidth (512 MiB numpy copy, best of 5): {bw / 1e9:.1f} GB/s")
    for name in args.configs if args.batches else []:
        bench_model(name, args.new_tokens, args.batches, bw, args.cache_layout)
    if args.cache_lengths:
        bench_cache_length(args.configs[-1], 32, 160, args.cache_lengths, args.repeats)
    if args.job_prompts:
        bench_job(args.configs[-1], args.job_prompts, args.job_layers)


if __name__ == "__main__":
    main()
