"""jaxgen.executables: compiled programs stored on disk and loaded without tracing (issue 45).

A new `Program` object is what a new process has: nothing in memory, only the store's files; loading from a
file is the same deserialization either way. What only a new process shows (an executable that jax's
persistent cache loaded, serialized again; a command line's start) runs in subprocesses.
"""

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import executables, model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.precompile import precompile
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.structured import Structured
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
# these tests say what the store compiles, stores and loads: the suite's shared persistent cache (conftest)
# would have served some of those compiles from another test's, and the store refuses what jax's cache loaded
SHARED_XLA_CACHE = False


@pytest.fixture
def store(tmp_path):
    s = executables.use(tmp_path / "executables")
    try:
        yield s
    finally:
        executables.use(None)


def _program(traces: list):
    def step(state, x, *, scale):
        traces.append(1)
        return {"w": state["w"] * scale + x.sum()}, jnp.tanh(state["w"]).sum()

    return executables.Program(step, "step", static_argnames="scale", donate_argnums=0)


def _args():
    return {"w": jnp.arange(8, dtype=jnp.float32) / 7}, np.linspace(0, 1, 3, dtype=np.float32)


def test_a_program_is_stored_then_loaded_without_tracing_and_runs_bitwise_alike(store):
    traces = []
    cold = _program(traces)(*_args(), scale=1.5)
    assert len(traces) == 1 and store.saved == 1 and store.loaded == 0
    warm = _program(traces)(*_args(), scale=1.5)  # a new Program: nothing in memory
    assert len(traces) == 1 and store.loaded == 1  # loaded, not traced
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), cold, warm)
    _program(traces)(*_args(), scale=2.0)  # another static value: another program, compiled
    x = _args()
    _program(traces)({"w": x[0]["w"][:4]}, x[1], scale=1.5)  # another shape: compiled
    assert len(traces) == 3 and store.saved == 3


def _damage(path: Path, how: str) -> None:
    head, payload = path.read_bytes().split(b"\n", 1)
    header = json.loads(head)
    if how == "stale":  # as another jax would have written it
        header["fingerprint"]["versions"] = header["fingerprint"]["versions"].replace("jax ", "jax 0.0.0-")
    elif how == "other source":
        header["fingerprint"]["jaxgen_source"] = "0" * 16
    elif how == "other decode products":  # written where $JAXGEN_CPU_DECODE_SUMS differs (kernels.cpu)
        header["fingerprint"]["cpu_decode_sums"] = "sums" + header["fingerprint"]["cpu_decode_sums"]
    elif how == "foreign":
        header["signature"] += "|another program"
    elif how == "damaged":
        payload = payload[:-100] + bytes(100)
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload if how != "no header" else payload)


@pytest.mark.parametrize("how, reason", [
    ("stale", "it is stale (versions: 'jax 0.0.0-"), ("other source", "it is stale (jaxgen_source"),
    ("other decode products", "it is stale (cpu_decode_sums"),
    ("foreign", "another signature"), ("damaged", "checksum"), ("no header", "damaged (no header)"),
])  # fmt: skip
def test_a_stale_foreign_or_damaged_entry_is_compiled_again_saying_why(store, caplog, how, reason):
    traces = []
    cold = _program(traces)(*_args(), scale=1.5)
    (path,) = store.root.iterdir()
    _damage(path, how)
    with caplog.at_level(logging.WARNING, logger="jaxgen.executables"):
        again = _program(traces)(*_args(), scale=1.5)
    assert len(traces) == 2 and store.loaded == 0  # compiled again, never used
    (line,) = [r.getMessage() for r in caplog.records]
    assert "compiling step again" in line and path.name in line and reason in line, line
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), cold, again)
    _program(traces)(*_args(), scale=1.5)  # the entry was replaced by a good one
    assert len(traces) == 2 and store.loaded == 1


CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)
SERVE = ServeConfig(slots=4, page_size=16, num_pages=64, chunk_steps=4, prefill_chunk=32, grammar_states=64)
LONG = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"  # 3 chunks


