"""Reinforcement learning with LoRA: only the adapters train and only they go to the engine, written into
its adapter bank's slot in place (`LLM.update_lora`, jaxgen.rl.policy).

The swap is checked against an independent engine built on the merged weights (`lora.merge`), the sampler's
log-probabilities against the training forward with the adapters attached; then a short RL+LoRA run on the
built-in task raises its reward and resumes bitwise (adapters and optimizer state) after a stop."""

import dataclasses
import functools
import types

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import Config, LoraConfig, ModelConfig, load_config
from jaxgen.inference.llm import LLM
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import lora
from jaxgen.rl import loop
from jaxgen.rl.objectives import token_logprobs
from jaxgen.rl.policy import ADAPTER, Policy
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.metrics import read_metrics
from tests.conftest import ROOT

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128)
LORA_CFG = dataclasses.replace(CFG, lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down")))
SERVE = dict(slots=4, page_size=8, num_pages=26, chunk_steps=4, prefill_chunk=32, max_logprobs=0)
T = 128  # the reference forward's padded length (one compiled shape)
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _adapters(seed: int) -> dict:
    """Random A and B (B is zero at init, which would change nothing), large enough to change greedy tokens."""
    a = lora.init_lora(LORA_CFG, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 2 * len(a)))
    return {t: {k: jax.random.normal(next(keys), w.shape) * 0.15 for k, w in pair.items()} for t, pair in a.items()}


@pytest.fixture(scope="module")
def base():
    p = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda w: w * 5.0 if w.ndim > 1 else w, p)  # sharper logits: no near-ties in argmax


@pytest.fixture(scope="module")
def policy(base):
    return Policy(Config(model=LORA_CFG), base, None)


@pytest.fixture(scope="module")
def llm(policy):
    return policy.engine(_state(_adapters(1)), Tokenizer.byte_level(), **SERVE)


def _state(adapters):
    return types.SimpleNamespace(params=adapters)  # what Policy reads of a TrainState


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, k).tolist() for k in (5, 23, 40, 61)]  # ragged; 40 and 61 in two chunks


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


@functools.partial(jax.jit, static_argnames="cfg")
def _logprobs(params, tokens, positions, temperature, cfg):
    return token_logprobs(params, tokens, positions, cfg=cfg, temperature=temperature)[0]


def test_the_samplers_logprobs_are_the_trainers_forward_with_the_adapters(policy, llm, base, capsys):
    ad = _adapters(3)
    policy.swap(llm, _state(ad))
    prompts, t = _prompts(1), 0.8
    sampling = [SamplingConfig(max_new_tokens=24, temperature=t, n=3, seed=i, logprobs_mode="processed")
                for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate(prompts, sampling, ADAPTER)
    rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    tokens = np.zeros((len(rows), T), np.int32)
    positions = np.full((len(rows), T), -1, np.int32)
    for i, (p, c) in enumerate(rows):
        seq = p + c.tokens
        tokens[i, : len(seq)], positions[i, : len(seq)] = seq, np.arange(len(seq))
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
    "rl.warm_start_steps=10", "rl.prompts_per_step=4", "rl.group_size=8", "rl.max_new_tokens=3",
    "rl.max_prompt_tokens=6", "checkpoint.every=2", "optimizer.warmup_steps=0",
]  # fmt: skip
STEPS = 12
LORA = ["model.lora.rank=4", "model.lora.alpha=16", "model.lora.base_dtype=int8", "rl.kl_coef=0.01"]
LEARN = ["rl.reward=tests.test_rl_lora:starts_with_a_digit", f"training.steps={STEPS}", "optimizer.learning_rate=2e-2"]


def starts_with_a_digit(prompt: str, completion: str, **fields) -> float:
    return float(completion[:1].isdigit())


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
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.25, rewards  # a flipped sign drives it down
    gaps = [r["sampler_gap"] for r in records]
    assert max(gaps) < 1e-4, gaps
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
    return jax.tree.map(np.asarray, state)


def test_a_stopped_lora_run_resumes_to_the_adapters_and_optimizer_of_a_run_never_stopped(tmp_path, uninterrupted):
    cfg, never = uninterrupted
    stopped = tmp_path / "stopped"
    assert loop.run_rl(cfg, stopped, progress=False, stop_after=5).step == 5
    resumed = loop.run_rl(cfg, stopped, progress=False)
    assert resumed.step == STEPS and len(resumed.rewards) == STEPS - 5
    a, b = (_checkpointed_state(cfg, run, STEPS) for run in (stopped, never))
    assert set(a.params) == set(cfg.model.lora.targets)  # the checkpoint holds the adapters, no base
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):  # adapters, AdamW moments, step, key
        np.testing.assert_array_equal(x, y)
    by_step = {run: {r["step"]: r["reward"] for r in read_metrics(run)} for run in (stopped, never)}
    assert by_step[stopped] == by_step[never]
