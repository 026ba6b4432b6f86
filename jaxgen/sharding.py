"""Logical axis names and the one rules table that maps them onto the device mesh.

Axis glossary (used in names, einsum strings and shape comments across jaxgen):
    B batch, T query length, S key/cache length, D model width, N query heads, K kv heads,
    G query heads per kv head (N = K * G), H head dim, F mlp width, V vocab, L layers, E experts,
    M tokens flattened (B * T), A (token, expert) assignments (M * k).

Mesh axes: data (batch rows), fsdp (batch rows and parameter rows), context (a sequence's tokens:
context parallelism, only in a mesh whose `mesh.context` > 1; parameter rows too, with fsdp), tensor
(heads, MLP width, vocab).

Every parameter and the main activations carry logical names (below); `RULES` maps each to mesh
axes. A dimension that the mesh axes do not divide is replicated instead (e.g. one kv head under
tensor parallelism), so every config runs on every mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxgen.config import MeshConfig

MESH_AXES = ("data", "fsdp", "context", "tensor")  # every axis a mesh may have (context only when > 1)

# logical name -> mesh axes (None: replicated)
RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": ("data", "fsdp"),
    # parameter rows (and their gradients and moments) are split by FSDP, gathered for compute; on a
    # context mesh over fsdp x context too (activations keep context for their tokens), as MaxText does
    "embed": ("fsdp", "context"),
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "tensor",  # expert parallelism: each device holds E / tensor whole experts (F then stays whole)
    "head_dim": None,
    "layers": None,
    "seq": "context",  # activations' tokens (T); replicated on a mesh without a context axis
    "cache_seq": None,
    "act_embed": None,  # activations keep the model width whole
}


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh, or (data, fsdp, context, tensor) with `cfg.context` > 1, with Auto
    axes (classic GSPMD propagation)."""
    devices = list(jax.devices() if devices is None else devices)
    shape, names = cfg.shape(len(devices)), cfg.axes()
    devices = devices[: math.prod(shape)]
    return Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def _axis_size(mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def _present(axes, mesh):
    """`axes` less those `mesh` lacks (None when none is left; one axis as its name)."""
    return _kept(axes, lambda a: a in mesh.axis_names)


def _kept(axes, keep):
    """The mesh axes of `axes` that `keep` accepts: None when none is left, one axis as its name."""
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if keep(a))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _dividing(axes, size: int, mesh):
    """The longest leading run of `axes` whose product divides `size` (a single axis as its name), or None:
    a parameter row that fsdp x context does not divide splits over fsdp alone."""
    axes = (axes,) if isinstance(axes, str) else axes  # one axis (no context on the mesh): nothing shorter
    for n in range(len(axes) - 1, 0, -1):
        if size % _axis_size(mesh, axes[:n]) == 0:
            return axes[0] if n == 1 else axes[:n]
    return None


def context_size(mesh=None) -> int:
    """The size of the `context` axis of `mesh` (default: the current mesh); 1 without one."""
    return axis_size("context", mesh)


def axis_size(axis: str, mesh=None) -> int:
    """The size of mesh axis `axis` of `mesh` (default: the current mesh); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return 1 if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]


# mesh axes an enclosing `jax.vmap(..., spmd_axis_name=...)` splits its mapped axis over: no constraint inside
# may name them again (`vmapped_over`)
_VMAPPED = contextvars.ContextVar("jaxgen_vmapped_axes", default=frozenset())


@contextlib.contextmanager
def vmapped_over(*axes: str):
    """Within: the activations' constraints leave `axes` out, for code traced under `jax.vmap` with
    `spmd_axis_name=axes` (the mapped axis is split over them; e.g. one data replica's rows per device)."""
    token = _VMAPPED.set(_VMAPPED.get() | frozenset(axes))
    try:
        yield
    finally:
        _VMAPPED.reset(token)


def logical_spec(names: tuple[str | None, ...], shape: tuple[int, ...] | None = None, mesh=None) -> PartitionSpec:
    """PartitionSpec for logical axis names; drops mesh axes that do not divide the dimension, and a
    mesh axis an earlier dimension already uses (experts over tensor leave their F axis whole), one
    the mesh does not have (context), and one an enclosing vmap splits over (`vmapped_over`: "batch" is
    then split over fsdp alone)."""
    vmapped = _VMAPPED.get()
    spec, used = [], set(vmapped)
    for i, name in enumerate(names):
        axes = RULES[name] if name is not None else None
        if axes is not None and vmapped:
            axes = _kept(axes, lambda a: a not in vmapped)
        if axes is not None and mesh is not None:
            axes = _present(axes, mesh)
        if axes is not None and mesh is not None and shape[i] % _axis_size(mesh, axes) != 0:
            axes = _dividing(axes, shape[i], mesh) if name == "embed" else None
        if axes is not None and used & set((axes,) if isinstance(axes, str) else axes):
            axes = None
        if axes is not None:
            used |= set((axes,) if isinstance(axes, str) else axes)
        spec.append(axes)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, names, shape) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(tuple(names), tuple(shape), mesh))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation under the current mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, x.shape, mesh))


def per_device(local, in_specs, out_specs, *args):
    """`local(*args)` on each device's shards under the current mesh (`shard_map` over `in_specs` and
    `out_specs`), or as it is without a mesh of several devices: for kernels the compiler does not partition
    (Mosaic's: `kernels.splash`, `kernels.paged_tpu`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(*args)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def batch_sharding(mesh: Mesh, shape) -> NamedSharding:
    """Batches: leading axis over data and fsdp, the rest replicated."""
    return named_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape)


def check_spans_processes(mesh: Mesh, what: str) -> None:
    """Raises ValueError unless every process has a device in `mesh` (a process without one could not take
    part in its programs, and the others would wait for it)."""
    covered = {d.process_index for d in mesh.devices.flat}
    if len(covered) != jax.process_count():
        raise ValueError(
            f"{what} uses {mesh.size} of {jax.device_count()} devices, on processes {sorted(covered)} of "
            f"{jax.process_count()}: every process needs devices in it (use -1 for one size, to take them all)"
        )


def process_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global batch whose shards live on this process's devices: what this process loads.

    One contiguous run (devices are ordered by process, and the batch axis is split in order); the whole
    batch when the batch axis is not split across processes (e.g. a mesh that is all tensor parallel).
    """
    shape = (batch_size,)
    index = batch_sharding(mesh, shape).addressable_devices_indices_map(shape).values()
    starts = {idx[0].indices(batch_size)[:2] for idx in index}
    lo, hi = min(a for a, _ in starts), max(b for _, b in starts)
    if sum(b - a for a, b in starts) != hi - lo or batch_size % (hi - lo) or lo % (hi - lo):
        raise ValueError(f"this process's rows of the batch {sorted(starts)} are not one aligned run of {batch_size}")
    return slice(lo, hi)


def with_mesh(fn, mesh):
    """`fn` called under `jax.set_mesh(mesh)` (so `constrain` applies); no-op wrapper when mesh is None.
    The wrapped function is kept as `.jitted` (for `.lower()` in benchmarks and tests)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if mesh is None:
            return fn(*args, **kwargs)
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    call.jitted = fn
    return call