def _mixed(engine) -> list:
    """Short and long prompts, n > 1 sampled, logprobs, a scored prompt, penalties, speculation, a regex."""
    work = [
        ("a", SamplingConfig(max_new_tokens=3, temperature=0.0)),
        (LONG, SamplingConfig(max_new_tokens=3, temperature=0.9, seed=3, n=2, logprobs=2)),
        (LONG[:40], SamplingConfig(max_new_tokens=0, prompt_logprobs=1)),
        ("abcabcabcabc", SamplingConfig(max_new_tokens=6, temperature=0.0, num_speculative_tokens=3)),
        ("x = ", SamplingConfig(max_new_tokens=4, temperature=0.0, presence_penalty=0.5)),
        ("n: ", SamplingConfig(max_new_tokens=8, temperature=0.0, structured=Structured(regex="[0-9]{3}-[a-z]{2}"))),
    ]
    return engine.generate([p for p, _ in work], [s for _, s in work])


def test_what_a_killed_writer_left_is_cleared_at_the_next_start(tmp_path):
    """A process killed while writing an entry leaves its `.partial` file: the next store deletes it once it is
    old enough that no live writer can own it, and leaves a fresh one (another process writing now) alone."""
    (tmp_path / "s").mkdir()
    old, fresh = tmp_path / "s" / "step-abc.123.partial", tmp_path / "s" / "step-def.456.partial"
    old.write_bytes(b"torn"), fresh.write_bytes(b"being written")
    os.utime(old, (0, 0))
    executables.Store(tmp_path / "s")
    assert not old.exists() and fresh.exists()


def test_a_warm_engine_loads_every_program_compiles_nothing_and_answers_bitwise_alike(store):
    """The engine's start with its precompile, then a mixed workload, twice on one store: the first engine's
    requests trace nothing after its precompile (the prefill calls it compiled without running them are those
    the requests make), the second engine (new programs, as in a new process) traces nothing at all, and its
    outputs (tokens and log-probabilities) equal the first's bitwise."""
    params = model.init_params(CFG, jax.random.key(0))
    runs, prefetched = [], []
    real_prefetch = store.prefetch
    store.prefetch = lambda group: prefetched.append(real_prefetch(group)) or prefetched[-1]
    for _ in range(2):
        engine = Engine(params, CFG, Tokenizer.byte_level(), SERVE)
        precompile(engine)
        ready = engine.compilations
        runs.append((ready, _mixed(engine), engine.compilations - ready))
    (cold_ready, cold, cold_after), (warm_ready, warm, warm_after) = runs
    assert cold_ready > 10 and store.saved >= cold_ready and cold_after == 0  # compiled ahead: what requests call
    assert warm_ready == 0 and warm_after == 0 and store.loaded >= cold_ready
    assert [dataclasses.asdict(c) for c in warm] == [dataclasses.asdict(c) for c in cold]
    # the second engine's programs were loaded in threads from the first's manifest, every one of them used
    assert prefetched == [0, store.saved] and not store._pending


def test_an_executable_jaxs_persistent_cache_loaded_is_compiled_again_before_it_is_stored(tmp_path):
    """XLA:CPU: an executable loaded from jax's persistent cache serializes without its kernels (it loads,
    then fails to run). Three processes: the first fills jax's cache with the program (run by plain jit) and
    store A, the second finds it in jax's cache (and in jax's memory: plain jit compiled it first) with an empty
    store B, the third loads it from B and runs it."""
    script = """
import sys, jax, jax.numpy as jnp
from jaxgen import executables
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
fn = lambda x: jnp.cumsum(jnp.sin(x) * 2) + jnp.broadcast_to(x[:1], x.shape)
jax.jit(fn)(jnp.arange(16.0)).block_until_ready()  # plain jit first: jax's caches hold it
f = executables.Program(fn, "f")
s = executables.use(sys.argv[2])
print(float(f(jnp.arange(16.0)).sum()), s.saved, s.loaded)
"""
    outs = []
    for store in ("a", "b", "b"):
        cmd = [sys.executable, "-c", script, str(tmp_path / "xla"), str(tmp_path / store)]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"JAX_PLATFORMS": "cpu"})
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout.split())
    assert outs[0][1:] == ["1", "0"] and outs[1][1:] == ["1", "0"] and outs[2][1:] == ["0", "1"]
    assert outs[0][0] == outs[1][0] == outs[2][0]


