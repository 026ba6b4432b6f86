"""The RL loop end to end: GRPO raises a reward on a live engine whose weights are swapped every step; the
sampler's log-probabilities are the trainer's; a run killed with SIGKILL resumes to the parameters of a
run never killed."""

import jax
import numpy as np
import pytest

from jaxgen.config import load_config
from jaxgen.rl import loop
from jaxgen.training.metrics import read_metrics
from tests.conftest import ROOT

# a tiny policy, a short warm start on the built-in task, small rollouts: seconds a step on 2 cores
TINY = [
    "model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.d_ff=128",
    "rl.warm_start_steps=10", "rl.prompts_per_step=4", "rl.group_size=8", "rl.max_new_tokens=3",
    "rl.max_prompt_tokens=6", "checkpoint.every=2", "optimizer.warmup_steps=0",
]  # fmt: skip


def starts_with_a_digit(prompt: str, completion: str, **fields) -> float:
    """A reward the barely warm policy earns a third of the time and a working gradient raises fast."""
    return float(completion[:1].isdigit())


def config(token_cache, *overrides):
    cache = f"data.cache_dir={token_cache}"
    return load_config(ROOT / "configs" / "rl-arithmetic.yaml", [*TINY, cache, *overrides])


@pytest.fixture(scope="module")
def warm(tmp_path_factory, token_cache):
    """A warm-started policy folder (a train.py run), shared by the tests as their rl.init_from."""
    from jaxgen.training.trainer import train

    folder = tmp_path_factory.mktemp("warm") / "warm_start"
    cfg = config(token_cache)
    train(loop.warm_start_config(cfg, folder), folder, progress=False)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, token_cache, warm):
    """(config, run folder) of GRPO run start to end in one go: what the tests below check and resume to."""
    cfg = config(token_cache, *LEARN, f"rl.init_from={warm}")
    run_dir = tmp_path_factory.mktemp("rl") / "run"
    result = loop.run_rl(cfg, run_dir, progress=False)
    assert result.status == "finished" and result.step == STEPS
    return cfg, run_dir


STEPS = 16
LEARN = ["rl.reward=tests.test_rl_loop:starts_with_a_digit", f"training.steps={STEPS}", "optimizer.learning_rate=1e-2"]


def test_grpo_raises_the_reward_and_the_sampler_agrees_with_the_trainer(uninterrupted):
    cfg, run_dir = uninterrupted
    records = read_metrics(run_dir)
    rewards = [r["reward"] for r in records]
    start, end = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert end > start + 0.25, rewards  # a flipped gradient sign drives it to zero instead
    # the engine's log-probabilities of its own samples are the training forward's (max |difference|)
    assert max(r["sampler_gap"] for r in records) < 1e-4, [r["sampler_gap"] for r in records]
    assert (run_dir / "reward.png").stat().st_size > 0
    assert loop.run_rl(cfg, run_dir, progress=False).status == "already finished"


def _finished_steps(run_dir):
    folder = run_dir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def test_a_stopped_run_resumes_to_the_parameters_of_a_run_never_stopped(tmp_path, uninterrupted):
    """Stopped after 6 steps (checkpointed), then the same call again: the uninterrupted run's parameters,
    bitwise, and its rewards step for step (prompts, seeds and the reference are functions of the step)."""
    cfg, never = uninterrupted
    stopped = tmp_path / "stopped"
    first = loop.run_rl(cfg, stopped, progress=False, stop_after=6)
    assert first.status == "stopped" and first.step == 6
    resumed = loop.run_rl(cfg, stopped, progress=False)
    assert resumed.step == STEPS and len(resumed.rewards) == STEPS - 6
    a, b = (_final_params(run) for run in (stopped, never))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    by_step = {run: {r["step"]: r["reward"] for r in read_metrics(run)} for run in (stopped, never)}
    assert by_step[stopped] == by_step[never]


def _final_params(run_dir):
    from jaxgen.inference.loading import load_run

    _, _, params = load_run(run_dir)
    return jax.tree.map(np.asarray, params)
