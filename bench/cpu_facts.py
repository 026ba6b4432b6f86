"""The cheap "CPU facts" of docs/performance.md, measured again on the jax installed (run it after a jax change).

    python bench/cpu_facts.py [--parts cache matvec compile mesh memory] [--repeats 20]

cache    per-step time of a donated decode-like loop writing one token a step into each layer's cache at 256
         and at 4096 slots: float32 and uint16 (bfloat16 bits) in place should not grow, bfloat16 is rewritten
         whole on XLA:CPU (grows with the slots); the same float32 cache passed through `lax.scan` as xs/ys
         grows too (copied every step).
matvec   x (B, 2048) times w (2048, 8192) at B = 1, 8, 32: float32, bfloat16 with float32 accumulation, int8
         converted to float32 in the jitted function, int8 x int8 with int32 accumulation.
compile  the persistent compilation cache: one program compiled in a fresh process, cold and then from the cache.
mesh     `jax.make_mesh`'s default axis types, and whether a product over a sharded contracting dimension runs
         under Explicit and under Auto axes (8 fake devices).
memory   `memory_analysis()` of a program compiled from sharded `ShapeDtypeStruct`s (an 8192^2 float32 weight
         split 8 ways: 33.6 MB of arguments per device), nothing allocated.

Times are the best of --repeats (bench/timing.py); compare ratios within one run, the machine may be shared.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib

jax.config.update("jax_num_cpu_devices", 8)  # the mesh and memory parts; timed programs run on device 0

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import best_seconds  # noqa: E402

LAYERS, HEADS, HEAD_DIM, STEPS = 8, 4, 64, 64  # a cache of 8 layers x 4 kv heads x 64: 32 MB float32 at 4096 slots


def _write_loop(dtype, through_scan: bool):
    """A jitted, donated loop of STEPS steps, each writing one token into every layer's (1, K, S, H) cache
    (float32 arithmetic, then stored as `dtype`), as a decode step does; returns the caches."""

    def token(c, i, layer):
        new = jnp.tanh(jnp.full((1, HEADS, 1, HEAD_DIM), i + layer, jnp.float32))  # f32 work, as a model's
        if dtype == jnp.uint16:
            return jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
        return new.astype(dtype)

    def step(i, caches):
        if through_scan:  # the per-layer caches as scan's xs and ys

            def body(carry, xs):
                c, layer = xs
                return carry, jax.lax.dynamic_update_slice(c, token(c, i, layer), (0, 0, i, 0))

            return jax.lax.scan(body, 0, (caches, jnp.arange(LAYERS)))[1]
        return tuple(jax.lax.dynamic_update_slice(c, token(c, i, l), (0, 0, i, 0)) for l, c in enumerate(caches))

    @functools.partial(jax.jit, donate_argnums=0)
    def run(caches):
        return jax.lax.fori_loop(0, STEPS, step, caches)

    return run


def cache_part(repeats: int) -> None:
    print("cache: per-step time of a donated loop writing one token into 8 layers' caches")
    print(f"{'cache':<28} {'256 slots':>10} {'4096 slots':>11} {'ratio':>6}")
    for name, dtype, scan in [
        ("float32", jnp.float32, False),
        ("bfloat16", jnp.bfloat16, False),
        ("uint16 (bfloat16 bits)", jnp.uint16, False),
        ("float32 via scan xs/ys", jnp.float32, True),
    ]:
        per_step = []
        for slots in (256, 4096):
            run = _write_loop(dtype, scan)
            shape = (LAYERS, 1, HEADS, slots, HEAD_DIM) if scan else (1, HEADS, slots, HEAD_DIM)
            state = [jnp.zeros(shape, dtype) if scan else tuple(jnp.zeros(shape, dtype) for _ in range(LAYERS))]

            def call(run=run, state=state):
                state[0] = run(state[0])
                return state[0]

            per_step.append(best_seconds(call, repeats) / STEPS)
        print(f"{name:<28} {per_step[0] * 1e3:>8.3f}ms {per_step[1] * 1e3:>9.3f}ms {per_step[1] / per_step[0]:>6.1f}")


def matvec_part(repeats: int) -> None:
    print("matvec: x (B, 2048) times w (2048, 8192), ms per call")
    rng = np.random.default_rng(0)
    w32 = jnp.asarray(rng.standard_normal((2048, 8192), np.float32))
    w16, w8 = w32.astype(jnp.bfloat16), jnp.clip(jnp.round(w32 * 40), -127, 127).astype(jnp.int8)

    def int8_int8(x, w):
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
        xq = jnp.round(x / scale).astype(jnp.int8)
        return jax.lax.dot(xq, w, preferred_element_type=jnp.int32).astype(jnp.float32) * scale

    kinds = {
        "float32": (lambda x, w: x @ w, w32),
        "bfloat16, f32 accumulation": (
            lambda x, w: jax.lax.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32),
            w16,
        ),
        "int8 -> float32, then dot": (lambda x, w: x @ w.astype(jnp.float32), w8),
        "int8 x int8, int32 accumulation": (int8_int8, w8),
    }
    batches = (1, 8, 32)
    print(f"{'weights':<34}" + "".join(f"{'B=' + str(b):>9}" for b in batches))
    for name, (fn, w) in kinds.items():
        fn = jax.jit(fn)
        row = [best_seconds(lambda x=jnp.ones((b, 2048), jnp.float32), fn=fn, w=w: fn(x, w), repeats) for b in batches]
        print(f"{name:<34}" + "".join(f"{t * 1e3:>9.2f}" for t in row))


def _compile_child(cache_dir: str) -> None:
    """Compile one mid-sized program (an unrolled chain of 60 products) and print the seconds it took."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    def f(x):
        for i in range(60):
            x = jnp.tanh(x @ x.T + i) * 0.5
        return x

    t0 = time.perf_counter()
    jax.jit(f).lower(jnp.ones((256, 256))).compile()
    print(f"{time.perf_counter() - t0:.3f}")


