"""Compiling for an NVIDIA GPU this machine lacks, and counting what a compiled loop launches per step.

    device = cuda_device(spec_text)                  # None (and why: `unavailable`) without the plugin
    text = decode_loop_text(generator, prompts, sampling, device)
    loop_ops(text)                                   # the decode loop body's operations, by opcode

The CUDA plugin (`pip install '.[gpu-compile]'`) compiles for a GPU described by a target config, a
`GpuTargetConfigProto` text (bench/gpu_specs/), under `JAX_PLATFORMS=cpu` and without a device:
`jax.experimental.topologies` gives a device of that GPU to place abstract arguments on, and the program
is XLA:GPU's optimised HLO, the kernels a real GPU would launch (bench/decode.py, tests/test_gpu_compile.py).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import re

import jax

# Instructions that launch nothing: they name buffers, pieces of tuples or views of them.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")


def unavailable() -> str | None:
    """Why this machine cannot compile for a CUDA target (the plugin is not installed), or None."""
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return "the CUDA plugin is not installed (pip install '.[gpu-compile]')"
    return None


def cuda_device(spec_text: str):
    """A device of the GPU that `spec_text` (a GpuTargetConfigProto text) describes, to place abstract
    arguments on for `lower(...).compile()`; None where the plugin is not installed (`unavailable`)."""
    if unavailable():
        return None
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=spec_text, topology="1x1x1").devices[0]


@contextlib.contextmanager
def traced_for(backend: str):
    """Within: `jax.default_backend()` answers `backend`. jaxgen's per-backend choices (`kernels.choose`,
    `kernels.cache_layout`, `storage.storage_dtype`, `kernels.cpu`'s tuning) ask it while tracing; under
    `JAX_PLATFORMS=cpu` it says cpu, so a program traced for a GPU target would take the CPU paths."""
    real = jax.default_backend
    jax.default_backend = lambda: backend
    try:
        yield
    finally:
        jax.default_backend = real


class _Caught(Exception):
    pass


def decode_loop_text(generator, prompts, sampling, device) -> str:
    """Optimised HLO text of the decode loop (`inference.decode.decode_loop`, its `lax.while_loop`) that
    `generator` (a `Generator`) runs for `prompts` under `sampling`, compiled for `device` (`cuda_device`)
    and traced as a GPU traces it (`traced_for`). The loop's arguments are caught on their way in (the
    prompts' prefill runs here; the loop does not), so the cache has the layout `generator`'s config
    builds on this machine: set `model.cache_layout` to compile the other."""
    caught, loop = {}, generator._loop

    def catch(params, state, cfg):
        caught.update(params=params, state=state, cfg=cfg)
        raise _Caught

    generator._loop = catch
    try:
        generator.generate(prompts, sampling)
    except _Caught:
        pass
    finally:
        generator._loop = loop
    args = placed(caught["params"], device), placed(caught["state"], device)
    with traced_for("gpu"):
        return loop.jitted.lower(*args, cfg=caught["cfg"]).compile().as_text()


def placed(tree, device):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s on `device` (nothing allocated)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Optimised HLO text as {computation name: its instruction lines}; the entry one also under "ENTRY"."""
    out, name = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            out[name] = []
            if line.startswith("ENTRY"):
                out["ENTRY"] = out[name]
        elif line.strip() == "}":
            name = None
        elif name is not None and _INSTRUCTION.match(line):
            out[name].append(line)
    return out


def ops(comps: dict[str, list[str]], name: str) -> collections.Counter:
    """The operations computation `name` runs, by opcode: one each (a fusion is one kernel, a cuBLAS
    call one custom-call, a conditional or a nested while one launch of their own), free ones (`FREE`)
    left out, and the computations a `call` runs (XLA:GPU's command buffers) counted in its place."""
    counts = collections.Counter()
    for line in comps[name]:
        op = _INSTRUCTION.match(line).group(1)
        if op == "call":
            counts += ops(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
        elif op not in FREE:
            counts[op] += 1
    return counts


def loop_ops(hlo_text: str) -> collections.Counter:
    """The operations of one iteration of the largest `while` loop the entry computation runs (the
    decode loop), by opcode (`ops`), with "total" the sum: what a step launches."""
    comps = computations(hlo_text)
    bodies = [re.search(r"body=%?([\w.\-]+)", line).group(1) for line in comps["ENTRY"] if " while(" in line]
    if not bodies:
        raise ValueError("the compiled program runs no while loop")
    counts = max((ops(comps, body) for body in bodies), key=lambda c: sum(c.values()))
    counts["total"] = sum(counts.values())
    return counts
