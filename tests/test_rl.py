"""Reinforcement learning's objectives against a numpy implementation written here from the formulas
(GRPO's group-relative advantages and clipped ratio, REINFORCE with a baseline, the k3 KL estimate,
token- and sequence-level averaging), and the training forward's token log-probabilities against the
model's logits scored one position at a time."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, RLConfig
from jaxgen.config.base import literal_fields
from jaxgen.rl import objectives as rl


def np_advantages(rewards, normalize):
    out = np.zeros_like(rewards, dtype=np.float64)
    for p in range(rewards.shape[0]):
        group = rewards[p].astype(np.float64)
        out[p] = group - group.mean()
        if normalize:
            out[p] /= group.std() + 1e-6
    return out


def np_loss(logp, old, adv, mask, algorithm, eps, kl_coef, ref, averaging, correction="none", cap=2.0, at=None):
    """at: the trainer's log-probabilities the importance weights are taken at (held fixed: no gradient
    flows through them); default logp."""
    at = logp if at is None else at
    B, T = logp.shape
    per = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            rho = np.exp(at[b, t] - old[b, t])  # the importance weight, sampler -> trainer
            r, weight = np.exp(logp[b, t] - old[b, t]), 1.0
            if correction != "none":  # the ratio against the current policy itself, weighted
                r = np.exp(logp[b, t] - at[b, t])
                weight = min(rho, cap) if correction == "tis" else float(1 / cap <= rho <= cap)
            if algorithm == "grpo":
                term = -min(r * adv[b], min(max(r, 1 - eps), 1 + eps) * adv[b])
            else:
                term = -r * adv[b]
            term *= weight
            if kl_coef:
                d = ref[b, t] - logp[b, t]
                term += kl_coef * (np.exp(d) - d - 1)
            per[b, t] = term
    if averaging == "token":
        return (per * mask).sum() / mask.sum()
    rows = [(per[b] * mask[b]).sum() / mask[b].sum() for b in range(B) if mask[b].sum() > 0]
    return float(np.mean(rows))


@pytest.mark.parametrize("normalize", [True, False])
def test_group_advantages_equal_numpy(normalize):
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]], np.float32)
    got = np.asarray(rl.group_advantages(jnp.asarray(rewards), normalize))
    np.testing.assert_allclose(got, np_advantages(rewards, normalize), rtol=1e-5, atol=1e-6)
    assert np.all(got[1] == 0)  # a group that scores alike teaches nothing
    np.testing.assert_allclose(np.asarray(rl.batch_advantages(jnp.asarray(rewards[2]))), rewards[2] - 1.0)


def test_rl_config_names_are_the_tables_keys():
    """rl.algorithm and rl.averaging allow exactly the objectives' table entries: a new algorithm is a record in
    objectives.ALGORITHMS and its name in RLConfig, and neither can be added alone."""
    allowed = literal_fields(RLConfig)
    assert allowed["algorithm"] == tuple(rl.ALGORITHMS)
    assert allowed["averaging"] == tuple(rl.AVERAGING)


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce"])
def test_advantages_follow_the_algorithm(algorithm):
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, -1.0, 2.0, 0.0]], np.float32)
    got = np.asarray(rl.advantages(jnp.asarray(rewards), rl.RLSettings(algorithm=algorithm, normalize=False)))
    expected = np_advantages(rewards, False) if algorithm == "grpo" else rewards - rewards.mean()
    np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "algorithm,kl_coef,averaging,correction",
    [("grpo", 0.0, "token", "none"), ("grpo", 0.1, "sequence", "none"), ("reinforce", 0.0, "sequence", "none"),
     ("reinforce", 0.05, "token", "none"), ("grpo", 0.1, "token", "tis"), ("reinforce", 0.0, "sequence", "tis"),
     ("grpo", 0.0, "sequence", "mask"), ("reinforce", 0.05, "token", "mask")],
)  # fmt: skip
def test_policy_loss_and_its_gradient_equal_numpy(algorithm, kl_coef, averaging, correction):
    """Stale rollouts: the sampler's log-probabilities `old` differ from the trainer's by up to ~1 in log
    (weights on both sides of the clip range and of the cap 1.3); the correction's weights are constants of
    the gradient (held at the trainer's values in the central differences)."""
    rng = np.random.default_rng(0)
    B, T = 6, 7
    logp = rng.normal(-2.0, 0.5, (B, T))
    old = logp + rng.normal(0.0, 0.3, (B, T))  # ratios on both sides of the clip range
    ref = logp + rng.normal(0.0, 0.2, (B, T))
    adv = rng.normal(0.0, 1.0, B)
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[3] = 0  # a row with no completion tokens counts for nothing
    settings = rl.RLSettings(algorithm=algorithm, clip_eps=0.2, kl_coef=kl_coef, averaging=averaging,
                             correction=correction, is_cap=1.3)  # fmt: skip
    args = [jnp.asarray(x, jnp.float32) for x in (old, adv, mask)]
    weights = np.exp(logp - old)[mask > 0]
    assert (weights > 1.3).any() and (weights < 1 / 1.3).any()  # the cap and the mask's floor both bite

    def loss(lp):
        return rl.policy_loss(lp, args[0], args[1], args[2], settings, ref_logp_bt=jnp.asarray(ref, jnp.float32))[0]

    got, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    case = (algorithm, 0.2, kl_coef, ref, averaging, correction, 1.3)
    want = np_loss(logp, old, adv, mask, *case)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # the gradient by central differences of the numpy loss, at a few entries
    for b, t in [(0, 0), (2, 3), (5, 6), (3, 1)]:
        h = 1e-4
        up, down = logp.copy(), logp.copy()
        up[b, t] += h
        down[b, t] -= h
        fd = (np_loss(up, old, adv, mask, *case, at=logp) - np_loss(down, old, adv, mask, *case, at=logp)) / (2 * h)
        np.testing.assert_allclose(float(grad[b, t]), fd, rtol=2e-3, atol=1e-5)
    assert float(grad[3].sum()) == 0.0


def test_reinforce_gradient_is_minus_advantage_times_grad_logp_on_policy():
    """On-policy (old = logp), the ratio's gradient is the REINFORCE estimator's."""
    logp = jnp.asarray([[-1.0, -2.0], [-0.5, -3.0]])
    adv, mask = jnp.asarray([2.0, -1.0]), jnp.ones((2, 2))
    settings = rl.RLSettings(algorithm="reinforce")
    grad = jax.grad(lambda lp: rl.policy_loss(lp, logp, adv, mask, settings)[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), -np.asarray(adv)[:, None] * np.ones((2, 2)) / 4, rtol=1e-6)


@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_on_policy_the_corrections_are_the_plain_ratio(correction):
    """Staleness 0 and the sampler's log-probabilities the trainer's (deterministic mode): every weight is 1,
    and the loss and its gradient are the uncorrected ones, bitwise."""
    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(-2.0, 0.5, (4, 5)), jnp.float32)
    adv, mask = jnp.asarray(rng.normal(size=4), jnp.float32), jnp.asarray(rng.random((4, 5)) < 0.7, jnp.float32)
    out = {}
    for name in ("none", correction):
        settings = rl.RLSettings(correction=name, kl_coef=0.1)
        out[name] = jax.value_and_grad(lambda lp, s=settings: rl.policy_loss(lp, logp, adv, mask, s, logp - 0.1)[0])(
            logp
        )
    np.testing.assert_array_equal(out["none"][0], out[correction][0])
    np.testing.assert_array_equal(out["none"][1], out[correction][1])
    metrics = rl.policy_loss(logp, logp, adv, mask, rl.RLSettings(correction=correction))[1]
    assert float(metrics["ratio"]) == 1.0 and float(metrics["corrected"]) == 0.0


