"""Per-request sampling settings and the pure, batched sampling function.

Every setting is a per-sequence array inside the jitted code, so changing a temperature or a seed
never recompiles. Order of processing for each row (as in Hugging Face and vLLM):
    logit bias -> repetition / presence / frequency penalties -> temperature ->
    top-k, top-p and min-p truncation (on the tempered distribution) -> renormalise -> draw.
Temperature 0 is greedy. Each row draws with its own key, `fold_in(key(seed), step)`, so its samples do
not depend on its batch-mates or the batch size.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """A sampling setting outside what is allowed."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """One request's decoding settings."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; divides positive logits of tokens seen (prompt included)
    presence_penalty: float = 0.0  # subtracted once from tokens generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: int = 0
    n: int = 1  # samples per prompt (they share one prefill)
    stop: tuple[str, ...] = ()  # stop strings (the output ends before them)
    stop_token_ids: tuple[int, ...] = ()  # extra end-of-sequence ids
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()  # generation ends after any of these
    ignore_eos: bool = False
    logprobs: int = 0  # top-N alternatives per token to return (0 = only the chosen token's)

    def __post_init__(self):
        checks = [
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature, self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_k", self.top_k, self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "a number > 0"),
            ("n", self.n, self.n >= 1, "an integer >= 1"),
            ("logprobs", self.logprobs, 0 <= self.logprobs <= 20, "an integer in [0, 20]"),
            ("stop_token_sequences", self.stop_token_sequences, all(self.stop_token_sequences), "non-empty sequences"),
        ]
        for name, value, ok, allowed in checks:
            if isinstance(value, bool) or not ok:
                raise SamplingError(f"{name}={value!r} is not allowed: {allowed}")

    @classmethod
    def from_dict(cls, data: dict) -> SamplingConfig:
        """From JSON-like data (lists for tuples, {id: bias} for logit_bias); unknown fields are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise SamplingError(f"unknown sampling field {unknown[0]!r}; allowed: {', '.join(fields)}")
        kwargs = {}
        for k, v in data.items():
            if k == "logit_bias":
                v = tuple((int(t), float(b)) for t, b in (v.items() if isinstance(v, dict) else v))
            elif k in ("stop", "stop_token_ids"):
                v = (v,) if isinstance(v, str | int) else tuple(v)
            elif k == "stop_token_sequences":
                v = tuple(tuple(int(t) for t in q) for q in v)
            kwargs[k] = _typed(k, v, fields[k].type)
        return cls(**kwargs)


def _typed(name, value, tp):
    kind = {"int": int, "float": float, "bool": bool}.get(tp if isinstance(tp, str) else getattr(tp, "__name__", ""))
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    if kind is None:
        return value
    raise SamplingError(f"{name}={value!r} is not allowed: expected {kind.__name__}")


@flax.struct.dataclass
class SamplingArrays:
    """The batch's settings as (B,) arrays (and (B, V) for the logit bias)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    logit_bias: jax.Array  # (B, V)
    seed: jax.Array  # (B,) uint32

    @classmethod
    def stack(cls, configs: list[SamplingConfig], vocab_size: int) -> SamplingArrays:
        bias = np.zeros((len(configs), vocab_size), np.float32)
        for i, c in enumerate(configs):
            for tok, b in c.logit_bias:
                bias[i, tok] += b

        def col(name, dtype):
            return np.asarray([getattr(c, name) for c in configs], dtype)

        return cls(
            temperature=col("temperature", np.float32), top_k=col("top_k", np.int32), top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32), repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32), logit_bias=bias,
            seed=np.asarray([c.seed % 2**32 for c in configs], np.uint32),
        )  # fmt: skip


def process_logits(logits_bv, sp: SamplingArrays, seen_bv, counts_bv):
    """Bias and penalties. seen: tokens in prompt or output (bool); counts: occurrences in the output."""
    logits = logits_bv + sp.logit_bias
    rp = sp.repetition_penalty[:, None]
    logits = jnp.where(seen_bv, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    counts = counts_bv.astype(jnp.float32)
    return logits - sp.presence_penalty[:, None] * (counts > 0) - sp.frequency_penalty[:, None] * counts


def truncated_logits(logits_bv, sp: SamplingArrays):
    """Tempered logits with everything outside top-k / top-p / min-p set to -inf (sorted order).

    Returns (sorted_logits (B, V), sorted_ids (B, V)).
    """
    temp = jnp.maximum(sp.temperature, 1e-6)[:, None]
    scaled = logits_bv / temp
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(scaled.shape[-1])[None]
    keep = (sp.top_k[:, None] == 0) | (rank < sp.top_k[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    keep &= before < sp.top_p[:, None]
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return jnp.where(keep, sorted_logits, -jnp.inf), order


def sample(logits_bv, sp: SamplingArrays, step, seen_bv, counts_bv):
    """Next token per row: (B,) int32. Greedy rows (temperature 0) take the processed argmax.

    step: () or (B,) int32, the index of the token being drawn; with the row's seed it keys the draw,
    so a request's samples do not depend on its batch or on when it started.
    """
    logits = process_logits(logits_bv, sp, seen_bv, counts_bv)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        masked, order = truncated_logits(logits, sp)
        steps = jnp.broadcast_to(step, sp.seed.shape)  # one step for all rows, or each row's own
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(sp.seed, steps)
        choice = jax.vmap(jax.random.categorical)(keys, masked)
        drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        return jnp.where(sp.temperature == 0, greedy, drawn).astype(jnp.int32)

    # An all-greedy batch skips the sort over the vocabulary (a value-dependent branch: no recompile).
    return jax.lax.cond(jnp.all(sp.temperature == 0), lambda _: greedy, draw, None)
