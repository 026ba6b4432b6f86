"""Log-probabilities of known tokens: `score()`, prompt log-probabilities, and evaluation harnesses.
The jitted functions are below; `Scorer` is their host side (pairs checked, batches bucketed), which
`Generator.score`, `score_shared` and prompt log-probabilities call.

    scores = score_tokens(params, tokens, positions, targets, cfg=cfg, top=5)
    scores.logprobs[b, t]       log p(targets[b, t] | tokens[b, :t + 1])
    scores.top_ids[b, t, :]     the `top` most likely next tokens there, most likely first

The head runs over `BLOCK` positions at a time (a `lax.map` over blocks), so a long prompt never holds a
(T, V) array of logits: with a 50k vocabulary a 2048-token prompt would be 400 MB of float32 at once;
here it is (B, BLOCK, V). The serving engine scores each prefill chunk the same way (`score_hidden`).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import bucket, padded, prefill
from jaxgen.inference.sampling import MAX_LOGPROBS, SamplingError, check_prompt
from jaxgen.tokenizer import Tokenizer

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


class Scorer:
    """Scoring's host side for a Generator: token ids checked before any compilation, sequences batched
    `max_batch` at a time with bucketed lengths, the jitted programs made once by `jit(fn, static_names)`
    (the Generator's: counted, on its mesh). The params come with each call."""

    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer, max_batch: int, cache_dtype: str, jit: Callable):
        self.cfg, self.tokenizer, self.max_batch, self.cache_dtype = cfg, tokenizer, max_batch, cache_dtype
        self._score = jit(score_tokens, ("cfg", "top"))
        self._score_after = jit(score_after_prompts, ("cfg", "cache_len", "cache_dtype"))

    def score(self, params, prompts, continuations) -> list[dict]:
        """`Generator.score`: per pair, the dict of `score_dict`."""
        pairs = self.pairs(prompts, continuations)
        out = []
        for (p, _c), (lp, greedy, _, _) in zip(
            pairs, self.token_scores(params, [p + c for p, c in pairs], top=1), strict=True
        ):
            out.append(score_dict(lp[len(p) - 1 :].tolist(), bool(greedy[len(p) - 1 :].all())))
        return out

    def score_shared(self, params, prompts, continuations) -> list[dict]:
        """`Generator.score_shared`: each distinct prompt run once, its continuations reading its KV cache;
        pairs batched `max_batch` at a time, sorted by length (the results in the order given)."""
        pairs = self.pairs(prompts, continuations)
        order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), pairs[i][0], len(pairs[i][1])))
        out: list[dict | None] = [None] * len(pairs)
        for start in range(0, len(order), self.max_batch):
            idx = order[start : start + self.max_batch]
            for i, result in zip(idx, self._shared_batch(params, [pairs[i] for i in idx]), strict=True):
                out[i] = result
        return out

    def _shared_batch(self, params, pairs) -> list[dict]:
        unique = list(dict.fromkeys(tuple(p) for p, _ in pairs))
        where = {p: i for i, p in enumerate(unique)}
        p_count, b = bucket(len(unique), minimum=1), bucket(len(pairs), minimum=1)
        t, c = bucket(max(len(p) for p in unique)), bucket(max(len(q) for _, q in pairs))
        tokens, positions, lengths = padded(unique, p_count, t)
        rows = np.zeros((b,), np.int32)
        cont = np.zeros((b, c), np.int32)
        cont_pos = np.full((b, c), -1, np.int32)
        for r, (p, q) in enumerate(pairs):
            rows[r] = where[tuple(p)]
            cont[r, : len(q)], cont_pos[r, : len(q)] = q, np.arange(len(p), len(p) + len(q))
        targets = np.roll(cont, -1, axis=1)
        first, first_greedy, rest = jax.device_get(
            self._score_after(params, tokens, positions, lengths, rows, cont, cont_pos, targets, cfg=self.cfg,
                              cache_len=bucket(t + c), cache_dtype=self.cache_dtype)
        )  # fmt: skip
        out = []
        for r, (_, q) in enumerate(pairs):
            token_lp = [float(first[r]), *rest.logprobs[r, : len(q) - 1].tolist()]
            greedy = bool(first_greedy[r]) and bool(rest.greedy[r, : len(q) - 1].all())
            out.append(score_dict(token_lp, greedy))
        return out

    def pairs(self, prompts, continuations) -> list[tuple[list[int], list[int]]]:
        """Token ids of each (prompt, continuation) pair, checked before any compilation (`token_pairs`)."""
        return token_pairs(self.tokenizer, self.cfg, prompts, continuations)

    def token_scores(self, params, seqs: list[list[int]], top: int):
        """Per sequence of L tokens: (logprobs (L-1,), greedy (L-1,), top ids and logprobs (L-1, top)),
        position i scoring token i + 1; `max_batch` sequences at a time, lengths bucketed. (`top` is static:
        score() asks 1, prompt log-probabilities MAX_LOGPROBS, whatever a request asks, so neither recompiles.)"""
        out = []
        for start in range(0, len(seqs), self.max_batch):
            batch = seqs[start : start + self.max_batch]
            b, t = bucket(len(batch), minimum=1), bucket(max(len(q) for q in batch))
            tokens, positions, _ = padded(batch, b, t)
            targets = np.roll(tokens, -1, axis=1)
            s = jax.device_get(self._score(params, tokens, positions, targets, cfg=self.cfg, top=top))
            for i, q in enumerate(batch):
                n = len(q) - 1
                out.append((s.logprobs[i, :n], s.greedy[i, :n], s.top_ids[i, :n], s.top_logprobs[i, :n]))
        return out

    def prompt_scores(self, params, ids, configs, prompt_idx) -> dict[int, tuple]:
        """(prompt_logprobs, prompt_top_logprobs) of each prompt in `prompt_idx`; (None, None) for those
        whose settings ask none."""
        wanted = [p for p in prompt_idx if configs[p].prompt_logprobs is not None]
        out = {p: (None, None) for p in prompt_idx}
        for p, (lp, _, top_ids, top_lp) in zip(
            wanted, self.token_scores(params, [ids[p] for p in wanted], top=MAX_LOGPROBS), strict=True
        ):
            out[p] = prompt_entries(lp, top_ids, top_lp, configs[p].prompt_logprobs)
        return out


