import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.config import ConfigError
from jaxgen.sharding import make_mesh
from jaxgen.training import trainer
from jaxgen.training.step import create_train_state, cross_entropy, make_train_step, put_batch


def random_batch(cfg, seed=0, batch_size=None):
    b, t = batch_size or cfg.training.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 256, size=(b, t + 1)).astype(np.int32)
    return {
        "inputs": seq[:, :-1], "targets": seq[:, 1:],
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32), "loss_mask": np.ones((b, t), np.int32),
    }  # fmt: skip


def test_cross_entropy_equals_hand_computation():
    logits = jnp.array([[[2.0, 1.0, 0.1], [0.5, 0.5, 3.0], [1.0, -1.0, 0.0]]])
    targets = jnp.array([[0, 2, 1]])
    total, count = cross_entropy(logits, targets, jnp.ones((1, 3)))
    p = np.exp(np.asarray(logits[0])) / np.exp(np.asarray(logits[0])).sum(-1, keepdims=True)
    hand = -np.mean([np.log(p[0, 0]), np.log(p[1, 2]), np.log(p[2, 1])])
    np.testing.assert_allclose(total / count, hand, rtol=1e-6)


def test_masked_positions_do_not_change_the_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    mask = jnp.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    total, count = cross_entropy(logits, targets, mask)
    changed = logits.at[0, 2].set(100.0).at[1, 0].set(-50.0)  # only masked positions differ
    total2, count2 = cross_entropy(changed, targets.at[0, 4].set(3), mask)
    assert count == 7
    np.testing.assert_allclose(total / count, total2 / count2, rtol=1e-6)
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(total / count, -(picked * mask).sum() / mask.sum(), rtol=1e-5)


def _step_n(cfg, batches, devices=1):
    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    state = create_train_state(cfg, mesh)
    step = make_train_step(cfg, mesh, state)
    losses = []
    for b in batches:
        state, m = step(state, put_batch(b, mesh))
        losses.append(float(m["loss"]))
    return state, losses


def test_gradient_accumulation_equals_one_big_batch(tiny_cfg):
    batch = random_batch(tiny_cfg)
    batch["loss_mask"][:3, 20:] = 0  # unequal token counts per micro-batch: weights must be by token
    s1, l1 = _step_n(tiny_cfg, [batch] * 2)
    cfg4 = dataclasses.replace(tiny_cfg, training=dataclasses.replace(tiny_cfg.training, grad_accum=4))
    s4, l4 = _step_n(cfg4, [batch] * 2)
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam divides tiny grads by tiny norms


def test_tiny_model_overfits_one_batch(tiny_cfg):
    cfg = dataclasses.replace(
        tiny_cfg, training=dataclasses.replace(tiny_cfg.training, steps=120),
        optimizer=dataclasses.replace(tiny_cfg.optimizer, learning_rate=1e-2, warmup_steps=10, weight_decay=0.0),
    )  # fmt: skip
    _, losses = _step_n(cfg, [random_batch(cfg, seed=1)] * 120)
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_nonfinite_step_is_skipped_and_counted(tiny_cfg):
    mesh = make_mesh(tiny_cfg.mesh)
    state = create_train_state(tiny_cfg, mesh)
    # One NaN weight: the loss and every gradient become NaN.
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p.at[(0,) * p.ndim].set(jnp.nan) if path[-1].key == "w_up_df" else p, state.params
    )
    state = state.replace(params=params)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    step = make_train_step(tiny_cfg, mesh, state)
    for i in range(2):
        state, m = step(state, put_batch(random_batch(tiny_cfg), mesh))
        assert not bool(m["finite"])
        assert int(state.nonfinite_in_row) == i + 1 and int(state.nonfinite_total) == i + 1
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # nothing updated (NaN == NaN here)


def test_trainer_stops_on_repeated_nonfinite_without_a_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    def poisoned_state(cfg, mesh, params=None):
        state = create_train_state(cfg, mesh, params)
        return state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))

    monkeypatch.setattr(trainer, "create_train_state", poisoned_state)
    cfg = dataclasses.replace(
        tiny_cfg, checkpoint=dataclasses.replace(tiny_cfg.checkpoint, every=1),
        training=dataclasses.replace(tiny_cfg.training, max_nonfinite_in_row=3),
    )  # fmt: skip
    with pytest.raises(trainer.NonFiniteError, match="3 non-finite losses or gradients in a row"):
        trainer.train(cfg, tmp_path, progress=False)
    # steps 1 and 2 were skipped updates of unchanged params; step 3 stopped before saving
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1, 2]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in records] == [1, 2, 3]


def test_default_data_path_trains_and_writes_the_run_folder(tiny_cfg, tmp_path):
    result = trainer.train(tiny_cfg, tmp_path, progress=False)
    assert result.status == "finished" and result.step == tiny_cfg.training.steps
    (s1, first), (s2, last) = result.eval_losses
    assert (s1, s2) == (15, 30)
    assert last < first < np.log(tiny_cfg.model.vocab_size)  # held-out loss falls from chance
    for name in ("config.yaml", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (tmp_path / name).exists(), name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [10, 20, 30]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in records)
    again = trainer.train(tiny_cfg, tmp_path, progress=False)
    assert again.status == "already finished" and again.step == 30


def test_run_folder_refuses_another_model(tiny_cfg, tmp_path):
    trainer.prepare_run_dir(tiny_cfg, tmp_path)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)  # the folder holds a checkpoint: it is bound to its config
    other = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, num_layers=3))
    with pytest.raises(ConfigError, match="different `model` section"):
        trainer.prepare_run_dir(other, tmp_path)


def test_vocab_smaller_than_tokenizer_is_an_error(tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, vocab_size=200))
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 is smaller than the tokenizer's vocabulary \(257\)"):
        trainer.prepare_run_dir(cfg, tmp_path)
