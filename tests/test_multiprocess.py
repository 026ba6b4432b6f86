"""Several processes on jax.distributed: 2 processes x 4 CPU devices (gloo over 127.0.0.1) against one process.

Each multi-process run starts fresh interpreters, so these tests are few and share their runs.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from jaxgen.config import ConfigError, DistributedConfig, MeshConfig
from jaxgen.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, detect, free_port
from jaxgen.inference.loading import load_run
from jaxgen.sharding import make_mesh
from tests.conftest import ROOT

STEPS = 16
MORE = STEPS + 12  # continuations train on to this step (the kill test kills at STEPS + 4)
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


# --- start-up: what is detected, and wrong settings named before JAX starts -----------------------------------


@pytest.mark.parametrize(
    "env, source",
    [
        ({}, None),
        ({"SLURM_NTASKS": "4"}, None),  # an salloc / sbatch shell: nothing started by srun yet
        ({"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"}, "slurm"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5000"}, "open mpi"),
        ({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"}, "cloud tpu"),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # a single-host TPU VM
        ({ENV_COORDINATOR: "10.0.0.1:1234", ENV_NUM_PROCESSES: "4", ENV_PROCESS_ID: "3"}, "environment"),
        ({ENV_COORDINATOR: "10.0.0.1:1234", ENV_NUM_PROCESSES: "4", "JOB_COMPLETION_INDEX": "2"}, "environment"),
    ],
)
def test_detects_how_it_was_started(env, source):
    found = detect(DistributedConfig(), env)
    assert (found and found[0]) == source
    assert detect(DistributedConfig(coordinator="auto"), env)[0] == "cluster detection"
    if source == "environment":
        assert found[1]["num_processes"] == 4 and found[1]["coordinator_address"] == "10.0.0.1:1234"
        assert found[1]["heartbeat_timeout_seconds"] == 60


@pytest.mark.parametrize(
    "cfg, env, message",
    [
        (DistributedConfig(num_processes=2), {}, "distributed.coordinator=None is not allowed: HOST:PORT"),
        (DistributedConfig(coordinator="host", num_processes=2), {}, "distributed.coordinator='host'"),
        (DistributedConfig(coordinator="h:1", num_processes=2, process_id=2), {}, "in [0, 1]"),
        (DistributedConfig(process_id=1), {}, "distributed.coordinator=None is not allowed"),
        (DistributedConfig(coordinator="auto", num_processes=2), {}, "'auto' is not allowed with"),
        (DistributedConfig(), {"OMPI_COMM_WORLD_SIZE": "2"}, "without $OMPI_MCA_orte_hnp_uri"),  # Open MPI 5
        (DistributedConfig(), {ENV_COORDINATOR: "h:1", ENV_NUM_PROCESSES: "two", ENV_PROCESS_ID: "0"}, "'two'"),
        (DistributedConfig(), {ENV_COORDINATOR: "h:1", ENV_NUM_PROCESSES: "2"}, "$JAX_PROCESS_ID=None"),
        (DistributedConfig(), {ENV_COORDINATOR: "h:1", ENV_NUM_PROCESSES: "1", ENV_PROCESS_ID: "0"}, ">= 2"),
    ],
)
def test_wrong_settings_are_named(cfg, env, message):
    with pytest.raises(ConfigError) as e:
        detect(cfg, env)
    assert message in str(e.value)


def test_command_lines_refuse_wrong_process_settings_before_starting():
    train = subprocess.run(
        [sys.executable, "train.py", "--num-processes", "2", "--process-id", "0"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert train.returncode == 2 and "distributed.coordinator=None is not allowed" in train.stderr
    serve = subprocess.run(
        [sys.executable, "serve.py", "http", "--checkpoint", "x", "--coordinator", "h:1", "--num-processes", "2",
         "--process-id", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert serve.returncode == 2 and "serve.py http runs as one process" in serve.stderr
    launcher = subprocess.run([sys.executable, "launch.py", "-n", "2"], cwd=ROOT, capture_output=True, text=True)
    assert launcher.returncode == 2 and "no command given" in launcher.stderr


# --- the launcher's own processes: tiny Python children, no jax (issue 31) ------------------------------------

# prints its pid (and its child's, when it starts one), then: `ignore` SIGTERM and sleep, or `exit` at once
CHILD = """
import os, signal, subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) if "{spawn}" else None
print("pids", os.getpid(), kid.pid if kid else 0, flush=True)
if "{mode}" == "exit":
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