def test_token_logprobs_equal_the_logits_at_each_position():
    cfg = ModelConfig(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
    logp, entropy = rl.token_logprobs(params, tokens, positions, cfg=cfg, temperature=0.7)
    assert logp.shape == entropy.shape == (3, 8)
    logits, _ = model.forward(params, tokens, positions, cfg=dataclasses.replace(cfg))
    for t in range(8):  # the full forward's logits at t, tempered, score token t + 1
        dist = jax.nn.log_softmax(logits[:, t] / 0.7)
        np.testing.assert_allclose(np.asarray(logp[:, t]), np.asarray(dist[jnp.arange(3), tokens[:, t + 1]]), atol=2e-5)
        ent = -jnp.sum(jnp.exp(dist) * dist, axis=-1)
        np.testing.assert_allclose(np.asarray(entropy[:, t]), np.asarray(ent), atol=2e-5)


def test_rollout_batch_puts_each_completion_token_where_the_forward_scores_it():
    """Column t of the per-token arrays scores token t + 1: a completion's first token sits at column
    len(prompt) - 1, with its sampler log-probability, and only completion columns are in the mask."""
    from jaxgen.config import load_config
    from jaxgen.inference.decode import Completion
    from jaxgen.inference.llm import RequestOutput
    from jaxgen.rl.rollouts import rollout_batch

    cfg = load_config(None, ["rl.group_size=2", "rl.max_prompt_tokens=4", "rl.max_new_tokens=3"])
    outs = [
        RequestOutput(
            "ab",
            [5, 6],
            [Completion(0, 0, [7], "x", "stop", [-0.5]), Completion(0, 1, [8, 9], "yz", "length", [-1.0, -2.0])],
        ),
        RequestOutput(
            "abc",
            [1, 2, 3],
            [Completion(1, 0, [4, 4, 4], "www", "length", [-3.0, -4.0, -5.0]), Completion(1, 1, [], "", "stop", [])],
        ),
    ]
    rewards = np.asarray([[1.0, 0.0], [0.0, 0.0]], np.float32)
    b = rollout_batch(cfg, outs, rewards)
    assert b["tokens"].shape == (4, 7) and b["mask"].shape == (4, 6)
    np.testing.assert_array_equal(b["tokens"][1, :4], [5, 6, 8, 9])
    np.testing.assert_array_equal(b["positions"][1], [0, 1, 2, 3, -1, -1, -1])
    np.testing.assert_array_equal(b["mask"][1], [0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(b["old_logp"][1], [0, -1.0, -2.0, 0, 0, 0])
    np.testing.assert_array_equal(b["mask"][2], [0, 0, 1, 1, 1, 0])
    assert b["mask"][3].sum() == 0
    np.testing.assert_allclose(b["advantages"], [1.0, -1.0, 0.0, 0.0], atol=1e-5)


def test_deterministic_rollouts_with_blocks_that_do_not_divide_the_pages_are_refused_before_any_work(tmp_path):
    from jaxgen.config import ConfigError, load_config
    from jaxgen.rl import loop
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs" / "rl-arithmetic.yaml", ["model.deterministic=true"])  # blocks of 512
    with pytest.raises(ConfigError, match=r"serve.page_size=16 is not allowed with model.deterministic=true"):
        loop.run_rl(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # no warm start trained, no folder made
    # the trainer's mesh: data parallel only (an fsdp-split product sums in another order than one device's)
    split = ["model.deterministic=true", "model.attention_block=16", "mesh.data=2", "mesh.fsdp=2"]
    cfg = load_config(ROOT / "configs" / "rl-arithmetic.yaml", split)
    with pytest.raises(ConfigError, match=r"mesh.fsdp=2 is not allowed with model.deterministic=true: 1: data"):
        loop.run_rl(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_saved_rollout_comes_back_only_whole_and_of_this_config(tmp_path):
    """rollouts saved ahead of their update (rl.max_staleness): taken back as saved; None when the file is
    missing, damaged, of another shape or made under another config (another fingerprint)."""
    from jaxgen.rl.rollouts import FOLDER, Rollout

    batch = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6), "mask": np.ones((2, 5), np.float32),
             "version": np.full((2, 5), 3, np.int32)}  # fmt: skip
    stats = {"turns": 1.5, "tool_calls": 0.25}  # multi-turn rollouts' (jaxgen.rl.episodes)
    rollout = Rollout(7, 3, batch, np.asarray([[1.0, 0.0]], np.float32), 9, 0.5, 0.1, "abc", stats=stats)
    rollout.save(tmp_path)
    back = Rollout.load(tmp_path, 7, (2, 6), "abc")
    assert back is not None and back.loaded and (back.step, back.version, back.new_tokens) == (7, 3, 9)
    assert back.stats == stats
    for k in batch:
        np.testing.assert_array_equal(back.batch[k], batch[k])
    assert Rollout.load(tmp_path, 8, (2, 6), "abc") is None  # none saved
    assert Rollout.load(tmp_path, 7, (2, 7), "abc") is None  # another shape
    assert Rollout.load(tmp_path, 7, (2, 6), "abd") is None  # another config
    (path,) = (tmp_path / FOLDER).glob("*.npz")
    path.write_bytes(path.read_bytes()[:100])  # cut short
    assert Rollout.load(tmp_path, 7, (2, 6), "abc") is None
