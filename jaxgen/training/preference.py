"""Preference tuning: DPO, IPO and SimPO on pairs of a chosen and a rejected answer (data.source=preference).

    state, metrics = preference_step(state, batch, base, cfg=cfg, tx=tx)   # as training.step.train_step

A batch is B rows (training.batch_size) of whole pairs packed (`data.pipeline.PreferencePairs`: each
answer its own segment, so packing is exact): the (B, T) token arrays of `training.step.BATCH_KEYS` (the
loss mask on the answers' tokens), `answer` (B, T) int32 (2k + side of the row's k-th pair for each target
token, -1 elsewhere), `pairs` (B, K) (1 where the row holds a k-th pair) and `reference` (B, K, 2) float32,
the frozen reference's summed log-probability of each answer. The reference is
the starting model (training.init_from's weights, or the seed's; with LoRA the base), scored once before
training with this module's own forward (`sequence_logps`) and cached beside the data (`reference.py`), so
no reference model is held while training.

Per pair, with the policy's summed log-probabilities c, r of the chosen and rejected answer, the reference's
c0, r0, the answers' token counts nc, nr, beta and label smoothing e (`preference` config section):
    dpo    delta = (c - c0) - (r - r0);  -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta)
           (DPO; conservative DPO for e > 0; TRL's "sigmoid" loss at e = 0)
    ipo    delta = (c - c0) / nc - (r - r0) / nr;  (delta - 1 / (2 beta))^2   (IPO, TRL's per-token form)
    simpo  delta = c / nc - r / nr - gamma / beta;  as dpo's loss of delta   (SimPO: no reference at all)
The step's loss is the mean over pairs; metrics: the rewards beta (c - c0) and beta (r - r0) (SimPO: beta
c / nc, beta r / nr), their margin and the share of pairs whose chosen answer has the larger reward.
SimPO was chosen as the reference-free objective over ORPO: it needs no reference pass at all (ORPO adds an
SFT term and an odds ratio: two losses to weigh), and it is the stronger of the two in SimPO's comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxgen import model
from jaxgen.config import Config, PreferenceConfig
from jaxgen.model import layers, lora
from jaxgen.training.step import apply_grads, lr_schedule

REFERENCE_FREE = ("simpo",)  # objectives that read no reference (its log-probabilities are not computed)


def sequence_logps(params, batch: dict, cfg: Config):
    """(summed log-probabilities (B, K, 2), answer token counts (B, K, 2)) of each packed answer's targets:
    the full-vocabulary softmax of the model's logits, in float32 (as TRL's scoring)."""
    logits, _ = model.forward(params, batch["inputs"], batch["positions"], cfg=cfg.model,
                              segment_ids=batch["segment_ids"])  # fmt: skip
    logp = layers.log_softmax(logits.astype(jnp.float32), cfg.model)
    target = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]  # (B, T)
    b, k = batch["pairs"].shape
    answer = batch["answer"]
    ids = jnp.where(answer >= 0, answer + 2 * k * jnp.arange(b)[:, None], 2 * k * b)  # padding: one bin past
    sums = jax.ops.segment_sum(target.reshape(-1), ids.reshape(-1), num_segments=2 * k * b + 1)[:-1]
    counts = jax.ops.segment_sum(jnp.ones_like(target).reshape(-1), ids.reshape(-1), num_segments=2 * k * b + 1)[:-1]
    return sums.reshape(b, k, 2), counts.reshape(b, k, 2)


def _smoothed(delta, p: PreferenceConfig):
    return -(1 - p.label_smoothing) * jax.nn.log_sigmoid(p.beta * delta) - p.label_smoothing * jax.nn.log_sigmoid(
        -p.beta * delta
    )


def _dpo(logp, ref, count, p: PreferenceConfig):
    ratio = logp - ref
    return _smoothed(ratio[:, 0] - ratio[:, 1], p), p.beta * ratio


def _ipo(logp, ref, count, p: PreferenceConfig):
    ratio = (logp - ref) / jnp.maximum(count, 1.0)
    return (ratio[:, 0] - ratio[:, 1] - 1 / (2 * p.beta)) ** 2, p.beta * (logp - ref)


def _simpo(logp, ref, count, p: PreferenceConfig):
    mean = logp / jnp.maximum(count, 1.0)
    return _smoothed(mean[:, 0] - mean[:, 1] - p.simpo_gamma / p.beta, p), p.beta * mean


# training.objective -> (policy log-probs (P, 2), reference's (P, 2), answer token counts (P, 2), settings)
#   -> (loss per pair (P,), rewards (P, 2)); the config's allowed objectives are "sft" and these keys
OBJECTIVES: dict[str, Callable] = {"dpo": _dpo, "ipo": _ipo, "simpo": _simpo}


def preference_loss(params, batch: dict, cfg: Config):
    """(mean loss over the batch's pairs, metrics): see the module's docstring."""
    logp, count = (x.reshape(-1, 2) for x in sequence_logps(params, batch, cfg))  # (B K, 2)
    ref = jax.lax.stop_gradient(batch["reference"].astype(jnp.float32).reshape(-1, 2))
    held = batch["pairs"].astype(jnp.float32).reshape(-1)  # (B K,): the slots that hold a pair
    losses, rewards = OBJECTIVES[cfg.training.objective](logp, ref, count, cfg.preference)
    rewards = jax.lax.stop_gradient(rewards)
    pairs = jnp.maximum(jnp.sum(held), 1.0)

    def mean(x):  # over the pairs held
        return jnp.sum(jnp.where(held > 0, x, 0.0)) / pairs

    metrics = {
        "rewards_chosen": mean(rewards[:, 0]),
        "rewards_rejected": mean(rewards[:, 1]),
        "margin": mean(rewards[:, 0] - rewards[:, 1]),
        "accuracy": mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
        "pairs": jnp.sum(held),
        "tokens": jnp.sum(count),
    }
    return mean(losses), metrics


def preference_step(state, batch: dict, base: dict | None = None, *, cfg: Config, tx: optax.GradientTransformation):
    """One optimizer step on the batch's pairs (training.step.train_step's contract; base: LoRA's frozen
    weights, `state.params` then the adapters)."""

    def objective(params):
        return preference_loss(params if base is None else lora.attach(base, params), batch, cfg)

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    state, grad_norm, finite = apply_grads(state, grads, loss, tx)
    lr = lr_schedule(cfg.optimizer, cfg.training.steps)(state.step - 1)
    return state, metrics | {"loss": loss, "grad_norm": grad_norm, "finite": finite, "lr": lr}


def preference_eval(params, batch: dict, base: dict | None = None, *, cfg: Config):
    """(loss summed over the batch's pairs, pairs, correctly ranked pairs): held-out evaluation."""
    loss, metrics = preference_loss(params if base is None else lora.attach(base, params), batch, cfg)
    pairs = metrics["pairs"]
    return loss * pairs, pairs, metrics["accuracy"] * pairs
