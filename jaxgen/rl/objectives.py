"""Policy-gradient objectives over sampled completions: advantages, the clipped GRPO loss, REINFORCE.

    adv = advantages(rewards_pn, settings)                    # (P, n) -> (B,), the algorithm's rule
    logp, entropy = token_logprobs(params, tokens, positions, cfg=cfg, temperature=t)   # (B, T-1) each
    loss, metrics = policy_loss(logp, old_logp, adv.reshape(-1), mask, settings, ref_logp=ref)

The sampler's log-probabilities (`old_logp`) may come from an older policy (`rl.max_staleness`) or differ
from the trainer's in their last bits. `settings.correction` says how the loss corrects for it, with the
importance weight rho = pi_trainer / pi_sampler of each token (the trainer's current params, no gradient):
"tis" (truncated importance sampling) weighs each token's loss by min(rho, is_cap); "mask" drops the tokens
whose rho leaves [1 / is_cap, is_cap]; both take the algorithm's ratio against the current policy itself
(1, with the gradient of logp: one update a batch, so the current params are the proximal policy). "none"
is the plain ratio pi / pi_sampler, clipped by the algorithm (PPO's own correction, two-sided).

Shapes: B = P * n rows (P prompts, n samples each, a prompt's samples adjacent); T tokens of prompt and
completion, left-aligned with padding at the end; every per-token array is over the T - 1 *predicted*
tokens (column t is token t + 1 given tokens 0..t), and `mask` (B, T - 1) is 1 on completion tokens only.

All functions are pure and jit-able; `settings` (an `RLSettings`) is static. The algorithms and the ways of
averaging are tables (`ALGORITHMS`, `AVERAGING`) whose keys are the names rl.algorithm and rl.averaging allow:
a new objective is one `Algorithm` record here and its name in `jaxgen.config.rl` (docs/architecture.md,
Extending jaxgen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.model import forward, layers


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The loss's knobs (the `rl` config section holds the same names)."""

    algorithm: str = "grpo"  # grpo: clipped ratio and group-relative advantages; reinforce: ratio unclipped
    clip_eps: float = 0.2  # the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (grpo)
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (0: none, no reference scored)
    averaging: str = "token"  # token: every completion token weighs the same; sequence: every completion
    normalize: bool = True  # divide a group's advantages by its reward spread (GRPO); False: Dr. GRPO
    correction: str = "none"  # the sampler/trainer mismatch: none, tis or mask (see the module's docstring)
    is_cap: float = 2.0  # tis: the weight's cap; mask: tokens with a weight outside [1 / is_cap, is_cap] drop


def group_advantages(rewards_pn, normalize: bool = True, eps: float = 1e-6):
    """(P, n) rewards -> (P, n) advantages: each reward minus its prompt's mean over the n samples, divided
    by their standard deviation + eps when `normalize`. A group whose samples all score alike gets zeros."""
    rewards = rewards_pn.astype(jnp.float32)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if not normalize:
        return centred
    return centred / (rewards.std(axis=1, keepdims=True) + eps)


