"""Log-probabilities of known tokens: `score()`, prompt log-probabilities, and evaluation harnesses.

    scores = score_tokens(params, tokens, positions, targets, cfg=cfg, top=5)
    scores.logprobs[b, t]       log p(targets[b, t] | tokens[b, :t + 1])
    scores.top_ids[b, t, :]     the `top` most likely next tokens there, most likely first

The head runs over `BLOCK` positions at a time (a `lax.map` over blocks), so a long prompt never holds a
(T, V) array of logits: with a 50k vocabulary a 2048-token prompt would be 400 MB of float32 at once;
here it is (B, BLOCK, V). The serving engine scores each prefill chunk the same way (`score_hidden`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import prefill

BLOCK = 128  # positions per head call


@flax.struct.dataclass
class TokenScores:
    """What the model thought of each known next token."""

    logprobs: jax.Array  # (B, T) float32, log-probability of the target at each position
    top_ids: jax.Array  # (B, T, A) int32, the A most likely tokens, most likely first (A >= 1)
    top_logprobs: jax.Array  # (B, T, A) float32

    @property
    def greedy(self) -> jax.Array:
        """(B, T) bool: the target is a most likely token (ties count as greedy)."""
        return self.logprobs >= self.top_logprobs[..., 0]


def score_hidden(params, x_btd, targets_bt, cfg: ModelConfig, top: int = 1) -> TokenScores:
    """Scores of `targets` from final hidden states (B, T, D), BLOCK positions at a time."""
    b, t, d = x_btd.shape
    # the most likely token always comes back (harnesses ask whether the target was it); at most V
    a = min(max(top, 1), cfg.vocab_size)
    blocks = -(-t // BLOCK)
    pad = blocks * BLOCK - t
    x = jnp.pad(x_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, blocks, BLOCK, d).swapaxes(0, 1)
    y = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, blocks, BLOCK).swapaxes(0, 1)

    def one_block(xy):
        x_block, y_block = xy  # (B, BLOCK, D), (B, BLOCK)
        logp = jax.nn.log_softmax(model.lm_head(params, x_block, cfg), axis=-1)  # (B, BLOCK, V)
        picked = jnp.take_along_axis(logp, y_block[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(logp, a)
        return picked, top_ids.astype(jnp.int32), top_lp

    picked, top_ids, top_lp = jax.lax.map(one_block, (x, y))  # (blocks, B, BLOCK, ...)

    def unblock(z):
        return z.swapaxes(0, 1).reshape(b, blocks * BLOCK, *z.shape[3:])[:, :t]

    return TokenScores(unblock(picked), unblock(top_ids), unblock(top_lp))


def score_tokens(params, tokens, positions, targets, *, cfg: ModelConfig, top: int = 1) -> TokenScores:
    """Scores of `targets` (B, T) after `tokens` (B, T) at `positions` (B, T), padding at -1 (its scores
    are meaningless: mask them). Usually targets are the tokens shifted left by one."""
    x, _ = model.hidden_states(params, tokens, positions, cfg=cfg)
    return score_hidden(params, x, targets, cfg, top)


def prompt_entries(logprobs, top_ids, top_logprobs, n: int) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """A prompt's log-probabilities as the APIs return them, from its scores at positions 0 .. L-2 (each
    predicting the next prompt token): per prompt token, its log-probability and its top-`n`
    alternatives {id: logprob}; None for the first token, which nothing predicts."""
    lps = [None, *map(float, logprobs)]
    ids, alt = top_ids[:, :n].tolist(), top_logprobs[:, :n].tolist()
    tops = [None, *(dict(zip(i, a, strict=True)) for i, a in zip(ids, alt, strict=True))]
    return lps, tops


def score_after_prompts(
    params, tokens, positions, lengths, rows, cont_tokens, cont_positions, cont_targets, *, cfg: ModelConfig,
    cache_len: int, cache_dtype: str,
):  # fmt: skip
    """Continuations scored after shared prompts: each prompt runs once into a KV cache, and each row's
    continuation reads its prompt's cache (multiple-choice questions: one context, several endings).

    tokens, positions: (P, T) padded prompts; lengths: (P,); rows: (B,) the prompt of each row.
    cont_tokens, cont_positions, cont_targets: (B, C) each row's continuation, at the positions after its
    prompt (-1 on padding), and the next token of each (for j < L - 1 of a continuation of L tokens).
    Returns (first (B,): log-probability of each continuation's first token, from its prompt's last
    position; first_greedy (B,); TokenScores (B, C) of the rest, top 1).
    """
    cache, last = prefill(params, tokens, positions, rows, lengths, cfg, cache_len, cache_dtype)
    logp = jax.nn.log_softmax(last, axis=-1)  # (B, V)
    first = jnp.take_along_axis(logp, cont_tokens[:, :1], axis=-1)[:, 0]
    x, _ = model.hidden_states(params, cont_tokens, cont_positions, cache, cfg=cfg)
    return first, first >= logp.max(axis=-1), score_hidden(params, x, cont_targets, cfg, top=1)
