"""The RL loop end to end: GRPO raises the built-in task's reward on a live engine whose weights are swapped
every step, with each step's rollouts generated while the update before runs (rl.max_staleness=1, one policy
version behind, corrected by truncated importance sampling); the sampler's log-probabilities are the
trainer's; the logged loss is a hand-computed one on the saved rollouts; a run killed with SIGKILL resumes to
the parameters of a run never killed, with the rollouts it had made; two processes over a (data=2, fsdp=2,
tensor=2) mesh run like one device; and an update on that mesh equals one on one device. The module's runs
are on one device (cheapest to compile)."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from jaxgen.config import load_config
from jaxgen.rl import loop, objectives
from jaxgen.training.metrics import read_metrics
from tests.conftest import ROOT

# a tiny policy, small rollouts: under a second a step on 2 cores; every checkpoint kept (the two-process test
# reads step 4's)
TINY = [
    "model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.d_ff=128",
    "rl.prompts_per_step=16", "rl.group_size=8", "rl.max_new_tokens=3", "rl.max_prompt_tokens=6",
    "checkpoint.every=2", "checkpoint.keep=10", "optimizer.warmup_steps=5", "mesh.data=1",
]  # fmt: skip
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
# two processes of 4 devices: each one's engine on its first 2 (data parallel), the trainer's mesh over the
# other 2 of each (data across the processes, tensor within)
SPLIT = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "rl.sampler_devices=2"]
STEPS = 20
# The built-in task and its reward (exact match) on sums of 0..2: the warm start teaches the whole table (the
# policy answers at temperature 1 with p ~0.97), the rollouts sample at temperature 2, which earns half of that;
# GRPO sharpens the tempered policy back (0.5 -> 0.85 over 20 steps on three seeds; with the advantages' sign
# flipped, 0.4 -> 0.0). A constant learning rate (min_lr_ratio 1) for the warm start and for RL; the tables of
# what was tried are in docs/rl.md, "The built-in task".
LEARN = [
    "rl.max_operand=2", "rl.warm_start_steps=100", "rl.warm_start_learning_rate=3e-3", "rl.temperature=2",
    "optimizer.learning_rate=5e-3", "optimizer.min_lr_ratio=1.0", f"training.steps={STEPS}",
]  # fmt: skip
STALE = ["rl.max_staleness=1"]  # the module's runs are asynchronous unless a test says otherwise
ROWS = 16 * 8  # rollouts a step (rl.prompts_per_step x rl.group_size)
# the kill -9 test's child stops itself mid-run in its reward: the task's exact match, paused (tests/rl_pause.py)
PAUSING = ["rl.reward=tests.rl_pause:exact_match_pausing"]
RESUMED = 4  # steps the killed run is resumed for


def config(token_cache, *overrides):
    cache = f"data.cache_dir={token_cache}"
    return load_config(ROOT / "configs" / "rl-arithmetic.yaml", [*TINY, cache, *overrides])


@pytest.fixture(scope="module")
def warm(tmp_path_factory, token_cache):
    """A warm-started policy folder (a train.py run), shared by the tests as their rl.init_from."""
    from jaxgen.training.trainer import train

    folder = tmp_path_factory.mktemp("warm") / "warm_start"
    cfg = config(token_cache, *LEARN)
    train(loop.warm_start_config(cfg, folder), folder, progress=False)
    return folder


@pytest.fixture(scope="module")
def overrides(token_cache, warm):
    """The dotted overrides of the runs below (what rl.py is given, after TINY)."""
    return [*TINY, *LEARN, *STALE, f"rl.init_from={warm}", f"data.cache_dir={token_cache}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, overrides):
    """(config, run folder) of GRPO run start to end in one go: what the tests below check and resume to."""
    cfg = load_config(ROOT / "configs" / "rl-arithmetic.yaml", overrides)
    run_dir = tmp_path_factory.mktemp("rl") / "run"
    result = loop.run_rl(cfg, run_dir, progress=False)
    assert result.status == "finished" and result.step == STEPS
    return cfg, run_dir


def test_grpo_raises_the_built_in_tasks_reward_one_version_behind_and_the_sampler_agrees_with_the_trainer(
    uninterrupted,
):
    """Step 1's rollouts are the starting policy's (staleness 0), every later step's the policy one update
    before its own (staleness 1): the reward still rises."""
    cfg, run_dir = uninterrupted
    assert cfg.rl.task == "arithmetic" and not cfg.rl.reward and objectives.settings_of(cfg).correction == "tis"  # auto
    records = read_metrics(run_dir)
    rewards = [r["reward"] for r in records]
    start, end = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert 0.1 < start < 0.8, rewards  # the warm start earns some of it, not all
    assert end > start + 0.2, rewards  # seen: +0.35 to +0.39 over three seeds; the gradient's sign flipped: -0.41
    assert [r["staleness"] for r in records] == [0.0] + [1.0] * (STEPS - 1)
    assert [r["version"] for r in records] == [0, *range(STEPS - 1)]
    # the engine's log-probabilities of its own samples are the training forward's (max |difference|) while the
    # policy is the one that sampled them (steps 1 and 2: the first update's learning rate is warm-up's 0); one
    # update later they are not
    gaps = [r["sampler_gap"] for r in records]
    assert max(gaps[:2]) < 1e-4 < min(gaps[2:]), gaps
    assert max(r["corrected"] for r in records) > 0  # some weights passed the cap
    assert (run_dir / "reward.png").stat().st_size > 0
    assert loop.run_rl(cfg, run_dir, progress=False).status == "already finished"


@pytest.mark.parametrize(
    "more",
    [[], ["model.dtype=bfloat16"], ["mesh.data=2"], ["rl.sampler_devices=2"]],
    ids=["float32", "bfloat16", "trainer-data-2", "two-sampler-devices"],
)
def test_in_deterministic_mode_the_trainer_scores_the_samplers_log_probabilities_bitwise(tmp_path, overrides, more):
    """model.deterministic (docs/rl.md): the trainer's log-probabilities of the rollouts are the engine's to the
    bit, so the importance ratio of the first update is exactly 1 (the warm start, a run folder without the
    setting, gets it from the RL config). In bfloat16 the rollout engine's pages are bfloat16 too; the trainer
    on a data mesh of two devices, or the engine on two sampler devices, keeps the bits as well."""
    bitwise = ["training.steps=2", "model.deterministic=true", "model.attention_block=8", "rl.max_staleness=0", *more]
    cfg = load_config(ROOT / "configs" / "rl-arithmetic.yaml", [*overrides, *bitwise])
    assert loop.run_rl(cfg, tmp_path / "run", progress=False).status == "finished"
    records = read_metrics(tmp_path / "run")
    assert [r["sampler_gap"] for r in records] == [0.0, 0.0]
    assert [r["clip_frac"] for r in records] == [0.0, 0.0]
    assert [(r["ratio"], r["ratio_max"], r["corrected"]) for r in records] == [(1.0, 1.0, 0.0)] * 2  # weights: 1


def _finished_steps(run_dir):
    folder = run_dir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def _final_params(run_dir, step=None):
    from jaxgen.inference.loading import load_run

    _, _, params = load_run(run_dir, step=step)
    return jax.tree.map(np.asarray, params)


def _rl_py(run_dir, overrides, log, **env):
    """rl.py on 8 CPU devices in a child process, its output to the file `log`; (its pid, its Popen)."""
    args = [sys.executable, "rl.py", "--run-dir", str(run_dir), "--no-progress", *overrides]
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"} | env
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _reap(child) -> int:
    """Waits for `child`: its exit code."""
    _, status = os.waitpid(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return child.returncode


def test_a_run_killed_with_sigkill_resumes_to_the_parameters_of_a_run_never_killed(tmp_path, uninterrupted, overrides):
    """rl.py killed with SIGKILL mid-run (its reward stops it in step 6, after the checkpoints of steps 2 and 4
    were started; the test waits for one to be finished), then the same command for RESUMED more steps: the
    uninterrupted run's parameters at that step (every checkpoint of it is kept), bitwise, and its rewards step
    for step (prompts, seeds and the reference are functions of the step). The child's peak memory stays small
    (the engine's page pool is sized to the rollouts)."""
    _, never = uninterrupted
    run_dir, overrides = tmp_path / "killed", [*overrides, *PAUSING]
    with open(tmp_path / "killed.log", "w") as log:
        child = _rl_py(run_dir, overrides, log, JAXGEN_TEST_PAUSE_AFTER="5", JAXGEN_TEST_ROWS_PER_STEP=str(ROWS))
        try:
            deadline = time.monotonic() + 900
            while not _finished_steps(run_dir):
                assert child.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint within 900 s"
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                assert _reap(child) == -signal.SIGKILL
    saved = max(_finished_steps(run_dir))
    assert saved <= 4  # killed before step 6's checkpoint
    peak_file, end = tmp_path / "peak_kb", saved + RESUMED
    with open(tmp_path / "resumed.log", "w") as log:
        resumed = [*overrides, f"training.steps_per_run={RESUMED}"]  # the rest would only repeat these steps
        status = _reap(_rl_py(run_dir, resumed, log, JAXGEN_TEST_PEAK_FILE=str(peak_file)))
    out = (tmp_path / "resumed.log").read_text()
    assert status == 0 and f"from step {saved}" in out and f"step {end}:" in out, out[-3000:]
    peak = int(peak_file.read_text()) * 1024  # at its last step's rewards (measured alone: 0.86 GB)
    assert peak < 3 * 2**30, f"rl.py peaked at {peak / 2**30:.1f} GiB"
    assert max(_finished_steps(run_dir)) == end
    a, b = _final_params(run_dir), _final_params(never, step=end)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # each step's rollouts are the uninterrupted run's (those the killed run saved ahead, taken back): the same
    # rewards and policy versions step for step, none lost, none used twice
    by_step = {run: {r["step"]: (r["reward"], r["version"]) for r in read_metrics(run)} for run in (run_dir, never)}
    assert by_step[run_dir] == {s: r for s, r in by_step[never].items() if s <= end}
    assert (run_dir / "rollouts").exists()


def test_the_logged_loss_is_truncated_importance_sampling_by_hand(uninterrupted):
    """Update 19 (step 18's checkpoint, the rollouts of step 18 that the policy of step 17 made, kept on disk
    until the checkpoint after their update): the loss in metrics.jsonl is numpy's truncated-IS loss of the
    trainer's log-probabilities against the sampler's, and not the uncorrected one."""
    from jaxgen.rl import rollouts
    from tests.test_rl import np_loss

    cfg, run_dir = uninterrupted
    r, step = cfg.rl, STEPS - 2
    shape = (ROWS, r.max_prompt_tokens + r.max_new_tokens)
    rollout = rollouts.Rollout.load(run_dir, step, shape, rollouts.fingerprint(cfg))
    assert rollout is not None and rollout.version == step - 1
    b = rollout.batch
    params = _final_params(run_dir, step=step)
    logp, _ = objectives.token_logprobs(params, b["tokens"], b["positions"], cfg=cfg.model, temperature=r.temperature)
    logp = np.asarray(logp, np.float64)
    case = (b["advantages"], b["mask"], r.algorithm, r.clip_eps, 0.0, None, r.averaging)
    tis = np_loss(logp, b["old_logp"], *case, correction="tis", cap=r.is_cap)
    plain = np_loss(logp, b["old_logp"], *case, correction="none")
    logged = next(m for m in read_metrics(run_dir) if m["step"] == step + 1)["loss"]
    np.testing.assert_allclose(logged, tis, rtol=1e-4, atol=1e-6)
    assert abs(tis - plain) > 1e-3 * max(abs(tis), 1e-3)  # the check can tell them apart


def test_two_processes_run_rl_like_one(tmp_path, uninterrupted, overrides):
    """rl.py as 2 processes x 4 CPU devices, for its first 2 steps (training.steps_per_run): each process
    generates and rewards its half of a step's prompts on its own engine, on 2 devices of its own
    (rl.sampler_devices), while the trainer's (data=2, tensor=2) mesh spans the other 2 of each, the weights sent
    over after each update. The rewards step for step, the losses and the parameters at step 2 are the
    one-device run's (to float32 rounding: the sums over devices and processes run in another order)."""
    cfg, one = uninterrupted
    # 2 steps: AdamW's sign flips (below) can change a few rollouts from step 3 on, and then the runs part
    run_dir, first = tmp_path / "two", 2
    cmd = [sys.executable, "launch.py", "-n", "2", "--cpu-devices", "4", "--", sys.executable, "rl.py", "--run-dir",
           str(run_dir), "--no-progress", *overrides, *SPLIT, f"training.steps_per_run={first}"]  # fmt: skip
    with open(tmp_path / "two.log", "w") as log:
        status = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    out = (tmp_path / "two.log").read_text()
    assert status == 0 and "process 1 of 2" in out, out[-3000:]
    split = "the engine on 2 device(s) of each process, the trainer on the mesh {'data': 2, 'fsdp': 1, 'tensor': 2}"
    assert split in out, out[-3000:]
    ref, two = read_metrics(one)[:first], read_metrics(run_dir)
    assert [r["step"] for r in two] == list(range(1, first + 1))  # one line a step: process 0 writes metrics
    assert [r["reward"] for r in two] == [r["reward"] for r in ref]  # the same samples
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose([r[k] for r in two], [r[k] for r in ref], rtol=1e-4, atol=1e-6, err_msg=k)
    # AdamW turns a gradient near zero whose last bits differ into a step of either sign, of up to the learning
    # rate: all but a few weights agree to rounding, and none is further apart than those steps can take it
    a, b = (
        np.concatenate([x.ravel() for x in jax.tree.leaves(p)])
        for p in (_final_params(run_dir), _final_params(one, step=first))
    )
    apart = np.abs(a - b) > 1e-5 + 1e-4 * np.abs(b)
    assert apart.mean() < 1e-3 and np.abs(a - b).max() <= 2 * first * cfg.optimizer.learning_rate, apart.sum()


def _rollout_like_batch(cfg, seed=0):
    """A batch shaped like a step's rollouts: ragged prompts and completions, padding, a mask on completions."""
    r = cfg.rl
    B, T = r.prompts_per_step * r.group_size, r.max_prompt_tokens + r.max_new_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, size=(B, T)).astype(np.int32)
    positions = np.full((B, T), -1, np.int32)
    mask = np.zeros((B, T - 1), np.float32)
    for i in range(B):
        prompt, new = rng.integers(2, r.max_prompt_tokens + 1), rng.integers(1, r.max_new_tokens + 1)
        positions[i, : prompt + new] = np.arange(prompt + new)
        mask[i, prompt - 1 : prompt - 1 + new] = 1.0
    old = (rng.normal(-3.0, 0.5, size=(B, T - 1)) * mask).astype(np.float32)
    advantages = rng.normal(size=B).astype(np.float32)
    ref = (rng.normal(-3.0, 0.5, size=(B, T - 1)) * mask).astype(np.float32)
    batch = {"tokens": tokens, "positions": positions, "mask": mask, "old_logp": old, "advantages": advantages}
    return batch, ref