def batch_advantages(rewards_b):
    """REINFORCE with a baseline: (B,) rewards minus their batch mean."""
    rewards = rewards_b.astype(jnp.float32)
    return rewards - rewards.mean()


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One policy-gradient objective: how rewards become advantages, and the loss of each token.

    advantages(rewards_pn, settings) -> (B,) float32, one per completion (rows in prompt-major order);
    token_loss(ratio_bt, adv_b1, settings) -> (per-token loss (B, T-1), clipped (B, T-1) bool or None)."""

    advantages: Callable
    token_loss: Callable


def _clipped_loss(ratio, adv, settings: RLSettings):
    """-min(r A, clip(r, 1 - eps, 1 + eps) A), and where the ratio left the clip range."""
    clipped = jnp.clip(ratio, 1.0 - settings.clip_eps, 1.0 + settings.clip_eps)
    return -jnp.minimum(ratio * adv, clipped * adv), jnp.abs(ratio - 1.0) > settings.clip_eps


def _plain_loss(ratio, adv, settings: RLSettings):
    """-r A, whose gradient at r = 1 is -A grad logp; nothing is clipped."""
    return -ratio * adv, None


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(lambda r, s: group_advantages(r, s.normalize).reshape(-1), _clipped_loss),
    "reinforce": Algorithm(lambda r, s: batch_advantages(r.reshape(-1)), _plain_loss),
}


def advantages(rewards_pn, settings: RLSettings):
    """(P, n) rewards -> (B,) advantages by settings.algorithm's rule (B = P * n, a prompt's samples adjacent)."""
    return ALGORITHMS[settings.algorithm].advantages(rewards_pn, settings)


def token_logprobs(params, tokens_bt, positions_bt, *, cfg: ModelConfig, temperature: float = 1.0):
    """The training forward's view of sampled sequences: each token's log-probability under the
    temperature-scaled policy given the tokens before it, and that distribution's entropy.

    tokens, positions: (B, T) int32 (position -1 marks padding). Returns (logp, entropy), each (B, T - 1)
    float32: column t scores token t + 1. `temperature` must match the sampler's for the two to agree."""
    logits, _ = forward(params, tokens_bt[:, :-1], positions_bt[:, :-1], cfg=cfg)
    logp_all = layers.log_softmax(logits.astype(jnp.float32) / temperature, cfg)  # (deterministic: per row tile)
    logp = jnp.take_along_axis(logp_all, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _token_mean(x_bt, mask_bt):
    """Every completion token weighs the same."""
    mask = mask_bt.astype(jnp.float32)
    return jnp.sum(x_bt * mask) / jnp.maximum(mask.sum(), 1.0)


def _sequence_mean(x_bt, mask_bt):
    """Every completion weighs the same (the mean of its tokens); rows without completion tokens do not count."""
    mask = mask_bt.astype(jnp.float32)
    per_row = jnp.sum(x_bt * mask, axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    rows = (mask.sum(axis=1) > 0).astype(jnp.float32)
    return jnp.sum(per_row * rows) / jnp.maximum(rows.sum(), 1.0)


# rl.averaging -> the masked mean of per-token values over (B, T-1)
AVERAGING: dict[str, Callable] = {"token": _token_mean, "sequence": _sequence_mean}


def policy_loss(logp_bt, old_logp_bt, advantages_b, mask_bt, settings: RLSettings, ref_logp_bt=None):
    """The surrogate loss to minimise and its metrics.

    logp: (B, T-1) the policy's log-probabilities (differentiated); old_logp: the sampler's (constants);
    advantages: (B,) one per completion, spread over its tokens; mask: (B, T-1) completion tokens;
    ref_logp: (B, T-1) the frozen reference's, needed when settings.kl_coef > 0.

    Per token: the algorithm's loss of r and A (`ALGORITHMS`: -min(r A, clip(r, 1 - eps, 1 + eps) A) for grpo,
    -r A for reinforce), r = exp(logp - old_logp) (correction "none") or 1 with logp's gradient, weighted by
    the correction (module docstring); plus kl_coef times the k3 estimate of KL(policy || reference),
    exp(ref - logp) - (ref - logp) - 1, which is >= 0 and unbiased; averaged as settings.averaging says.
    Metrics: ratio (mean rho), ratio_max, and corrected (the share of tokens truncated or dropped)."""
    old = jax.lax.stop_gradient(old_logp_bt)
    rho = jnp.exp(jax.lax.stop_gradient(logp_bt) - old)  # the importance weight, sampler -> trainer
    adv = advantages_b.astype(jnp.float32)[:, None]
    cap = settings.is_cap
    if settings.correction == "none":
        ratio, weight, corrected = jnp.exp(logp_bt - old), None, jnp.zeros_like(rho, bool)
    else:
        ratio = jnp.exp(logp_bt - jax.lax.stop_gradient(logp_bt))
        if settings.correction == "tis":
            weight, corrected = jnp.minimum(rho, cap), rho > cap
        else:
            corrected = (rho > cap) | (rho < 1.0 / cap)
            weight = jnp.where(corrected, 0.0, 1.0)
    per_token, clipped = ALGORITHMS[settings.algorithm].token_loss(ratio, adv, settings)
    if weight is not None:
        per_token = per_token * weight
    clip_frac = jnp.zeros(()) if clipped is None else _token_mean(clipped.astype(jnp.float32), mask_bt)
    metrics = {
        "ratio": _token_mean(rho, mask_bt), "ratio_max": jnp.max(jnp.where(mask_bt > 0, rho, 0.0)),
        "corrected": _token_mean(corrected.astype(jnp.float32), mask_bt), "clip_frac": clip_frac,
    }  # fmt: skip
    if settings.kl_coef:
        diff = jax.lax.stop_gradient(ref_logp_bt) - logp_bt
        kl = jnp.exp(diff) - diff - 1.0
        per_token = per_token + settings.kl_coef * kl
        metrics["kl"] = _token_mean(kl, mask_bt)
    loss = AVERAGING[settings.averaging](per_token, mask_bt)
    return loss, metrics


def settings_of(cfg) -> RLSettings:
    """The loss's settings of a `jaxgen.config.Config`'s rl section (rl.correction "auto": none at
    rl.max_staleness 0, tis above)."""
    r = cfg.rl
    correction = r.correction if r.correction != "auto" else ("tis" if r.max_staleness else "none")
    return RLSettings(r.algorithm, r.clip_eps, r.kl_coef, r.averaging, r.normalize, correction, r.is_cap)