def compile_part() -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        cmd = [sys.executable, __file__, "--compile-child", cache_dir]
        cold, warm = (float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout) for _ in range(2))
        print(f"compile: a fresh process compiles in {cold:.2f} s cold, {warm:.2f} s from the persistent cache")


def mesh_part() -> None:
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    default = jax.make_mesh((8,), ("x",)).axis_types
    print(f"mesh: jax.make_mesh's default axis types: {default}")
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
        a = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "x")))
        b = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("x", None)))
        try:
            with jax.set_mesh(mesh):
                jax.jit(lambda a, b: a @ b)(a, b).block_until_ready()
            outcome = "runs"
        except Exception as e:
            outcome = f"fails: {type(e).__name__}"
        print(f"mesh: a product over a sharded contracting dim with {kind.name} axes {outcome}")


def memory_part() -> None:
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    w = jax.ShapeDtypeStruct((8192, 8192), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    out = NamedSharding(mesh, P("x", None))
    stats = jax.jit(lambda w: w * 2.0, out_shardings=out).lower(w).compile().memory_analysis()
    print(
        f"memory: an 8192^2 float32 weight split 8 ways: {stats.argument_size_in_bytes / 1e6:.1f} MB of arguments, "
        f"{stats.output_size_in_bytes / 1e6:.1f} MB of outputs per device"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["cache", "matvec", "compile", "mesh", "memory"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_child:
        return _compile_child(args.compile_child)
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.default_backend()}, {os.cpu_count()} cores")
    parts = {
        "cache": lambda: cache_part(args.repeats),
        "matvec": lambda: matvec_part(args.repeats),
        "compile": compile_part,
        "mesh": mesh_part,
        "memory": memory_part,
    }
    for part in args.parts:
        parts[part]()


if __name__ == "__main__":
    main()