def _launcher(n: int, grace: float, *children: str):
    """The launcher of `n` children (child i runs children[i % len]) and the pids they printed."""
    code = f"import os; i = int(os.environ.get('JAX_PROCESS_ID', 0)); exec({list(children)!r}[i % {len(children)}])"
    cmd = [sys.executable, "launch.py", "-n", str(n), "--grace", str(grace), "--", sys.executable, "-c", code]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    by_child = {}  # child i -> its pid and its own child's; in child order, whichever printed first
    while len(by_child) < n:
        line = launcher.stdout.readline()
        assert line, "the launcher ended before its children started"
        if " pids " in line:  # "[i] pids PID KID"
            by_child[int(line.split("]")[0].lstrip("["))] = [int(x) for x in line.split()[2:] if x != "0"]
    pids = [pid for i in sorted(by_child) for pid in by_child[i]]
    return launcher, pids


def _gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
                    if f.read().split(")")[-1].split()[0] != "Z":
                        alive.append(pid)
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and PR_SET_PDEATHSIG as on Linux")
def test_the_launcher_ends_stubborn_processes_and_what_they_started():
    stubborn = CHILD.format(spawn="", mode="ignore")
    # one child leaves a grandchild behind and exits; the other ignores SIGTERM
    launcher, pids = _launcher(2, 1.0, CHILD.format(spawn="yes", mode="exit"), stubborn)
    assert len(pids) == 3  # the first child, its grandchild, the second child
    assert _gone(pids[:2], within=60)  # the grandchild ends with its parent's process group
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) != 0  # killed 1 s (--grace) after SIGTERM
    assert _gone(pids, within=5)

    launcher, pids = _launcher(1, 600.0, stubborn)
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    launcher.send_signal(signal.SIGINT)  # a second signal kills at once
    assert launcher.wait(timeout=20) != 0 and _gone(pids, within=5)

    launcher, pids = _launcher(1, 600.0, stubborn)
    launcher.kill()  # the launcher cannot end them itself: they die with it
    launcher.wait()
    assert _gone(pids, within=60)


def test_the_launcher_refuses_hundreds_of_processes(capsys):
    import launch

    with pytest.raises(SystemExit):
        launch.main(["-n", "400", "--", "true"])
    assert "--num-processes=400 is not allowed: an integer from 1 to 64" in capsys.readouterr().err


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=2), MeshConfig(data=1, context=2)], ids=["data", "context"])
def test_a_mesh_that_leaves_a_process_out_is_refused(monkeypatch, mesh_cfg):
    from jaxgen import sharding

    monkeypatch.setattr(sharding.jax, "process_count", lambda: 2)  # this process's 8 devices, as if of 2
    with pytest.raises(ValueError, match=r"every process needs devices in it"):
        sharding.check_spans_processes(make_mesh(mesh_cfg), "the mesh")


def test_several_processes_do_not_fall_back_to_an_older_checkpoint(monkeypatch, tmp_path):
    """Each process reads its own shards: one falling back alone would mix steps. The error names what to move."""
    from jaxgen.training import checkpoint

    monkeypatch.setattr(checkpoint.jax, "process_count", lambda: 2)
    tried = []

    def restore(step):
        tried.append(step)
        raise ValueError("truncated file")

    folder = types.SimpleNamespace(directory=tmp_path / "checkpoints")  # all restore_newest reads of a Checkpointer
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/30 does not restore .*move that folder"):
        checkpoint.restore_newest(folder, restore, [10, 20, 30])
    assert tried == [30]


# --- training ---------------------------------------------------------------------------------------------------


def train_args(token_cache, run_dir, *more):
    return [
        "train.py", "--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--no-progress", *MESH,
        f"training.steps={STEPS}", f"data.cache_dir={token_cache}", *more,
    ]  # fmt: skip


# the kill test's run: a dead process found within 10 s. (Not for the others: the same timeout bounds JAX's
# shutdown barrier, and on a busy machine one process can finish its last checkpoint more than 10 s after the other.)
QUICK_HEARTBEAT = "distributed.heartbeat_timeout_s=10"


def launch(args, n=2, timeout=600):
    cmd = [sys.executable, "launch.py", "-n", str(n), "--cpu-devices", "4", "--", sys.executable, *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def params_on_one_device(run_dir):
    """The run's final params, restored in this process onto one device (whatever wrote them)."""
    _, _, params = load_run(run_dir, mesh=make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))
    return jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def one_process_run(tiny_cfg, tmp_path_factory):
    """The reference: this process, 8 devices, the same (data=2, fsdp=2, tensor=2) mesh."""
    return continued(tiny_cfg, tmp_path_factory.mktemp("one_process"), STEPS)