def test_precompile_train_fills_the_store_a_run_then_loads(store, tiny_cfg, tmp_path):
    """`train(compile_only=True)` (what `python -m jaxgen.precompile train` runs) compiles the train and
    evaluation steps and takes no step; a run of the same config then loads both and compiles neither."""
    from jaxgen.training.trainer import train

    cfg = dataclasses.replace(tiny_cfg, training=dataclasses.replace(tiny_cfg.training, steps=2, eval_every=2))
    result = train(cfg, tmp_path / "scratch", progress=False, compile_only=True)
    assert result.status == "compiled" and result.losses == []
    assert store.saved == 2 and store.loaded == 0
    assert train(cfg, tmp_path / "run", progress=False).status == "finished"
    assert store.saved == 2 and store.loaded == 2


@pytest.mark.parametrize("lora", [0, 4])
def test_steps_compiled_from_abstract_state_are_the_ones_a_run_loads(store, tiny_cfg, tmp_path, lora):
    """`precompile train --target` compiles from ShapeDtypeStructs (`plan.abstract_train_state`): on this
    machine's devices the same path must store exactly the programs a real run of the config then asks for
    (same signatures: the run loads both steps and compiles nothing), full training and LoRA alike."""
    from jaxgen.precompile import compile_train_steps
    from jaxgen.sharding import make_mesh
    from jaxgen.training.trainer import train

    training = dataclasses.replace(tiny_cfg.training, steps=2, eval_every=2)
    cfg = dataclasses.replace(tiny_cfg, training=training)
    if lora:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, lora=dataclasses.replace(cfg.model.lora, rank=lora, base_dtype="bfloat16")))  # fmt: skip
    compile_train_steps(cfg, make_mesh(cfg.mesh))
    assert store.saved == 2 and store.loaded == 0
    assert train(cfg, tmp_path / "run", progress=False).status == "finished"
    assert store.saved == 2 and store.loaded == 2


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the test extra) compiles for TPU")
def test_precompile_for_a_tpu_target_stores_its_programs_under_its_fingerprint(tmp_path, caplog):
    """`python -m jaxgen.precompile train --target tpu-v5p-8`: libtpu compiles the steps on this CPU machine
    for 4 v5p chips; the entries carry the target's fingerprint, and this machine refuses them, saying why."""
    env = os.environ | {"JAXGEN_EXECUTABLES": str(tmp_path / "store"), "JAXGEN_XLA_CACHE": "", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxgen.precompile", "train", "--config", "configs/tiny.yaml", "--target",
           "tpu-v5p-8", "mesh.data=2", "mesh.fsdp=2", f"data.cache_dir={tmp_path / 'tokens'}"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 programs compiled and stored" in run.stdout and "libtpu for 4 x TPU v5" in run.stdout, run.stdout
    entries = sorted((tmp_path / "store").glob("*.jaxexe"))
    assert [e.name.split("-")[0] for e in entries] == ["eval_step", "train_step"]
    header = json.loads(entries[1].read_bytes().partition(b"\n")[0])
    assert header["fingerprint"]["backend"].startswith("tpu PJRT C API")
    assert header["fingerprint"]["devices"] == "4 x TPU v5, 1 process(es)" and header["devices"] == [0, 1, 2, 3]
    s = executables.use(tmp_path / "store")
    try:  # the files of a target and this machine's have names of their own: put it where this machine looks
        shutil.copy(entries[1], s.path(header["program"], header["signature"]))
        with caplog.at_level(logging.WARNING, logger="jaxgen.executables"):
            assert s.load(header["program"], header["signature"]) is None
    finally:
        executables.use(None)
    assert "it is stale (backend: 'tpu PJRT C API" in caplog.text and "devices: '4 x TPU v5" in caplog.text
    bad = subprocess.run([*cmd[:-3], "mesh.data=8"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "error:" in bad.stderr and "mesh" in bad.stderr, bad.stderr[-2000:]
    far = subprocess.run([*cmd[:6], "--target", "tpu-v5p-64"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert far.returncode == 2 and "--target tpu-v5p-64 is not allowed: it spans several hosts" in far.stderr


def test_what_the_precompile_command_stores_is_what_serve_py_loads(tiny_run, tmp_path):
    """`python -m jaxgen.precompile serve` with serve.py's flags, then `serve.py http` with the same: it traces
    no program before ready nor for a request (/metrics' jaxgen_compiles_total has no sample), every program
    it runs was loaded from the store (jaxgen_compile_cache_hits_total), and it answers."""
    import socket
    import time

    import httpx

    env = os.environ | {"JAXGEN_EXECUTABLES": str(tmp_path / "store"), "JAXGEN_XLA_CACHE": "", "JAX_PLATFORMS": "cpu"}
    flags = ["--checkpoint", str(tiny_run), "--slots", "2", "--kv-memory-gb", "0.05", "serve.prefill_chunk=32"]
    run = subprocess.run([sys.executable, "-m", "jaxgen.precompile", "serve", *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert " programs compiled and stored, 0 already stored" in run.stdout, run.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "serve.py", "http", *flags, "--port", str(port), "--shutdown-grace", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "not ready within 300 s"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def ", "max_tokens": 4, "logprobs": 1}, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{url}/metrics").text.splitlines()
        assert not [m for m in metrics if m.startswith("jaxgen_compiles_total{")], "a program was traced"
        hits = [m for m in metrics if m.startswith("jaxgen_compile_cache_hits_total{")]
        assert {"decode_chunk", "admit_rows", "init_state"} <= {h.split('program="')[1].split('"')[0] for h in hits}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_program_called_inside_another_traced_function_is_part_of_it(store):
    traces = []
    inner = _program(traces)
    outer = jax.jit(lambda state, x: inner(state, x, scale=2.0))
    state, x = _args()
    want = _program([])(*_args(), scale=2.0)
    got = outer(state, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), want, got)
    assert store.saved == 1  # only the direct call's program: the inner one is inlined, not stored


def test_a_compile_jaxs_persistent_cache_had_anyway_is_not_stored(tmp_path):
    """The store's compiles are written nowhere, but jax's cache may hold one from another writer (an older
    jaxgen did write them): the executable is used and not stored (it would fail in the next process)."""
    script = """
import sys, jax, jax.numpy as jnp
from jaxgen import executables
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
fn = lambda x: jnp.cumsum(jnp.sin(x) * 2) + jnp.broadcast_to(x[:1], x.shape)
x = jnp.arange(16.0)
if sys.argv[2] == "write":  # the store's own compile, written to jax's cache by someone else
    jax.jit(fn).lower(x).compile(compiler_options={"xla_embed_ir_in_executable": False})
else:
    s = executables.use(sys.argv[2])
    f = executables.Program(fn, "f")
    print(float(f(x).sum()), float(executables.Program(fn, "f")(x).sum()), s.saved, s.loaded)
"""
    outs = []
    for second in ("write", str(tmp_path / "store")):
        cmd = [sys.executable, "-c", script, str(tmp_path / "xla"), second]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"JAX_PLATFORMS": "cpu"})
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append((run.stdout.split(), run.stderr))
    (value, again, saved, loaded), stderr = outs[1]
    assert value == again and saved == "0" and loaded == "0", outs[1]
    assert "not stored: jax's persistent cache had this compile" in stderr
