"""Process-wide JAX settings for the command lines (never applied on library import)."""

from __future__ import annotations

import os
import time

import jax


def enable_compilation_cache() -> None:
    """Compiled programs kept between runs, so a resumed or repeated run skips compiling: XLA's persistent
    compilation cache ($JAXGEN_XLA_CACHE, default ~/.cache/jaxgen/xla; an empty string disables it) for every
    program, and jaxgen's store of serialized executables ($JAXGEN_EXECUTABLES, default
    ~/.cache/jaxgen/executables; an empty string disables it: `jaxgen.executables`) for the engine's, the
    train step's and RL's programs, which are then loaded without tracing."""
    path = os.environ.get("JAXGEN_XLA_CACHE", "~/.cache/jaxgen/xla")
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from jaxgen import executables

    executables.use(os.environ.get("JAXGEN_EXECUTABLES", "~/.cache/jaxgen/executables") or None)


def process_seconds() -> float | None:
    """Seconds since this process started (the interpreter's start, before any import), from Linux's
    /proc/self/stat (10 ms steps); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# libtpu looks for the TPU VM it runs on when it loads: where there is none, these answer for the metadata
# server and keep its errors out of the log (a TPU VM sets what it needs; these are only defaults); and it
# takes a lock file that lets one process at a time load it, which only a real TPU needs
NO_TPU_VM = {
    "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}  # fmt: skip


def quiet_libtpu_off_tpu() -> None:
    """Where libtpu is installed (the `tpu-compile` or `test` extra) on a machine with no TPU, jax's start
    would log libtpu's failed search for a TPU VM (errors, then the CPU anyway): give it `NO_TPU_VM`'s
    defaults. A machine with TPU chips (/dev/accel*, /dev/vfio/*) is left alone. Before jax's backends start."""
    import glob
    import importlib.util

    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or importlib.util.find_spec("libtpu") is None:
        return
    assume_no_tpu_vm()


def assume_no_tpu_vm() -> None:
    """`NO_TPU_VM`'s defaults in the environment (where a variable is unset), before libtpu loads."""
    for name, value in NO_TPU_VM.items():
        os.environ.setdefault(name, value)
