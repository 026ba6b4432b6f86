"""Shared fixtures. 8 fake CPU devices for the sharding tests; most tests use a 1-device mesh."""

from jaxgen.runtime import quiet_libtpu_off_tpu

quiet_libtpu_off_tpu()  # the test extra installs libtpu (compiling for TPU); this machine has no TPU

import atexit  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# XLA:CPU's backend at optimization level 1 (LLVM's -O1; 2 is XLA's default) and its older fusion emitters (the
# MLIR ones set up a context and a pass pipeline per fusion): the suite is mostly XLA compiling tiny programs,
# which these make faster while the programs run about as fast (docs/performance.md, "The test suite"). Read
# once, when jax makes its CPU client: before any test computes; subprocesses inherit them.
_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAGS}".strip()

# CPU decoding's products as matrix products, not written-out sums (jaxgen.model.kernels.cpu.products_as_sums):
# a decode program with the sums takes about twice as long to compile, and the suite compiles hundreds of decode
# programs that run for milliseconds. The sums' own tests ask for them with the `cpu_decode_sums` fixture.
# Subprocesses inherit it.
os.environ["JAXGEN_CPU_DECODE_SUMS"] = "0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def _shared_directory(variable: str, prefix: str) -> str:
    """A temporary directory named by $variable: made by the first process of the session (pytest-xdist's
    controller, whose environment its workers inherit) and removed when that process ends."""
    path = os.environ.get(variable)
    if not path:
        path = os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# jax's persistent compilation cache, shared by every test of the session (both workers, every file, the
# command lines run in or beside this process): tests that build the same programs (another Generator or
# engine of the same shapes and settings, a file's programs again in another file) load them instead of
# compiling; tracing and lowering still run, so a trace count (engine.compilations) is unchanged. Never the
# user's ~/.cache/jaxgen/xla. A module that sets SHARED_XLA_CACHE = False runs without it (the store's tests
# count what jax's cache would otherwise have served).
XLA_CACHE = _shared_directory("JAXGEN_XLA_CACHE", "jaxgen-test-xla-")


def _use_the_shared_xla_cache(on: bool) -> None:
    from jax._src import compilation_cache  # no public way to let jax look at the setting again

    jax.config.update("jax_compilation_cache_dir", XLA_CACHE if on else None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()


_use_the_shared_xla_cache(True)
# the command lines the tests run use the store of executables, as by default, but one of this process's own
# (its subprocesses share it): never the user's ~/.cache/jaxgen/executables
_STORE = tempfile.mkdtemp(prefix="jaxgen-test-executables-")
os.environ["JAXGEN_EXECUTABLES"] = _STORE
atexit.register(shutil.rmtree, _STORE, ignore_errors=True)

import pathlib  # noqa: E402

import pytest  # noqa: E402

from jaxgen import executables  # noqa: E402
from jaxgen.config import load_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    """One tokenized stdlib corpus for the whole session."""
    return str(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def tiny_cfg(token_cache):
    """configs/tiny.yaml on one device, with the session's token cache."""
    return load_config(ROOT / "configs" / "tiny.yaml", [f"data.cache_dir={token_cache}", "mesh.data=1"])


@pytest.fixture(scope="session")
def tiny_run(tiny_cfg, tmp_path_factory):
    """A run folder trained for 10 steps with configs/tiny.yaml (what serve.py takes)."""
    import dataclasses

    from jaxgen.training.trainer import train

    run_dir = tmp_path_factory.mktemp("tiny_run")
    cfg = dataclasses.replace(tiny_cfg, training=dataclasses.replace(tiny_cfg.training, steps=10))
    train(cfg, run_dir, progress=False)
    return run_dir


@pytest.fixture
def cpu_decode_sums(monkeypatch):
    """CPU decoding as a user's process runs it, its products as written-out sums, for one test: jax's traces
    are dropped before and after, since the choice is read when a program is traced."""
    monkeypatch.setenv("JAXGEN_CPU_DECODE_SUMS", "1")
    jax.clear_caches()
    yield
    monkeypatch.setenv("JAXGEN_CPU_DECODE_SUMS", "0")
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    """Each test file starts with the shared persistent cache (or none, where the module says so) and no
    store; after it, jax's in-memory compiled programs are dropped: a worker runs many files, and what one
    file's jitted functions hold would only pile up (the persistent cache keeps what is worth keeping)."""
    _use_the_shared_xla_cache(getattr(request.module, "SHARED_XLA_CACHE", True))
    yield
    jax.clear_caches()
    # a command line run in this process (train.main, serve's) set jax's persistent cache and maybe turned on
    # the store: both as they were, so that the next file compiles as a library user's process does (here, not
    # only at the next file's start: a session fixture that file asks for is set up before this fixture is)
    executables.use(None)
    _use_the_shared_xla_cache(True)


def axis_collectives(text: str, mesh, axis: str = "data", ops=("all-reduce", "reduce-scatter")) -> tuple[list, list]:
    """(collectives of kinds `ops` across mesh axis `axis` inside a compiled step's loops; those outside them)
    of its optimised HLO text, compiled on `mesh`'s devices. By default the sums: all-reduces, reduce-scatters."""
    import re

    from jaxgen.targets import hlo

    comps = hlo.computations(text)
    looped = {c for body in re.findall(r"body=%?([\w.\-]+)", text) for c in hlo.reachable(comps, body)}
    found = {n: [op for op, axes in hlo.collective_axes(comps, n, mesh) if axis in axes and op in ops]
             for n in comps}  # fmt: skip
    inside = [op for name, kinds in found.items() if name in looped for op in kinds]
    outside = [op for name, kinds in found.items() if name not in looped and name != "ENTRY" for op in kinds]
    return inside, outside
