"""The accelerator check: one script, about 5-8 minutes on one GPU (written for an H200), that proves the
code paths this CPU machine cannot run and measures them against the hardware's limits.

    python bench/accelerator.py                 # on the accelerator: every part, a table per part
    python bench/accelerator.py --smoke         # anywhere: a tiny config, the same code paths (CPU check)

1. cuDNN attention equals the dense reference, forward and gradients, bfloat16 (skipped off GPU).
2. Train step of a ~1B Llama (configs/llama-3.2-1b.yaml shapes) in bfloat16 with model.attention_impl=auto
   (cudnn on GPU) and a remat policy: tokens/s and MFU against the chip's dense bf16 peak.
3. Decode at batch 1 with bfloat16 weights: time per token against the floor, bytes of weights and cache
   read per step / HBM bandwidth.
4. The serving engine at 64 slots: output tokens/s over a batch of requests.
Random weights throughout (speed does not depend on them). Peak figures per chip are the vendors'.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# device kind (substring of jax's device_kind) -> (dense bf16 FLOP/s, HBM bytes/s)
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "TPU v5p": (459e12, 2.76e12)}


def peaks() -> tuple[float, float, str]:
    import jax

    kind = jax.devices()[0].device_kind
    for name, (flops, bandwidth) in PEAKS.items():
        if name in kind:
            return flops, bandwidth, kind
    return float("nan"), float("nan"), kind


def check_cudnn() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgen.config import ModelConfig
    from jaxgen.model import attention, kernels

    print("## 1. cuDNN attention vs dense (bfloat16, B=2, T=1024, 16 heads over 4 kv heads, packed segments)")
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
    for name, x, y in zip("qkv", ga, gb, strict=True):
        err = float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
        scale = float(jnp.abs(x.astype(jnp.float32)).max())
        print(f"d{name}: max |cudnn - dense| = {err:.3g} ({err / scale:.2%} of the largest)")


def train_mfu(smoke: bool, seq: int, batch: int, remat: str, steps: int = 5) -> None:
    from timing import best_seconds
    from train_throughput import synthetic_batch

    from jaxgen import model
    from jaxgen.config import MeshConfig, load_config
    from jaxgen.model import kernels
    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_train_state, make_train_step, put_batch

    name = "tiny" if smoke else "llama-3.2-1b"
    overrides = [f"data.seq_len={seq}", f"training.batch_size={batch}", f"model.remat={remat}"]
    overrides += ["model.dtype=bfloat16", f"model.max_seq_len={max(seq, 128)}"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
    print(f"\n## 2. train step: {name}, {batch} x {seq} tokens, bfloat16, remat={remat}, "
          f"attention={kernels.choose(cfg.model)}")  # fmt: skip
    mesh = make_mesh(cfg.mesh)
    state = create_train_state(cfg, mesh)
    step = make_train_step(cfg, mesh, state)
    data = put_batch(synthetic_batch(batch, seq, cfg.model.vocab_size), mesh)
    box = [state]

    def run():
        box[0], metrics = step(box[0], data)
        return metrics["loss"]

    t0 = time.perf_counter()
    jax_first = run()
    float(jax_first)
    print(f"first step (compile + run): {time.perf_counter() - t0:.1f} s")
    seconds = best_seconds(run, steps)
    flops, _, kind = peaks()
    tokens = batch * seq
    achieved = model.flops_per_token(cfg.model, seq) * tokens / seconds
    print("| step | tokens/s | model TFLOP/s | MFU |\n|---|---|---|---|")
    print(f"| {seconds:.3f} s | {tokens / seconds:,.0f} | {achieved / 1e12:.1f} | {achieved / flops:.1%} of {kind} |")


def decode_floor(smoke: bool, new_tokens: int) -> None:
    import jax
    import jax.numpy as jnp

    from jaxgen import model
    from jaxgen.config import load_config
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.model.kvcache import cache_memory_bytes
    from jaxgen.tokenizer import Tokenizer

    name = "tiny" if smoke else "llama-3.2-1b"
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", ["model.dtype=bfloat16", "model.max_seq_len=2048"]).model
    print(f"\n## 3. decode at batch 1: {name}, bfloat16 weights and cache, {new_tokens} new tokens")
    init = jax.jit(lambda: model.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), init())
    gen = Generator(params, cfg, Tokenizer.byte_level(), max_batch=1, chunk_steps=new_tokens, cache_dtype="bfloat16")
    prompt = list(range(1, 65))
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], sampling)  # compile
    short = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], short)
    t_full = min(_timed(lambda: gen.generate([prompt], sampling)) for _ in range(3))
    t_prefill = min(_timed(lambda: gen.generate([prompt], short)) for _ in range(3))
    per_token = (t_full - t_prefill) / (new_tokens - 1)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    cache = cache_memory_bytes(cfg, 1, 128 + new_tokens, "bfloat16") / 2  # on average half the cache is read
    _, bandwidth, kind = peaks()
    floor = (weights + cache) / bandwidth
    print("| per token | tokens/s | floor (bytes / HBM bandwidth) | floor / actual |\n|---|---|---|---|")
    ratio = floor / per_token
    print(f"| {per_token * 1e3:.2f} ms | {1 / per_token:,.0f} | {floor * 1e3:.3f} ms ({kind}) | {ratio:.1%} |")


def engine_throughput(smoke: bool, requests: int, slots: int) -> None:
    import jax
    import numpy as np

    from jaxgen import model
    from jaxgen.config import ServeConfig, load_config
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    name = "tiny" if smoke else "llama-3.2-1b"
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", ["model.dtype=bfloat16", "model.max_seq_len=1024"]).model
    print(f"\n## 4. engine: {name}, {slots} slots, {requests} requests of 128 prompt + 128 new tokens")
    params = model.init_params(cfg, jax.random.key(0))
    serve = ServeConfig(slots=slots, kv_memory_gb=0.05 if smoke else 16.0, chunk_steps=16, cache_dtype="bfloat16")
    engine = Engine(params, cfg, Tokenizer.byte_level(), serve)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, 128).tolist() for _ in range(requests)]
    sampling = SamplingConfig(max_new_tokens=128, temperature=0.0, ignore_eos=True)
    for p in prompts[:slots]:  # warm-up: compile every program
        engine.submit(p, sampling)
    engine.run_until_idle()
    t0 = time.perf_counter()
    handles = [engine.submit(p, sampling)[0] for p in prompts]
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    tokens = sum(len(h.tokens) for h in handles)
    print(f"| output tokens | seconds | tokens/s |\n|---|---|---|\n| {tokens} | {wall:.2f} | {tokens / wall:,.0f} |")


def _timed(fn) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny config, to check the script on CPU")
    parser.add_argument("--seq", type=int, default=4096, help="training tokens per row (default 4096)")
    parser.add_argument("--batch", type=int, default=8, help="training rows (default 8)")
    parser.add_argument("--remat", default="dots_no_batch", help="model.remat of the train step")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--slots", type=int, default=64)
    args = parser.parse_args()
    from jaxgen.runtime import enable_compilation_cache

    enable_compilation_cache()
    if args.smoke:
        args.seq, args.batch, args.new_tokens, args.requests, args.slots = 64, 2, 16, 8, 4
    check_cudnn()
    train_mfu(args.smoke, args.seq, args.batch, args.remat)
    decode_floor(args.smoke, args.new_tokens)
    engine_throughput(args.smoke, args.requests, args.slots)


if __name__ == "__main__":
    main()
