"""Reinforcement learning with LoRA: only the adapters train and only they go to the engine, written into
its adapter bank's slot in place (`LLM.update_lora`, jaxgen.rl.policy).

The swap is checked against an independent engine built on the merged weights (`lora.merge`), the sampler's
log-probabilities against the training forward with the adapters attached; then a short RL+LoRA run on the
built-in task raises its reward and resumes bitwise (adapters and optimizer state) after a stop."""

import dataclasses
import shutil
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxgen.config import Config, LoraConfig, load_config
from jaxgen.inference.llm import LLM
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import lora
from jaxgen.rl import loop
from jaxgen.rl.policy import ADAPTER, Policy
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.metrics import read_metrics
from tests.conftest import ROOT
from tests.test_rl_engine import CFG, GREEDY, _logprobs, _padded, _params, _prompts  # the same tiny model

LORA_CFG = dataclasses.replace(CFG, lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down")))
SERVE = dict(slots=4, page_size=8, num_pages=26, chunk_steps=4, prefill_chunk=32, max_logprobs=0)


def _adapters(seed: int) -> dict:
    """Random A and B (B is zero at init, which would change nothing), large enough to change greedy tokens."""
    a = lora.init_lora(LORA_CFG, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 2 * len(a)))
    return {t: {k: jax.random.normal(next(keys), w.shape) * 0.15 for k, w in pair.items()} for t, pair in a.items()}


@pytest.fixture(scope="module")
def base():
    return _params(0)  # sharper logits: no near-ties in argmax


@pytest.fixture(scope="module")
def policy(base):
    return Policy(Config(model=LORA_CFG), base, None)


@pytest.fixture(scope="module")
def llm(policy):
    return policy.engine(_state(_adapters(1)), Tokenizer.byte_level(), **SERVE)


def _state(adapters):
    return types.SimpleNamespace(params=adapters)  # what Policy reads of a TrainState


def test_the_lora_swap_gives_the_merged_models_outputs_without_compiling(policy, llm, base):
    prompts, ad1, ad2 = _prompts(), _adapters(1), _adapters(2)
    policy.swap(llm, _state(ad1))
    before = [o.outputs[0].tokens for o in llm.generate(prompts, GREEDY, ADAPTER)]
    compiled = llm.engine.compilations
    policy.swap(llm, _state(ad2))  # after an update: the adapters' slot rewritten in place
    after = [o.outputs[0].tokens for o in llm.generate(prompts, GREEDY, ADAPTER)]
    assert llm.engine.compilations == compiled  # the same programs, the bank as their argument
    assert after != before
    merged = LLM(lora.merge(base, ad2, LORA_CFG), cfg=CFG, tokenizer=llm.tokenizer, **SERVE)  # no bank at all
    assert [o.outputs[0].tokens for o in merged.generate(prompts, GREEDY)] == after
    merged.update_params(lora.merge(base, ad1, LORA_CFG))
    assert [o.outputs[0].tokens for o in merged.generate(prompts, GREEDY)] == before
    merged.update_params(base)  # rows without the adapter: the base, untouched by the swaps
    assert [o.outputs[0].tokens for o in llm.generate(prompts, GREEDY)] == [
        o.outputs[0].tokens for o in merged.generate(prompts, GREEDY)
    ]


def test_the_samplers_logprobs_are_the_trainers_forward_with_the_adapters(policy, llm, base, capsys):
    ad = _adapters(3)
    policy.swap(llm, _state(ad))
    prompts, t = _prompts(1), 0.8
    sampling = [SamplingConfig(max_new_tokens=24, temperature=t, n=3, seed=i, logprobs_mode="processed")
                for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate(prompts, sampling, ADAPTER)
    rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    tokens, positions = _padded([p + c.tokens for p, c in rows])
    ref = np.asarray(_logprobs(policy.forward_params(ad, base), tokens, positions, np.float32(t), cfg=LORA_CFG))
    diffs = np.concatenate(
        [np.abs(np.asarray(c.logprobs) - lp[len(p) - 1 : len(p) - 1 + len(c.tokens)]) for (p, c), lp in zip(rows, ref)]
    )
    without = np.asarray(_logprobs(base, tokens, positions, np.float32(t), cfg=CFG))  # the adapters matter
    far = max(np.abs(np.asarray(c.logprobs) - lp[len(p) - 1 : len(p) - 1 + len(c.tokens)]).max()
              for (p, c), lp in zip(rows, without))  # fmt: skip
    with capsys.disabled():
        q = np.quantile(diffs, [0.5, 0.99, 1.0])
        print(f"\nLoRA |engine - training| over {diffs.size} tokens: median {q[0]:.1e} p99 {q[1]:.1e} max {q[2]:.1e}"
              f" (adapters off: max {far:.1e})")  # fmt: skip
    # float32 rounding: the engine sums in another order (decode layout, paged attention: up to 5e-5 with these
    # logits in tests/test_rl_engine.py) and adds x @ A @ (B * scale) where the trainer scales after the product
    assert diffs.max() < 1e-4 and far > 1e-2


# --- the loop -------------------------------------------------------------------------------------

TINY = [
    "model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.d_ff=128",
    "rl.warm_start_steps=60", "rl.prompts_per_step=4", "rl.group_size=16", "rl.max_new_tokens=3",
    "rl.max_prompt_tokens=6", "checkpoint.every=2", "optimizer.warmup_steps=2", "optimizer.min_lr_ratio=1.0",
]  # fmt: skip
STEPS = 16
# rank 1 on the products that write the residual stream: few adapter weights, so Adam's early sign-like steps
# add little noise; the warm start is long enough that the head is sharp (a LoRA cannot sharpen the head's
# logits: with 20 warm steps the reward stayed flat while the full model's rose)
LORA = ["model.lora.rank=1", "model.lora.alpha=4", "model.lora.targets=[o,down]", "model.lora.base_dtype=int8",
        "rl.kl_coef=0.01"]  # fmt: skip
LEARN = ["rl.reward=tests.test_rl_lora:starts_with_a_one", f"training.steps={STEPS}", "optimizer.learning_rate=3e-2"]


def starts_with_a_one(prompt: str, completion: str, **fields) -> float:
    """A reward the warm policy earns about half the time (sums of 10 and more start with 1)."""
    return float(completion[:1] == "1")


def _config(token_cache, *overrides):
    cache = f"data.cache_dir={token_cache}"
    return load_config(ROOT / "configs" / "rl-arithmetic.yaml", [*TINY, cache, *overrides])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, token_cache):
    """(config, run folder) of an RL+LoRA run over an int8 base, warm-started, run start to end in one go."""
    from jaxgen.training.trainer import train

    warm = tmp_path_factory.mktemp("warm") / "warm_start"
    train(loop.warm_start_config(_config(token_cache, *LORA), warm), warm, progress=False)
    cfg = _config(token_cache, *LORA, *LEARN, f"rl.init_from={warm}")
    run_dir = tmp_path_factory.mktemp("rl-lora") / "run"
    result = loop.run_rl(cfg, run_dir, progress=False)
    assert result.status == "finished" and result.step == STEPS
    return cfg, run_dir


