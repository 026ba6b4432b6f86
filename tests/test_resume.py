"""Resuming: separate processes, as a user would run them."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from jaxgen.inference.loading import load_run
from jaxgen.sharding import make_mesh
from tests.conftest import ROOT


def train_cmd(run_dir, token_cache, *overrides):
    return [
        sys.executable, "train.py", "--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--no-progress",
        f"data.cache_dir={token_cache}", "training.steps=20", "training.eval_every=10", *overrides,
    ]  # fmt: skip


def run(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params_of(run_dir):
    _, _, params = load_run(run_dir, mesh=make_mesh_one())
    return jax.tree.map(np.asarray, params)


def make_mesh_one():
    from jaxgen.config import MeshConfig

    return make_mesh(MeshConfig(data=1))


def test_resume_is_bitwise_exact(tmp_path, token_cache):
    once, twice = tmp_path / "once", tmp_path / "twice"
    run(train_cmd(once, token_cache))
    first = run(train_cmd(twice, token_cache, "training.steps_per_run=10"))
    assert "stopped after training.steps_per_run=10 steps at step 10" in first.stdout
    second = run(train_cmd(twice, token_cache, "training.steps_per_run=10"))
    assert "resuming" in second.stdout and "from step 10" in second.stdout
    a, b = records(once), records(twice)
    assert [r["step"] for r in b] == list(range(1, 21))
    assert [r["data"] for r in a] == [r["data"] for r in b]  # the same batches in the same order
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    pa, pb = params_of(once), params_of(twice)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)
    done = run(train_cmd(twice, token_cache))
    assert "already finished: 20 of training.steps=20" in done.stdout and "training.steps=40" in done.stdout


def _wait_for_steps(run_dir, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    raise TimeoutError("training did not reach the step in time")


def test_sigterm_saves_and_continues_and_kill_9_resumes_from_the_last_checkpoint(tmp_path, token_cache):
    """One run stopped twice, as a user might stop it: SIGTERM saves a checkpoint at the step it stopped (the
    only one: checkpoint.every is past the end) and the same command continues from it; killed with SIGKILL
    later (nothing saved then), the same command resumes from the last periodic checkpoint."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(run_dir, token_cache, "training.steps=400", "checkpoint.every=1000")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stopped_at = records(run_dir)[-1]["step"]
    assert f"SIGTERM: saved a checkpoint at step {stopped_at}" in out, err[-2000:]
    assert stopped_at < 400

    # the same command, with checkpoints every 5 steps from now on (checkpoint.every may change on resuming)
    cmd = train_cmd(run_dir, token_cache, "training.steps=400", "checkpoint.every=5")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run_dir, stopped_at + 12, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = [r["step"] for r in records(run_dir)]
    assert steps[: stopped_at + 12] == list(range(1, stopped_at + 13))  # continued from the SIGTERM's step
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved > stopped_at and saved % 5 == 0
    cont = run(train_cmd(run_dir, token_cache, "training.steps=400", "training.steps_per_run=1"))
    assert f"from step {saved}" in cont.stdout
    assert [r["step"] for r in records(run_dir)][-1] == saved + 1


def kill_after_a_checkpoint(cmd, run_dir, wait_s: float = 180) -> int:
    """Starts `cmd` (a training command writing `run_dir`), kills it with SIGKILL once a checkpoint is complete
    (however long the machine takes, up to `wait_s`), and returns the newest complete checkpoint's step."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + wait_s
    while not _finished_steps(run_dir) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return max(_finished_steps(run_dir))


def _finished_steps(run_dir) -> list[int]:
    """The steps of the complete checkpoints (orbax renames a step's folder to its number when done)."""
    folder = run_dir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def test_lora_kill_9_resumes_bitwise(tmp_path, token_cache):
    """A LoRA run (adapters and their optimizer state checkpointed, the base redrawn from the seed) killed
    with SIGKILL continues from its last checkpoint to the losses, batches and adapters of a run never killed."""
    from jaxgen.inference.loading import load_lora_run

    lora = ["model.lora.rank=4", "model.lora.targets=[q, v, up, down]", "training.steps=400", "checkpoint.every=3"]
    killed, never = tmp_path / "killed", tmp_path / "never"
    saved = kill_after_a_checkpoint(train_cmd(killed, token_cache, *lora), killed, wait_s=120)
    cont = run(train_cmd(killed, token_cache, *lora, "training.steps_per_run=2"))
    assert f"from step {saved}" in cont.stdout
    end = saved + 2
    run(train_cmd(never, token_cache, *lora, f"training.steps_per_run={end}"))

    def train_records(run_dir):  # the later record of a step done twice (before the kill and after it)
        return {r["step"]: (r["loss"], r["data"]) for r in records(run_dir) if "loss" in r and "data" in r}

    assert [train_records(killed)[s] for s in range(1, end + 1)] == [train_records(never)[s] for s in range(1, end + 1)]
    a, b = (load_lora_run(r, mesh=make_mesh_one(), step=end) for r in (killed, never))
    for x, y in zip(jax.tree.leaves(a[3]), jax.tree.leaves(b[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    from jaxgen import model  # serving the run: the adapters merged into the base the seed draws
    from jaxgen.model import lora

    cfg, _, base, adapters = a
    merged_cfg, _, merged = load_run(killed, mesh=make_mesh_one(), step=end)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 5
    positions = np.tile(np.arange(12, dtype=np.int32), (2, 1))
    adapted = model.forward(lora.attach(base, adapters), tokens, positions, cfg=cfg.model)[0]
    np.testing.assert_allclose(model.forward(merged, tokens, positions, cfg=merged_cfg.model)[0], adapted, atol=1e-5)