@pytest.fixture(scope="module")
def two_process_run(one_process_run, token_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_processes")
    out = launch(train_args(token_cache, run_dir))
    assert "process 1 of 2" in out and "process 0 of 2" in out
    return run_dir


def test_two_processes_train_like_one(one_process_run, two_process_run):
    """Same global batches, same losses and final parameters; the 2-process checkpoint restores on one device.

    Not bitwise: across processes the reductions over devices run in gloo (in another order than XLA's
    in-process all-reduce), so float32 sums differ in the last bits and drift a little over the Adam steps.
    """
    ref, two = losses(one_process_run), losses(two_process_run)
    assert len(ref) == len(two) == STEPS  # one line a step: only process 0 writes metrics
    np.testing.assert_allclose(two, ref, rtol=1e-5)
    ref_data = [json.loads(line)["data"] for line in (one_process_run / "metrics.jsonl").read_text().splitlines()]
    assert len(set(ref_data)) == STEPS  # a new batch every step
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        params_on_one_device(two_process_run), params_on_one_device(one_process_run),
    )  # fmt: skip


def continued(tiny_cfg, run_dir, steps):
    """Trains the run folder on in this process (8 devices) up to `steps`."""
    from jaxgen.training.trainer import train

    training = dataclasses.replace(tiny_cfg.training, steps=steps)
    train(dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2), training=training), run_dir, False)
    return run_dir


@pytest.fixture(scope="module")
def one_process_continued(tiny_cfg, one_process_run, tmp_path_factory):
    """The 1-process run trained on to MORE steps in this process: what every continuation must equal."""
    return continued(tiny_cfg, shutil.copytree(one_process_run, tmp_path_factory.mktemp("more") / "run"), MORE)


def test_a_two_process_checkpoint_continues_in_one_process(tiny_cfg, two_process_run, one_process_continued, tmp_path):
    two_to_one = continued(tiny_cfg, shutil.copytree(two_process_run, tmp_path / "two_to_one"), MORE)
    np.testing.assert_allclose(losses(two_to_one)[STEPS:], losses(one_process_continued)[STEPS:], rtol=1e-5)


def test_a_killed_process_stops_the_other_and_the_run_resumes(
    one_process_run, one_process_continued, token_cache, tmp_path
):
    """A 1-process checkpoint continues in 2 processes; kill -9 of process 1 then stops process 0 on its own within
    the heartbeat timeout (10 s here) with a message naming the lost task, and the same command resumes and ends
    as the uninterrupted 1-process continuation does."""
    run_dir = shutil.copytree(one_process_run, tmp_path / "killed")
    args = train_args(token_cache, run_dir, "checkpoint.every=2", f"training.steps={MORE}")
    port = free_port()
    killed_args = [*args, QUICK_HEARTBEAT]
    procs = []
    with contextlib.ExitStack() as stack:
        for i in range(2):
            env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
            env |= {ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: "2", ENV_PROCESS_ID: str(i)}
            log = stack.enter_context(open(tmp_path / f"process{i}.log", "w"))
            procs.append(subprocess.Popen([sys.executable, *killed_args], cwd=ROOT, env=env, stdout=log, stderr=log))
            stack.callback(procs[-1].kill)
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / str(STEPS + 4)).is_dir():
            assert procs[1].poll() is None, "process 1 ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        status = procs[0].wait(timeout=300)
        waited = time.monotonic() - killed_at
    log = (tmp_path / "process0.log").read_text()
    assert f"resuming {run_dir} from step {STEPS}" in log
    assert status != 0, log[-2000:]
    assert waited < 120, waited  # heartbeat timeout 10 s, plus a busy machine's slack
    assert "heartbeat" in log and "another task died" in log, log[-2000:]
    assert not (run_dir / "checkpoints" / str(MORE)).exists()

    out = launch(args)
    assert "resuming" in out
    ref = one_process_continued
    assert losses(run_dir)[-1] == pytest.approx(losses(ref)[-1], rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        params_on_one_device(run_dir), params_on_one_device(ref),
    )  # fmt: skip


# --- generation across processes ------------------------------------------------------------------------------


def write_requests(path, n=50):
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(n):
            settings = {"max_new_tokens": int(rng.integers(4, 40)), "temperature": float(rng.choice([0.0, 0.8]))}
            prompt = "def f" + "x" * int(rng.integers(0, 30))
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt, "seed": i, **settings}) + "\n")
    return path


def serve_args(run_dir, inp, out, *more):
    return ["serve.py", "generate", "--checkpoint", str(run_dir), "--input", str(inp), "--output", str(out),
            "--slots", "4", *more]  # fmt: skip