def test_rl_with_lora_raises_the_reward_and_the_sampler_agrees(uninterrupted):
    _, run_dir = uninterrupted
    records = read_metrics(run_dir)
    rewards = [r["reward"] for r in records]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.25, rewards  # a flipped sign drives it down
    # int8 base: the product quantizes activations per row, and a 1e-7 difference can flip a rounding (gaps
    # of 1e-3 seen on one token in a few steps; most steps 1e-6); float32 parity: the tests above
    gaps = [r["sampler_gap"] for r in records]
    assert np.median(gaps) < 1e-5 and max(gaps) < 5e-3, gaps
    kls = [r["kl"] for r in records]
    assert kls[0] < 1e-6 and max(kls) > 1e-4, kls  # the reference is the base: the starting policy exactly


def _checkpointed_state(cfg, run_dir, step):
    from jaxgen.sharding import make_mesh
    from jaxgen.training.checkpoint import Checkpointer
    from jaxgen.training.step import create_train_state

    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    try:
        state, _ = ckpt.restore(step, create_train_state(cfg, make_mesh(cfg.mesh)), with_data=False)
    finally:
        ckpt.close()
    return jax.tree.map(np.asarray, state.replace(rng=jax.random.key_data(state.rng)))


def test_a_resumed_lora_run_ends_with_the_uninterrupted_adapters_and_optimizer_bitwise(tmp_path, uninterrupted):
    """The run's folder with its last checkpoint removed, run again: it restores the one before (adapters,
    AdamW moments, step, key; the base rebuilt from rl.init_from) and ends where the run never stopped, bitwise."""
    cfg, never = uninterrupted
    resumed = tmp_path / "resumed"
    shutil.copytree(never, resumed)
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))
    result = loop.run_rl(cfg, resumed, progress=False)
    assert result.step == STEPS and len(result.rewards) == cfg.checkpoint.every
    a, b = (_checkpointed_state(cfg, run, STEPS) for run in (resumed, never))
    assert set(a.params) == set(cfg.model.lora.targets)  # the checkpoint holds the adapters, no base
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    by_step = {r["step"]: r["reward"] for r in read_metrics(never)}
    assert result.rewards == [by_step[s] for s in range(STEPS - cfg.checkpoint.every + 1, STEPS + 1)]


def test_the_lora_run_folder_loads_as_its_base_with_the_adapters_merged(uninterrupted):
    from jaxgen.inference.loading import load_lora_run, load_model

    cfg, run_dir = uninterrupted
    _, _, base, adapters = load_lora_run(run_dir)
    _, _, warm = load_model(cfg.rl.init_from, param_dtype="float32")
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(warm), strict=True):
        np.testing.assert_array_equal(x, y)
    assert set(adapters) == set(cfg.model.lora.targets)
    model_cfg, _, merged = load_model(run_dir)  # what serve.py --checkpoint runs/<rl run> serves
    assert not model_cfg.lora.rank and jax.tree.structure(merged) == jax.tree.structure(warm)
    saved = load_config(run_dir / "config.yaml")  # the one field that names the base, as train.py writes it
    assert saved.model.lora.base == str(Path(cfg.rl.init_from).resolve())


def test_a_lora_run_written_before_model_lora_base_still_loads(uninterrupted, tmp_path):
    """An RL run folder of the older form (no model.lora.base; the base in rl.init_from) loads the same base."""
    from jaxgen.inference.loading import load_lora_run

    _, run_dir = uninterrupted
    old = tmp_path / "old-run"
    shutil.copytree(run_dir, old)
    data = yaml.safe_load((old / "config.yaml").read_text())
    base = data["model"]["lora"].pop("base")
    data["rl"]["init_from"] = base
    (old / "config.yaml").write_text(yaml.safe_dump(data))
    assert not load_config(old / "config.yaml").model.lora.base
    (_, _, want, adapters), (_, _, got, old_adapters) = load_lora_run(run_dir), load_lora_run(old)
    for x, y in zip(jax.tree.leaves((want, adapters)), jax.tree.leaves((got, old_adapters)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
