"""Shared fixtures. 8 fake CPU devices for the sharding tests; most tests use a 1-device mesh."""

from jaxgen.runtime import quiet_libtpu_off_tpu

quiet_libtpu_off_tpu()  # the test extra installs libtpu (compiling for TPU); this machine has no TPU

import atexit  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test file, drop jax's compiled programs: a worker runs many files, and no program is
    shared between files (each builds its own models), so their executables would only pile up."""
    yield
    jax.clear_caches()
    # a command line run in this process (train.main, serve's) turned on jax's persistent cache and maybe the
    # store: off again, so that the next file compiles as a library user's process does
    executables.use(None)
    jax.config.update("jax_compilation_cache_dir", None)
    from jax._src import compilation_cache  # no public way to let jax look at the setting again

    compilation_cache.reset_cache()