def token_pairs(tokenizer: Tokenizer, cfg: ModelConfig, prompts, continuations) -> list[tuple[list[int], list[int]]]:
    """Token ids of each (prompt, continuation) pair (text or ids), checked against `cfg`: SamplingError naming
    the pair for an empty side, too long a pair, or an id outside the vocabulary."""
    if len(prompts) != len(continuations):
        raise SamplingError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    pairs = []
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        pi = tokenizer.encode(p) if isinstance(p, str) else list(p)
        ci = tokenizer.encode(c, special=False) if isinstance(c, str) else list(c)
        if not pi or not ci:
            raise SamplingError(f"pair {i}: prompt and continuation must each have at least one token")
        if len(pi) + len(ci) > cfg.max_seq_len:
            raise SamplingError(f"pair {i} has {len(pi) + len(ci)} tokens; the context is {cfg.max_seq_len}")
        # ids outside the vocabulary would index past the embedding (NaN log-likelihoods)
        check_prompt(pi + ci, cfg.vocab_size, cfg.max_seq_len + 1, f"pair {i}")
        pairs.append((pi, ci))
    return pairs


def score_dict(token_lp: list[float], greedy: bool) -> dict:
    """What `score` returns for one continuation, from its tokens' log-probabilities: {'logprob': sum,
    'tokens': count, 'nll': mean negative log-likelihood per token, 'perplexity': exp(nll),
    'token_logprobs': [...], 'greedy': whether every token is the model's most likely one}."""
    nll = -sum(token_lp) / len(token_lp)
    return {
        "logprob": sum(token_lp), "tokens": len(token_lp), "nll": nll, "perplexity": float(np.exp(min(nll, 50.0))),
        "token_logprobs": token_lp, "greedy": greedy,
    }  # fmt: skip