def test_an_rl_step_on_a_mesh_of_8_devices_equals_one_device(token_cache):
    """The update sharded over (data=2, fsdp=2, tensor=2), params and optimizer state as training shards them,
    gives one device's loss, metrics and gradients: with plain SGD at rate 1 the new parameters are the old
    ones minus the gradient, so equal new parameters are equal gradients."""
    from jaxgen.config import MeshConfig
    from jaxgen.model import param_shardings
    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_train_state

    cfg = config(token_cache, "rl.kl_coef=0.1")
    batch, ref = _rollout_like_batch(cfg)
    one = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    eight = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))  # MESH
    start = jax.tree.map(np.asarray, create_train_state(cfg, one).params)
    out = {}
    for name, mesh in (("one", one), ("eight", eight)):
        state = create_train_state(cfg, mesh, jax.device_put(start, param_shardings(cfg.model, mesh)))
        state, m = loop.make_rl_update(cfg, mesh, state, optax.sgd(1.0))(state, batch, ref)
        out[name] = jax.tree.map(np.asarray, (state.params, jax.device_get(m)))
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(state.params)}  # the 8-device step's new params
    assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
    (p1, m1), (p8, m8) = out["one"], out["eight"]
    for k in ("loss", "kl", "entropy", "ratio", "clip_frac", "grad_norm", "sampler_gap"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, err_msg=k)
    g1, g8 = (jax.tree.map(np.subtract, start, p) for p in (p1, p8))
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(g1))
    assert scale > 1e-3  # a gradient to compare, not zeros
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), g8, g1)


