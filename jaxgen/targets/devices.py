"""Compile-only devices of a target, meshes of them, and tracing as their backend does.

    mesh = target_mesh(get("tpu-v5p-8"), {"fsdp": 2, "tensor": 2})   # 4 devices no program can run on
    with traced_for(target):
        compiled = jax.jit(f).lower(*abstract_args_on(mesh)).compile()   # libtpu's compiler

The compilers are plugins that run without a device under `JAX_PLATFORMS=cpu` (libtpu for TPU, the CUDA
plugin for NVIDIA GPUs); `jax.experimental.topologies` hands out their devices. Their platforms must
stay out of jax's backends (the CUDA plugin's version check fails without a GPU), so the command lines
set `jax_platforms` to cpu before the first backend starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import jax

from jaxgen.runtime import assume_no_tpu_vm
from jaxgen.targets.catalog import CPU, Target

INSTALL = {
    "tpu": "pip install 'jaxgen[tpu-compile]' (libtpu, TPU's compiler)",
    "cuda": "pip install 'jaxgen[gpu-compile]' (the CUDA plugin, XLA:GPU's compiler)",
}
_MODULE = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}


def unavailable(target: Target) -> str | None:
    """Why this machine cannot compile for `target` (one line naming what to install), or None."""
    try:
        found = importlib.util.find_spec(_MODULE[target.platform]) is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        found = False
    return None if found else f"the compiler for {target.name} is not installed: {INSTALL[target.platform]}"


def compile_devices(target: Target) -> list:
    """`target.chips` compile-only devices of `target`, in the topology's order. ValueError (what to
    install) where its compiler is missing."""
    if reason := unavailable(target):
        raise ValueError(reason)
    from jax.experimental import topologies

    if target.platform == "tpu":
        assume_no_tpu_vm()  # compile-only: no TPU VM to look for
        desc = topologies.get_topology_desc(target.topology, "tpu")
    else:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target.spec_text(), topology=target.topology)
    return list(desc.devices)


def target_mesh(target: Target | None, sizes: dict[str, int]):
    """A jaxgen mesh (`sharding.make_mesh`) of `sizes` over `target`'s devices; over this process's
    (fake CPU) devices when `target` is None. ValueError when the mesh needs another number of chips."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    if target is None:
        return make_mesh(MeshConfig(**sizes))
    n = math.prod(sizes.values())
    if n != target.chips:
        shown = ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "1 device"
        raise ValueError(f"--mesh {shown} is not allowed on {target.name}: {n} devices; the target has {target.chips}")
    return make_mesh(MeshConfig(**sizes), compile_devices(target))


def compiler_name(target: Target | None) -> str:
    """Who compiles for `target`, for the first line of every answer."""
    if target is None:
        return "XLA:CPU for fake CPU devices (an estimate of a GPU or TPU compiler's memory)"
    kind = target.chip.kind
    return f"libtpu for {target.chips} x {kind}" if target.platform == "tpu" else f"XLA:GPU for {target.chips} x {kind}"


def backend_of(target: Target | None) -> str:
    """What `jax.default_backend()` answers on `target`'s real devices."""
    return CPU if target is None else {"tpu": "tpu", "cuda": "gpu"}[target.platform]


@contextlib.contextmanager
def traced_for(backend: str):
    """Within: `jax.default_backend()` answers `backend` ("tpu", "gpu", "cpu"). jaxgen's per-backend choices
    (`kernels.choose`, `kernels.cache_layout`, `storage.storage_dtype`, `moe`'s kernel, `kernels.cpu`'s
    tuning) ask it while tracing; under `JAX_PLATFORMS=cpu` it says cpu, so a program traced for a target
    would otherwise take the CPU paths."""
    real = jax.default_backend
    jax.default_backend = lambda: backend
    try:
        yield
    finally:
        jax.default_backend = real