def by_id(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    out = {r["id"]: r for r in records}
    assert len(out) == len(records), "an id is written twice"
    return out


def assert_same_results(got, ref):
    """Same ids, tokens, texts and finish reasons; log-probabilities to float32 rounding (the batches that
    a request shares differ between the runs, and with them XLA's reduction order)."""
    assert got.keys() == ref.keys()
    for rid, r in ref.items():
        for a, b in zip(got[rid]["choices"], r["choices"], strict=True):
            assert (a["tokens"], a["text"], a["finish_reason"]) == (b["tokens"], b["text"], b["finish_reason"]), rid
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4)


@pytest.fixture(scope="module")
def one_process_job(tiny_run, tmp_path_factory):
    """The reference: the batch job in this process, on one device."""
    from jaxgen.config import ServeConfig
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.serving.batch_job import run_job

    folder = tmp_path_factory.mktemp("job")
    cfg, tokenizer, params = load_run(tiny_run, mesh=make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))
    engine = Engine(params, cfg.model, tokenizer, ServeConfig(slots=4))
    inp, out = write_requests(folder / "in.jsonl"), folder / "out.jsonl"
    defaults = SamplingConfig(max_new_tokens=128, temperature=0.8, top_p=0.95)  # serve.py's defaults
    run_job(engine, inp, out, defaults)
    return inp, by_id(out)


def test_data_parallel_batch_job_killed_then_resumed(tiny_run, one_process_job, tmp_path):
    """A 2-process data-parallel job, killed -9 whole (launcher and both processes) once results are being
    written; the same command finishes it, merging the parts: no id lost or written twice, and the results
    equal the 1-process job's line for line. (Every result comes from 2 processes, those written before the kill
    and after it: this is also the test that a data-parallel job equals one process.)"""
    inp, ref = one_process_job
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "launch.py", "-n", "2", "--cpu-devices", "4", "--", sys.executable,
           *serve_args(tiny_run, inp, out)]  # fmt: skip
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while sum(len(p.read_bytes().splitlines()) for p in tmp_path.glob("out.jsonl.part*")) < 4:
            assert job.poll() is None, "the job ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    before = len(by_id(out)) if out.exists() else 0
    assert before < len(ref)  # killed before the merge finished
    alone = shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-alone")  # the same state, for later
    log = launch(serve_args(tiny_run, inp, out))
    assert re.search(rf'"merged": {len(ref) - before}\b', log), log[-2000:]  # what the parts held, appended
    assert not list(tmp_path.glob("out.jsonl.part*"))  # the parts were merged away
    assert_same_results(by_id(out), ref)

    # the same killed job finished by one process: it merges the parts, then runs the rest itself
    subprocess.run([sys.executable, *serve_args(tiny_run, inp, alone / "out.jsonl")], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    assert_same_results(by_id(alone / "out.jsonl"), ref)
    assert not list(alone.glob("out.jsonl.part*"))


def test_generator_and_engine_on_a_mesh_over_two_processes_equal_one_device(tiny_run, one_process_job, tmp_path):
    """Model parallel: 2 processes x 1 device, tensor=2 over both. The engine (serve.py generate with
    serve.processes=shared) and then Generator, in the same 2 processes (tests/mp_generate.py), return the
    tokens of one device."""
    from jaxgen.inference.generator import Generator

    sys.path.insert(0, str(ROOT / "tests"))
    import mp_generate

    inp, ref_job = one_process_job
    few = tmp_path / "in.jsonl"
    few.write_text("".join(inp.read_text().splitlines(keepends=True)[:6]))  # more than its 4 slots
    out, generated = tmp_path / "out.jsonl", tmp_path / "generator.json"
    serve = serve_args(tiny_run, few, out, "serve.processes=shared", "serve.tensor_parallel=2")[1:]  # its arguments
    subprocess.run(
        [sys.executable, "launch.py", "-n", "2", "--cpu-devices", "1", "--", sys.executable, "tests/mp_generate.py",
         str(tiny_run), str(generated), "--", *serve], cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    assert_same_results(by_id(out), {k: v for k, v in ref_job.items() if k in {f"r{i}" for i in range(6)}})

    got = json.loads(generated.read_text())
    cfg, tokenizer, params = load_run(tiny_run, mesh=make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))
    ref = Generator(params, cfg.model, tokenizer).generate(mp_generate.PROMPTS, mp_generate.CONFIGS)
    assert got["devices"] == 2 and got["tokens"] == [r.tokens for r in ref]