def test_weights_sent_from_the_trainer_mesh_to_the_sampler_devices_are_the_trainers(token_cache):
    """rl.sampler_devices=4 of 8: the trainer's mesh (data=2, fsdp=2) over the other four; after an update the
    weights go to the engine's devices (an all-gather over the trainer's, then a device-to-device copy) equal
    to the trainer's bitwise, and the engine generates what a fresh engine built from them does."""
    from jaxgen.inference.llm import LLM
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.model import decode_params
    from jaxgen.rl.policy import Policy
    from jaxgen.sharding import make_mesh
    from jaxgen.tokenizer import Tokenizer
    from jaxgen.training.step import create_train_state

    cfg = config(token_cache, "rl.sampler_devices=4", "mesh.data=2", "mesh.fsdp=2")
    mesh = make_mesh(cfg.mesh, loop.trainer_devices(cfg.rl.sampler_devices))
    engine_devices = set(loop.sampler_mesh(cfg).devices.flat)
    assert engine_devices == set(jax.local_devices()[:4]) and engine_devices.isdisjoint(mesh.devices.flat)
    state = create_train_state(cfg, mesh)
    tok, place = Tokenizer.byte_level(), loop.sampler_place(cfg, mesh)
    llm = Policy.of(cfg, mesh, state.params).engine(state, tok, place, slots=8, data_parallel=4, num_pages=64)
    batch, ref = _rollout_like_batch(cfg)
    state, _ = loop.make_rl_update(cfg, mesh, state, optax.sgd(1.0))(state, batch, ref)  # new weights
    Policy.of(cfg, mesh, state.params).swap(llm, state, place)

    trained = jax.tree.map(np.asarray, state.params)
    held = llm.engine.runner.params
    assert {d for x in jax.tree.leaves(held) for d in x.sharding.device_set} == engine_devices
    want = decode_params(trained, 8, cfg.model)  # the engine's layout of the trainer's weights
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), held, want)
    prompts = ["1+2=", "7+5=", "3+3=", "9+0="]
    sampling = [SamplingConfig(max_new_tokens=6, temperature=t, seed=i, logprobs_mode="processed")
                for i, t in enumerate((0.0, 1.0, 1.0, 0.7))]  # fmt: skip
    fresh = LLM(trained, cfg=cfg.model, tokenizer=tok, slots=8, num_pages=64, max_logprobs=0)
    for a, b in zip(llm.generate(prompts, sampling), fresh.generate(prompts, sampling), strict=True):
        assert [c.tokens for c in a.outputs] == [c.tokens for c in b.outputs]
        np.testing.assert_allclose([c.logprobs for c in a.outputs], [c.logprobs for c in b.outputs], atol=1e-5)
