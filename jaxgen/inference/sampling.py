"""Per-request sampling settings and the pure, batched sampling function.

Every setting is a per-sequence array inside the jitted code, so changing a temperature or a seed
never recompiles. Order of processing for each row (as in Hugging Face and vLLM):
    logit bias -> repetition / presence / frequency penalties -> temperature ->
    top-k, top-p and min-p truncation (on the tempered distribution) -> renormalise -> draw.
Temperature 0 is greedy. Each row draws with its own key, `fold_in(key(seed), step)`, so its samples do
not depend on its batch-mates or the batch size. `logprobs_mode="processed"` reports log-probabilities
of the distribution before truncation (`policy_logits`), "raw" (the default) the model's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.inference.errors import SamplingError, shown
from jaxgen.model.layers import per_tile

if TYPE_CHECKING:
    from jaxgen.inference.structured.spec import Structured

INT32_MAX = 2**31 - 1  # every count and token id ends up in an int32 device array
MAX_N = 128  # samples per prompt
MAX_LOGPROBS = 20  # top alternatives per token (as OpenAI's API)
MAX_SPECULATIVE = 8  # draft tokens per target step (the Generator's window W: 2, 4 or 8)
MAX_TEMPERATURE = 1e4
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_SEQUENCE = 8  # tokens in one stop token sequence (the decode loop's window)
LOGPROBS_MODES = ("raw", "processed")  # SamplingConfig.logprobs_mode


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise SamplingError(f"{field}={shown(value)} is not allowed: {allowed}", field)


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def check_text(field: str, text: str) -> None:
    """Text must be valid Unicode (a lone surrogate such as "\\udc80" cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SamplingError(
            f"{field} has an invalid character {text[e.start]!r} at index {e.start}: text must be valid Unicode "
            "(a lone surrogate cannot be encoded)",
            field,
        ) from None


def check_prompt(ids, vocab_size: int, max_seq_len: int, field: str = "prompt") -> list[int]:
    """Token ids of a prompt the model can run: non-empty, in [0, vocab_size), shorter than the context."""
    subject = "the prompt" if field == "prompt" else field
    if len(ids) == 0:
        raise SamplingError(f"{subject} is empty: at least one token is needed", field)
    if len(ids) >= max_seq_len:
        raise SamplingError(
            f"{subject} has {len(ids)} tokens; the model's context is {max_seq_len} tokens "
            "(prompt + at least one new token)",
            field,
        )
    bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise SamplingError(f"{subject} has token ids outside [0, {vocab_size}): {shown(bad[:5])}", field)
    return [int(t) for t in ids]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """One request's decoding settings."""

    max_new_tokens: int = 64  # 0: the prompt only (with prompt_logprobs, to score it)
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
    prompt_logprobs: int | None = None  # per prompt token: its logprob and top-N alternatives (None = off)
    # draft tokens checked per target step by n-gram lookup (Generator; 0 = off): the output is unchanged
    num_speculative_tokens: int = 0
    # what the output must be: a JSON schema, a regex, a choice or a grammar (jaxgen.inference.structured)
    structured: Structured | None = None
    # which distribution `logprobs` (and the alternatives) are taken from: "raw", the model's; "processed",
    # the one the token was drawn from before truncation (constraint, bias, penalties, then temperature;
    # top-k / top-p / min-p not applied): the policy's log-probabilities for reinforcement learning
    logprobs_mode: str = "raw"

    def __post_init__(self):
        """Bounds that hold for every model; `check_for_model` adds those that need the vocabulary."""
        for name in ("stop", "stop_token_ids", "stop_token_sequences", "logit_bias"):  # lists given: tuples kept
            value = getattr(self, name)
            if isinstance(value, list):
                inner = tuple if name in ("stop_token_sequences", "logit_bias") else lambda x: x
                value = tuple(inner(x) if isinstance(x, list) else x for x in value)
                object.__setattr__(self, name, value)
        ints = [
            ("max_new_tokens", self.max_new_tokens, 0, INT32_MAX),
            ("top_k", self.top_k, 0, INT32_MAX),
            ("n", self.n, 1, MAX_N),
            ("logprobs", self.logprobs, 0, MAX_LOGPROBS),
            ("seed", self.seed, -(2**63), 2**64 - 1),
            ("num_speculative_tokens", self.num_speculative_tokens, 0, MAX_SPECULATIVE),
        ]
        if self.prompt_logprobs is not None:
            ints.append(("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS))
        for name, value, lo, hi in ints:
            _require(_is_int(value) and lo <= value <= hi, name, value, f"an integer in [{lo}, {hi}]")
        floats = [
            (
                "temperature",
                self.temperature,
                lambda x: 0 <= x <= MAX_TEMPERATURE,
                f"[0, {MAX_TEMPERATURE}] (0 = greedy)",
            ),
            ("top_p", self.top_p, lambda x: 0 < x <= 1, "(0, 1]"),
            ("min_p", self.min_p, lambda x: 0 <= x <= 1, "[0, 1]"),
            ("repetition_penalty", self.repetition_penalty, lambda x: 0 < x <= 100, "(0, 100]"),
            ("presence_penalty", self.presence_penalty, lambda x: -2 <= x <= 2, "[-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, lambda x: -2 <= x <= 2, "[-2, 2]"),
        ]
        for name, value, ok, allowed in floats:
            _require(_is_real(value) and math.isfinite(value) and ok(value), name, value, f"a number in {allowed}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "true or false")
        _require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode, "'raw' or 'processed'")
        if self.logprobs_mode == "processed" and self.num_speculative_tokens:
            raise SamplingError("logprobs_mode='processed' cannot be combined with num_speculative_tokens > 0 "
                                "(drafts are scored on the model's distribution)", "logprobs_mode")  # fmt: skip
        self._check_lists()
        self._check_structured()

    def _check_lists(self) -> None:
        bias = self.logit_bias
        ok = isinstance(bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in bias)
        _require(ok, "logit_bias", bias, "(token id, bias) pairs")
        for tok, b in bias:
            _require(
                _is_int(tok) and 0 <= tok <= INT32_MAX, "logit_bias", tok, f"token ids in [0, {INT32_MAX}] as keys"
            )
            _require(_is_real(b) and -1e6 <= b <= 1e6, "logit_bias", b, "finite biases in [-1e6, 1e6]")
        stop = self.stop
        ok = isinstance(stop, tuple) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(x, str) and x for x in stop)
        _require(ok, "stop", stop, f"at most {MAX_STOP_STRINGS} non-empty strings")
        for x in stop:
            _require(len(x) <= MAX_STOP_CHARS, "stop", x, f"stop strings of at most {MAX_STOP_CHARS} characters")
            check_text("stop", x)
        ids = self.stop_token_ids
        ok = isinstance(ids, tuple) and all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)
        _require(ok, "stop_token_ids", ids, f"token ids in [0, {INT32_MAX}]")
        seqs = self.stop_token_sequences
        ok = isinstance(seqs, tuple) and all(isinstance(q, tuple) and 0 < len(q) <= MAX_STOP_SEQUENCE for q in seqs)
        ok = ok and all(_is_int(t) and 0 <= t <= INT32_MAX for q in seqs for t in q)
        allowed = f"non-empty sequences of at most {MAX_STOP_SEQUENCE} token ids in [0, {INT32_MAX}]"
        _require(ok, "stop_token_sequences", seqs, allowed)

    def _check_structured(self) -> None:
        from jaxgen.inference.structured.spec import KINDS, Structured

        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", Structured.from_dict(self.structured))
        ok = self.structured is None or isinstance(self.structured, Structured)
        _require(ok, "structured", self.structured, f"a Structured ({', '.join(KINDS)}) or None")
        if self.structured is not None and self.ignore_eos:
            raise SamplingError("ignore_eos=true cannot be combined with structured: a constrained output ends "
                                "with the end-of-sequence token once it is complete", "ignore_eos")  # fmt: skip

    def check_for_model(self, vocab_size: int) -> None:
        """The bounds that depend on the model: token ids in [0, vocab_size), top_k <= vocab_size."""
        _require(self.top_k <= vocab_size, "top_k", self.top_k, f"an integer in [0, {vocab_size}] (the vocabulary)")
        for tok, _ in self.logit_bias:
            _require(tok < vocab_size, "logit_bias", tok, f"token ids in [0, {vocab_size}) as keys")
        for t in self.stop_token_ids:
            _require(t < vocab_size, "stop_token_ids", t, f"token ids in [0, {vocab_size})")
        for q in self.stop_token_sequences:
            _require(max(q) < vocab_size, "stop_token_sequences", q, f"token ids in [0, {vocab_size})")

    @classmethod
    def from_dict(cls, data: dict) -> SamplingConfig:
        """From JSON-like data (lists for tuples, {id: bias} for logit_bias); unknown fields are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise SamplingError(f"unknown sampling field {shown(unknown[0])}; allowed: {', '.join(fields)}", unknown[0])
        kwargs = {}
        for k, v in data.items():
            try:
                kwargs[k] = _typed(k, _from_json(k, v), fields[k].type)
            except (TypeError, ValueError, OverflowError, AttributeError) as e:
                if isinstance(e, SamplingError):
                    raise
                raise SamplingError(f"{k}={shown(v)} is not allowed: {e}", k) from None
        return cls(**kwargs)


def per_prompt(sampling: SamplingConfig | list[SamplingConfig], count: int) -> list[SamplingConfig]:
    """The settings of each of `count` prompts: `sampling` itself when it is a list (one per prompt), else
    it repeated; SamplingError when a list has another length."""
    configs = sampling if isinstance(sampling, list) else [sampling] * count
    if len(configs) != count:
        raise SamplingError(f"{count} prompts but {len(configs)} sampling configs")
    return configs


def _from_json(k: str, v):
    """JSON shapes to the config's: {id: bias} or pairs for logit_bias, lists for tuples."""
    if k == "logit_bias":
        pairs = v.items() if isinstance(v, dict) else v
        return tuple((_int_key(t), b if _is_real(b) else float(b)) for t, b in pairs)
    if k in ("stop", "stop_token_ids"):
        return (v,) if isinstance(v, str | int) else tuple(v)
    if k == "stop_token_sequences":
        return tuple(tuple(q) for q in v)
    if k == "structured" and v is not None:
        from jaxgen.inference.structured.spec import Structured

        return Structured.from_dict(v)
    return v


def _int_key(t) -> int:
    """A token id given as an int or as a decimal string (JSON object keys are strings)."""
    if _is_int(t):
        return int(t)
    if isinstance(t, str) and t.strip().lstrip("-").isdigit():
        return int(t)
    raise ValueError(f"token ids as keys, got {shown(t)}")


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
    raise SamplingError(f"{name}={shown(value)} is not allowed: expected {kind.__name__}", name)


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
    processed: jax.Array  # (B,) bool, logprobs_mode "processed": log-probabilities of `policy_logits`
    alternatives: jax.Array  # (B,) int32, top alternatives asked per token (SamplingConfig.logprobs)

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
            processed=np.asarray([c.logprobs_mode == "processed" for c in configs], bool),
            alternatives=col("logprobs", np.int32),
        )  # fmt: skip

    def any_penalty(self):
        """() bool: does some row ask for a repetition, presence or frequency penalty?"""
        rp, pp, fp = self.repetition_penalty, self.presence_penalty, self.frequency_penalty
        return jnp.any((rp != 1) | (pp != 0) | (fp != 0))

    def any_alternatives(self):
        """() bool: does some row ask for top alternatives (`SamplingConfig.logprobs` > 0)?"""
        return jnp.any(self.alternatives > 0)


def process_logits(logits_bv, sp: SamplingArrays, seen_bv, counts_bv):
    """Bias and penalties. seen: tokens in prompt or output (bool); counts: occurrences in the output.
    The penalties' pass over (B, V) runs only when some row asks for one (a value-dependent branch: the
    settings' values never recompile); without any, a row's logits are its biased logits either way."""
    logits = logits_bv + sp.logit_bias

    def penalties(logits):
        rp = sp.repetition_penalty[:, None]
        logits = jnp.where(seen_bv, jnp.where(logits > 0, logits / rp, logits * rp), logits)
        counts = counts_bv.astype(jnp.float32)
        return logits - sp.presence_penalty[:, None] * (counts > 0) - sp.frequency_penalty[:, None] * counts

    return jax.lax.cond(sp.any_penalty(), penalties, lambda x: x, logits)


def penalized(logits_bv, sp: SamplingArrays, seen_bv, counts_bv, allowed_bv=None):
    """(B, V) what a row draws from before temperature and truncation: the constraint's mask (`allowed_bv`
    (B, V) bool, None: every token), bias and penalties. `draw` takes it; so does `policy_from`, so a
    decode step computes it once."""
    if allowed_bv is not None:
        logits_bv = jnp.where(allowed_bv, logits_bv, -jnp.inf)
    return process_logits(logits_bv, sp, seen_bv, counts_bv)


def _temperature(sp: SamplingArrays):
    """(B, 1) what each row's logits are divided by before truncation (and the draw)."""
    return jnp.maximum(sp.temperature, 1e-6)[:, None]


def policy_logits(logits_bv, sp: SamplingArrays, seen_bv, counts_bv, allowed_bv=None):
    """(B, V) the logits whose log-softmax a row reports for its tokens: the model's (logprobs_mode "raw"),
    or for "processed" rows those `sample` draws from before truncation: the constraint's mask, bias and
    penalties, divided by the temperature (by 1 for a greedy row). Inputs as `sample`'s, before the draw."""
    return policy_from(logits_bv, penalized(logits_bv, sp, seen_bv, counts_bv, allowed_bv), sp)


def policy_from(logits_bv, penalized_bv, sp: SamplingArrays):
    """`policy_logits` from the model's logits and their `penalized` ones (B, V)."""
    processed = jnp.where(sp.temperature[:, None] == 0, penalized_bv, penalized_bv / _temperature(sp))
    return jnp.where(sp.processed[:, None], processed, logits_bv)


def truncated_logits(logits_bv, sp: SamplingArrays):
    """Tempered logits with everything outside top-k / top-p / min-p set to -inf (sorted order).

    Returns (sorted_logits (B, V), sorted_ids (B, V)).
    """
    scaled = logits_bv / _temperature(sp)  # the same division as policy_logits
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


def probabilities(penalized_bv, sp: SamplingArrays):
    """(B, V) the distribution `draw` draws from, in token order: tempered, truncated (top-k, top-p, min-p)
    and renormalised; a greedy row's is one-hot on its argmax. (Speculative sampling's standard rule
    compares it with the drafter's.)"""
    masked, order = truncated_logits(penalized_bv, sp)
    rows = jnp.arange(penalized_bv.shape[0])[:, None]
    probs = jnp.zeros_like(masked).at[rows, order].set(jax.nn.softmax(masked, axis=-1))
    greedy = jax.nn.one_hot(jnp.argmax(penalized_bv, axis=-1), penalized_bv.shape[-1], dtype=probs.dtype)
    return jnp.where(sp.temperature[:, None] == 0, greedy, probs)


def token_keys(seed_b, index_b):
    """(B,) the key of each row's token `index_b` (B,): `fold_in(key(seed), index)`, what `draw` draws with."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed_b, index_b)


def row_keys(seed_b, index_b, salt: int):
    """(B,) keys for a row's token `index_b` (B,) and one use of it, `salt`: apart from `draw`'s keys
    (`token_keys`) and from each other, so a draw, a draft and an acceptance test of the same token are
    independent."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(token_keys(seed_b, index_b), salt)


def sample(logits_bv, sp: SamplingArrays, step, seen_bv, counts_bv, allowed_bv=None, tiled: bool = False):
    """Next token per row: (B,) int32. Greedy rows (temperature 0) take the processed argmax.

    step: () or (B,) int32, the index of the token being drawn; with the row's seed it keys the draw,
    so a request's samples do not depend on its batch or on when it started. allowed_bv: (B, V) bool,
    the tokens each row's constraint allows (None: all). tiled: per tile of rows (`layers.per_tile`,
    model deterministic mode): the softmax and cumulative sums of the truncation then sum each row in
    the same order whatever the batch (XLA:CPU's order depends on the row count).
    """
    return draw(penalized(logits_bv, sp, seen_bv, counts_bv, allowed_bv), sp, step, tiled)


def draw(penalized_bv, sp: SamplingArrays, step, tiled: bool = False):
    """`sample` from `penalized` logits (B, V): (B,) int32."""
    if tiled:
        return _draw_tiles(penalized_bv, sp, step)
    greedy = jnp.argmax(penalized_bv, axis=-1).astype(jnp.int32)

    def drawn(_):
        masked, order = truncated_logits(penalized_bv, sp)
        steps = jnp.broadcast_to(step, sp.seed.shape)  # one step for all rows, or each row's own
        keys = token_keys(sp.seed, steps)
        choice = jax.vmap(jax.random.categorical)(keys, masked)
        token = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        return jnp.where(sp.temperature == 0, greedy, token).astype(jnp.int32)

    # An all-greedy batch skips the sort over the vocabulary (a value-dependent branch: no recompile).
    return jax.lax.cond(jnp.all(sp.temperature == 0), lambda _: greedy, drawn, None)


def _draw_tiles(penalized_bv, sp: SamplingArrays, step):
    """`draw` over tiles of `layers.TILE` rows."""
    steps = jnp.broadcast_to(step, sp.seed.shape)
    leaves, tree = jax.tree.flatten(sp)

    def tile(logits, steps, *leaves):
        return draw(logits, jax.tree.unflatten(tree, leaves), steps)

    return per_tile(tile, penalized_bv, steps, *leaves)
