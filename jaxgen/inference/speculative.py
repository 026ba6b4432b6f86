"""Speculative decoding inside the Generator's on-device loop: n-gram drafts (prompt lookup), a
smaller draft model with the same tokenizer, or an EAGLE-3 head on the target's own features
(`jaxgen.model.eagle`, `eagle_drafts`).

Each target step feeds W + 1 tokens: the token just drawn and W drafts. N-gram drafts are copied from
what followed the latest earlier occurrence of the row's last n tokens (n = 3, else 2, else 1) in its
prompt and output; a draft model proposes its greedy continuation (`model_drafts`), keeping its own
contiguous cache in step with the target's.
One forward pass gives the target's distribution after each of them, and the drafts are checked in
order: draft i is kept while the token the target *draws* there, with the same (seed, token index) key,
penalties and settings as plain decoding, equals it. Since a draft is a single guessed token (a point
mass), this is the standard accept/resample rule: the kept tokens and the first drawn token that differs
(drawn at the next step, from the same logits) are exactly what plain decoding would produce, so the
output equals plain decoding for greedy and sampled rows alike, and per-request seeds stay
batch-invariant.

The contiguous cache writes all rows at one shared slot: a rejected draft's slot gets position -1
(attention never reads it), and the next step writes from just past the longest row's kept tokens, so
at batch 1 no slot is wasted; the cache is sized for W + 1 slots a step (`cache_len_needed`), the most
a step may keep. Per row, `num_speculative_tokens` (0..W) is an array: changing it does not recompile;
W is the power of two (2, 4 or 8) covering the batch's largest request.

`rule="standard"` (the Generator's `spec_rule`) is standard speculative sampling instead: exact in
distribution, not token for token. Drafts are drawn from the drafter's distribution q (an EAGLE head's
softmax at the row's temperature; n-gram and draft-model drafts are point masses), draft i is kept with
probability min(1, p(d)/q(d)) against the target's processed distribution p, and after a rejection the next
token is drawn from max(0, p - q), renormalised (`SpecState.residual` carries q to that draw). Each of the
three draws has its own key (`sampling.row_keys`). Greedy rows stay token for token.

Shapes: B rows, S history length (prompt + output), W the draft window, V the vocabulary.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import DecodeState, allowed, append, finish_code, record, stop_hit, upload
from jaxgen.inference.sampling import draw, penalized, probabilities, row_keys, sample
from jaxgen.model import eagle, kvcache, lora
from jaxgen.model.cache import Cache
from jaxgen.model.kvcache import KVCache

NGRAMS = (3, 2, 1)  # the longest match wins
MAX_WINDOW = 8  # the widest draft window (`window`)
RULES = ("exact", "standard")  # token for token as plain decoding; standard speculative sampling
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # `row_keys` salts of the standard rule's draws


@flax.struct.dataclass
class SpecState:
    history: jax.Array  # (B, S) int32: each row's prompt and output so far, by position
    length: jax.Array  # (B,) int32: tokens in history
    num_spec: jax.Array  # (B,) int32: drafts per step (0 = plain decoding for that row)
    proposed: jax.Array  # (B,) int32: drafts fed so far
    accepted: jax.Array  # (B,) int32: drafts kept so far
    target_steps: jax.Array  # (B,) int32: target forward passes the row took part in
    # with a draft model: its cache (the Generator's: a KVCache with the same slots as the target's; the
    # engine's: a PagedCache on the target's page tables) and, per row, whether the last kept token is not
    # in it yet (all W drafts were kept: the draft model never ran on the last one)
    draft_cache: Cache | None = None
    missing: jax.Array | None = None  # (B,) bool
    # with an EAGLE head (its cache is draft_cache): the target's tapped features (B, W + 1, n D) of the
    # last step's fed tokens, of which the first feature_len (B,) were kept, from position feature_pos (B,)
    features: jax.Array | None = None
    feature_len: jax.Array | None = None
    feature_pos: jax.Array | None = None
    kept_at: jax.Array | None = None  # (B, 8) int32: steps that kept drafts 1..i + 1 (acceptance by position)
    # the standard rule: the drafter's distribution (B, V) of the draft the last step rejected, which the
    # next token's draw subtracts from the target's (zeros: nothing rejected); the engine's also keeps it as
    # it was when its last speculative chunk started (`residual_before`): with a chunk in flight, that is the
    # residual at the tokens its sequences were given (what a preempted one resumes from)
    residual: jax.Array | None = None
    residual_before: jax.Array | None = None

    @classmethod
    def init(cls, prompts: list[list[int]], num_spec: list[int], size: int, draft_cache=None, eagle=None,
             vocab: int = 0) -> SpecState:  # fmt: skip
        """`eagle`: (head cache, the prompts' last features (B, n D), W) from `prefill_with_head`; `vocab`:
        the target's vocabulary size for the standard rule's `residual` (0: the exact rule)."""
        history = np.full((len(prompts), size), -1, np.int32)
        for r, p in enumerate(prompts):
            history[r, : len(p)] = p

        def zeros(dtype=np.int32):  # one buffer each: the loop donates them
            return np.zeros((len(prompts),), dtype)

        host = dict(  # sent in one transfer: each eager jnp op would dispatch on its own
            history=history, length=np.asarray([len(p) for p in prompts], np.int32),
            num_spec=np.asarray(num_spec, np.int32), proposed=zeros(), accepted=zeros(), target_steps=zeros(),
            kept_at=np.zeros((len(prompts), 8), np.int32),
            missing=None if draft_cache is None or eagle is not None else zeros(bool),
            residual=np.zeros((len(prompts), vocab), np.float32) if vocab else None,
        )  # fmt: skip
        if eagle is None:
            return cls(**upload(host), draft_cache=draft_cache)
        head_cache, last_features, w = eagle
        b, f = last_features.shape
        features = jnp.zeros((b, w + 1, f), last_features.dtype).at[:, 0].set(last_features)
        host |= dict(feature_len=np.ones((b,), np.int32), feature_pos=host["length"] - 1)
        return cls(**upload(host), draft_cache=head_cache, features=features)


def window(num_spec: list[int]) -> int:
    """The static draft window W for a batch: 2, 4 or 8 (0 when no row speculates)."""
    top = max(num_spec, default=0)
    return 0 if top == 0 else next(w for w in (2, 4, 8) if w >= top)


def cache_len_needed(prompt_len: int, new_tokens: int, w: int) -> int:
    """Slots a speculative run may write: every step takes W + 1 and makes at least one token."""
    return prompt_len + new_tokens * (w + 1)


def ngram_drafts(history_bs, length_b, w: int):
    """Drafts (B, W) int32 and how many are real (B,): the tokens after the latest earlier match of the
    last n tokens (the longest n of NGRAMS that matches), up to the end of what is known."""
    b, s = history_bs.shape
    j = jnp.arange(s)
    found, start = jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32)
    for n in sorted(NGRAMS):  # shorter first: a longer match found later overrides
        match = (j[None] >= n - 1) & (j[None] <= length_b[:, None] - 2)
        for m in range(n):
            last = jnp.take_along_axis(history_bs, jnp.maximum(length_b - 1 - m, 0)[:, None], axis=1)
            earlier = jnp.roll(history_bs, m, axis=1)  # earlier[:, j] = history[:, j - m]
            match &= earlier == last
        hit = match.any(1) & (length_b >= n + 1)
        where = jnp.max(jnp.where(match, j[None], -1), axis=1)
        start = jnp.where(hit, where + 1, start)
        found |= hit
    idx = start[:, None] + jnp.arange(w)[None]
    real = jnp.where(found, jnp.clip(length_b - start, 0, w), 0)
    drafts = jnp.take_along_axis(history_bs, jnp.minimum(idx, s - 1), axis=1)
    return jnp.where(jnp.arange(w)[None] < real[:, None], drafts, 0), real


def model_drafts(draft_params, draft_cfg: ModelConfig, sp: SpecState, prev, x0, position, live, w: int):
    """The draft model's greedy W tokens after each row's `x0` (B,) at `position` (B,): returns drafts
    (B, W) and its cache. It first runs on (prev, x0), `prev` being the row's last kept token, fed only
    when `sp.missing` (otherwise it is in the cache already), then W - 1 single-token steps. A greedy
    draft is one guessed token, so the target's check keeps the output exact whatever the draft model."""
    first = jnp.stack([jnp.where(sp.missing & live, position - 1, -1), jnp.where(live, position, -1)], axis=1)
    logits, cache = model.forward(draft_params, jnp.stack([prev, x0], axis=1), first, sp.draft_cache, cfg=draft_cfg)
    drafts = jnp.zeros((x0.shape[0], w), jnp.int32).at[:, 0].set(jnp.argmax(logits[:, -1], axis=-1))

    def step(i, carry):
        drafts, cache = carry
        fed = jnp.where(live & (position + i < draft_cfg.max_seq_len), position + i, -1)
        last = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)
        logits, cache = model.forward(draft_params, last, fed[:, None], cache, cfg=draft_cfg)
        return drafts.at[:, i].set(jnp.argmax(logits[:, 0], axis=-1)), cache

    drafts, cache = jax.lax.fori_loop(1, w, step, (drafts, cache))
    return drafts.astype(jnp.int32), cache


def eagle_drafts(head: eagle.Head, embed_vd, sp: SpecState, history_bs, position_b, live_b, w: int, drawn=None):
    """An EAGLE head's greedy W drafts after each row's newest token (already in `history_bs`, at
    `position_b` (B,)): returns drafts (B, W), the head's cache and, with `drawn` (the standard rule:
    (SamplingArrays, the newest token's index (B,), V)), drafts drawn from the head's distribution at
    each row's temperature and those distributions in target ids (B, W, V) (else None).

    The head first catches up on the target's features of the last step's kept tokens (`sp.features`:
    feature_len of them from feature_pos, each with the token that followed it, the newest token last),
    storing their keys as training's step 0 made them; its output at the last one is draft 1. Then W - 1
    single steps feed back its own hidden state with the draft before; those keys are forgotten after (the
    next catch-up stores the verified ones), so the cache keeps W + 1 slots a step, as the target's. (The
    engine's windows vary between calls: its features are MAX_WINDOW + 1 wide, the catch-up as wide.)"""
    b, s = history_bs.shape
    i = jnp.arange(sp.features.shape[1])[None]  # W + 1, or the engine's widest window's MAX_WINDOW + 1
    fed = live_b[:, None] & (i < sp.feature_len[:, None])
    positions = jnp.where(fed, sp.feature_pos[:, None] + i, -1)
    follow = jnp.take_along_axis(history_bs, jnp.clip(sp.feature_pos[:, None] + i + 1, 0, s - 1), axis=1)
    before = sp.draft_cache
    hidden, logits, cache = eagle.step(head, embed_vd, eagle.project(head, sp.features), follow, positions, before)
    cache = cache.forget_rejected(before, fed)
    last = jnp.maximum(sp.feature_len - 1, 0)[:, None, None]
    hidden = jnp.take_along_axis(hidden, last, axis=1)  # (B, 1, D)
    first, q = _choose(head, jnp.take_along_axis(logits, last, axis=1)[:, 0], 0, drawn)
    drafts = jnp.zeros((b, w), jnp.int32).at[:, 0].set(first)
    qs = [q]

    caught_up = cache
    for j in range(1, w):  # unrolled: a loop inside the decode loop made XLA:CPU copy the carried cache
        pos = position_b + j - 1  # draft j - 1 is token position + j: the head's token sits one before
        pos = jnp.where(live_b & (pos < head.cfg.max_seq_len) & (j - 1 < cache.room(position_b)), pos, -1)
        hidden, logits, cache = eagle.step(head, embed_vd, hidden, drafts[:, j - 1 : j], pos[:, None], cache)
        token, q = _choose(head, logits[:, 0], j, drawn)
        drafts = drafts.at[:, j].set(token)
        qs.append(q)
    cache = cache.forget_rejected(caught_up, jnp.zeros((b, w - 1), bool))
    return drafts, cache, None if drawn is None else jnp.stack(qs, axis=1)


def _choose(head: eagle.Head, logits_bd, j: int, drawn):
    """Draft j from the head's logits (B, Vd): greedy (returns (B,) target ids, None), or with `drawn`
    drawn from its distribution at each row's temperature (one-hot at 0), returned in target ids (B, V)."""
    if drawn is None:
        return eagle.to_target(head, jnp.argmax(logits_bd, axis=-1)), None
    sampling, index_b, v = drawn
    t = sampling.temperature[:, None]
    greedy = jnp.argmax(logits_bd, axis=-1)
    q = jnp.where(t == 0, jax.nn.one_hot(greedy, logits_bd.shape[-1]), jax.nn.softmax(logits_bd / jnp.maximum(t, 1e-6)))
    keys = row_keys(sampling.seed, index_b + 1 + j, DRAFT)
    token = jnp.where(t[:, 0] == 0, greedy, jax.vmap(jax.random.categorical)(keys, jnp.log(q)))
    full = jnp.zeros((q.shape[0], v), q.dtype).at[:, head.draft_to_target].set(q)
    return eagle.to_target(head, token), full


def prefill_with_head(params, head: eagle.Head, tokens, positions, rows, lengths, cfg: ModelConfig,
                      cache_len: int, cache_dtype: str):  # fmt: skip
    """`decode.prefill` that also prefills an EAGLE head: the target's tapped features of every prompt
    token but the last, each with the token after it, go into the head's cache (`kvcache.BLOCK` slots more
    than the target's: its drafting steps write up to W - 1 past the kept ones); the last feature is what
    the first step catches up on. Returns (cache, next-token logits (B, V), head cache, last features (B, n D))."""
    cache = KVCache.init(cfg, tokens.shape[0], cache_len, cache_dtype).constrain()
    x, cache, features = model.hidden_states(params, tokens, positions, cache, cfg=cfg, taps=head.layers)
    x_last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    last = model.lm_head(params, x_last, cfg)[:, 0]
    # BLOCK more slots: W - 1 <= 7 for its drafting steps, keeping the target's block size (`num_blocks`)
    head_cache = KVCache.init(head.cfg, tokens.shape[0], cache_len + kvcache.BLOCK, cache_dtype)
    follow = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    head_pos = jnp.where(positions + 1 < lengths[:, None], positions, -1)
    _, _, head_cache = eagle.step(head, params["embed_vd"], eagle.project(head, features), follow, head_pos, head_cache)
    last_features = jnp.take_along_axis(features, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return cache.take_rows(rows), last[rows], head_cache.take_rows(rows), last_features[rows]


def check_draft(draft_cfg, cfg: ModelConfig) -> ModelConfig:
    """A draft model must share the target's tokens and reach as far: ValueError naming what differs."""
    if not isinstance(draft_cfg, ModelConfig):
        raise ValueError(f"draft=(params, cfg) needs a ModelConfig as cfg, got {type(draft_cfg).__name__}")
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"the draft model's vocab_size={draft_cfg.vocab_size} differs from the target's {cfg.vocab_size}: "
            "a draft model must use the same tokenizer"
        )
    if draft_cfg.max_seq_len < cfg.max_seq_len:
        raise ValueError(
            f"the draft model's max_seq_len={draft_cfg.max_seq_len} is shorter than the target's "
            f"{cfg.max_seq_len}: it must reach every position the target decodes"
        )
    return draft_cfg


def _draft_kept(cache, before, missing, live, kept, w: int):
    """The draft cache after the check: of the W + 1 slots it was fed from `before` (prev, x0, drafts
    1..W-1), those holding a token that was not kept are forgotten, as in the target's cache
    (`Cache.forget_rejected`)."""
    i = jnp.arange(w + 1)[None]
    keep = jnp.where(i == 0, missing[:, None], i - 1 <= kept[:, None]) & live[:, None]
    return cache.forget_rejected(before, keep)


def speculative_loop(params, state: DecodeState, spec: SpecState, cfg: ModelConfig, w: int, draft_params=None,
                     draft_cfg: ModelConfig | None = None, base=None, head: eagle.Head | None = None,
                     rule: str = "exact"):  # fmt: skip
    """`decode.decode_loop` with W drafts per step; returns (state, spec). Pure; the caches are updated in
    place. Drafts come from n-gram lookup, from the draft model when `draft_params` is given (then
    `spec.draft_cache` holds the prompts, prefilled by the draft model), or from an EAGLE `head` (then
    `spec.draft_cache` is the head's, and each target pass also returns the features it taps).

    base: (B,) int32 or None: the row's `generated` at the start of this call when the buffers hold one
    chunk (the engine: token i of the chunk at column i), else None (the Generator: column = token index).
    The loop also stops before a row could run out of buffer columns (a step writes up to W + 1).
    rule: "exact" or "standard" (see the module's docstring; it needs `spec.residual`).
    (Longer than most functions on purpose: `cond` and `body` are closures over the call's static settings,
    as in `decode.decode_loop`; the body's parts that stand alone are `model_drafts` and `_verify`.)"""
    if rule not in RULES or (rule == "standard") != (spec.residual is not None):
        raise ValueError(f"rule={rule!r} with residual={spec.residual is not None}: 'exact' without, 'standard' with")
    standard = rule == "standard"
    rows = jnp.arange(state.tokens.shape[0])
    base = jnp.zeros_like(state.generated) if base is None else base
    embed = params["embed_vd"]  # the head embeds with the base's embedding (adapters do not touch it)
    params = lora.for_rows(params, state.adapter)  # verification runs each row's adapter (the draft model none)

    def cond(carry):
        s, _ = carry
        room = s.tokens.shape[1] - (s.generated - base) >= jnp.minimum(w + 1, s.max_new - s.generated)
        return (s.step < s.limit) & ~jnp.all(s.done) & jnp.all(room | s.done)

    def body(carry):
        s, sp = carry
        live = ~s.done
        if standard:
            x0 = jnp.where(live, _residual_draw(s, sp.residual), 0)
        else:
            x0 = jnp.where(live, sample(s.logits, s.sampling, s.generated, s.seen, s.counts, allowed(s)), 0)
        prev = jnp.take_along_axis(sp.history, jnp.maximum(sp.length - 1, 0)[:, None], axis=1)[:, 0]
        history = sp.history.at[rows, jnp.where(live, sp.length, sp.history.shape[1])].set(x0, mode="drop")
        length = sp.length + live
        q = None  # the standard rule: the drafts' distributions (B, W, V)
        v = s.logits.shape[-1]
        if head is not None:
            drawn = (s.sampling, s.generated, v) if standard else None
            drafts, draft_cache, q = eagle_drafts(head, embed, sp, history, s.positions, live, w, drawn)
            real = jnp.full_like(sp.num_spec, w)
        elif draft_params is None:
            drafts, real = ngram_drafts(history, length, w)
        else:
            drafts, draft_cache = model_drafts(draft_params, draft_cfg, sp, prev, x0, s.positions, live, w)
            real = jnp.full_like(sp.num_spec, w)
        guessed, (drafts, real) = drafts, _forced_first(s, x0, drafts, real, w)
        if standard:  # greedy drafts are point masses; so are jump-forward ones (the constraint allows no other)
            point = jax.nn.one_hot(drafts, v)
            q = point if q is None else jnp.where((drafts == guessed)[..., None], q, point)
        real = jnp.clip(jnp.minimum(real, sp.num_spec), 0, room(s.cache, s.positions) - 1) * live
        offsets = jnp.arange(w + 1)[None]
        positions = s.positions[:, None] + offsets  # (B, W + 1)
        fed = live[:, None] & (offsets <= real[:, None]) & (positions < cfg.max_seq_len)
        tokens = jnp.concatenate([x0[:, None], drafts], axis=1)
        before = s.cache
        # one (W + 1)-token pass even when no row has a draft: a lax.cond choosing a one-token pass then
        # made XLA copy the whole cache 4 times a step (in and out of the branch; 15% slower at batch 1)
        taps = () if head is None else head.layers
        logits, cache, *features = model.forward(params, tokens, jnp.where(fed, positions, -1), s.cache, cfg=cfg,
                                                 taps=taps)  # fmt: skip
        start = s.positions

        s = record(s, x0, s.logits, live, cfg, base)
        s, kept = _verify(s, drafts, real, logits[:, :w], cfg, base, q)
        history = history.at[rows[:, None], length[:, None] + jnp.arange(w)[None]].set(drafts, mode="drop")
        keep = live[:, None] & (offsets <= kept[:, None])  # rejected drafts' keys: never read again
        cache = forget_rejected(cache, before, jnp.where(keep, positions, -1))
        s = s.replace(
            step=s.step + 1, positions=s.positions + (1 + kept) * live, cache=cache,
            logits=jnp.take_along_axis(logits, kept[:, None, None], axis=1)[:, 0],
        )  # fmt: skip
        sp = sp.replace(
            history=history, length=length + kept, proposed=sp.proposed + real, accepted=sp.accepted + kept,
            target_steps=sp.target_steps + live,
        )  # fmt: skip
        if sp.kept_at is not None:
            sp = sp.replace(kept_at=sp.kept_at + (jnp.arange(sp.kept_at.shape[1])[None] < kept[:, None]))
        if standard:  # a draft the test rejected: the next token is drawn from what p has beyond its q
            # (a greedy row's p is one-hot on a token other than the draft: its plain argmax is that draw)
            rejected = live & (kept < real) & ~s.done & (s.sampling.temperature > 0)
            q_kept = jnp.take_along_axis(q, jnp.minimum(kept, w - 1)[:, None, None], axis=1)[:, 0]
            sp = sp.replace(residual=jnp.where(rejected[:, None], q_kept, 0.0))
        if head is not None:
            wide = jnp.pad(features[0], ((0, 0), (0, sp.features.shape[1] - (w + 1)), (0, 0)))
            sp = sp.replace(
                draft_cache=draft_cache, features=wide, feature_len=jnp.where(live, kept + 1, sp.feature_len),
                feature_pos=jnp.where(live, start, sp.feature_pos),
            )  # fmt: skip
        elif draft_params is not None:
            draft_cache = _draft_kept(draft_cache, sp.draft_cache, sp.missing, live, kept, w)  # sp's: the step's start
            sp = sp.replace(draft_cache=draft_cache, missing=jnp.where(live, kept == w, sp.missing))
        return s, sp

    return jax.lax.while_loop(cond, body, (state, spec))


def after_plain(spec: SpecState, tokens_bm, before_b, after_b, base_b) -> SpecState:
    """The rows' speculative state after a plain chunk (the engine's `spec_gate` choice)
    made their tokens [before, after) (at buffer columns index - base): the n-gram history takes them, and an
    EAGLE head's pending features are dropped (none is of the last token; its keys of these positions are
    never written, which costs acceptance, never exactness)."""
    new = after_b - before_b
    b, m = tokens_bm.shape
    i = jnp.arange(m)[None]
    column = jnp.clip(before_b - base_b, 0, m - 1)[:, None] + i
    taken = jnp.take_along_axis(tokens_bm, jnp.minimum(column, m - 1), axis=1)
    where = jnp.where(i < new[:, None], spec.length[:, None] + i, spec.history.shape[1])
    spec = spec.replace(history=spec.history.at[jnp.arange(b)[:, None], where].set(taken, mode="drop"),
                        length=spec.length + new)  # fmt: skip
    if spec.feature_len is not None:
        spec = spec.replace(feature_len=jnp.zeros_like(spec.feature_len))
    return spec


def _forced_first(s: DecodeState, x0, drafts_bw, real_b, w: int):
    """Jump-forward: where a constrained row's automaton allows one token only after `x0` (a JSON key, a
    closing brace), those tokens are its drafts. Verification keeps them all (the masked draw can only pick
    them), so a run of forced tokens costs one model step, and the output is the one plain decoding gives.
    Rows with no forced token keep their n-gram or draft-model drafts. Returns (drafts (B, W), real (B,))."""
    state = s.grammar_table[s.grammar, x0]
    ok = s.grammar > 0
    forced, count = [], jnp.zeros_like(real_b)
    for _ in range(w):
        row = s.grammar_table[jnp.maximum(state, 0)]  # (B, V)
        allowed = row >= 0
        tok = jnp.argmax(allowed, axis=-1).astype(jnp.int32)
        ok = ok & (state > 0) & (allowed.sum(-1) == 1)
        forced.append(tok)
        count = count + ok
        state = jnp.take_along_axis(row, tok[:, None], axis=1)[:, 0]
    jump = count > 0
    return jnp.where(jump[:, None], jnp.stack(forced, axis=1), drafts_bw), jnp.where(jump, count, real_b)


def room(cache, positions_b):
    """(B,) tokens each row's cache can take from `positions_b` on (`Cache.room`)."""
    return cache.room(positions_b)


def forget_rejected(cache, before, kept_positions_bt):
    """The cache after a (W + 1)-token call made on `before`, its rejected drafts' keys never read again
    (`Cache.forget_rejected`); `kept_positions_bt` (B, W + 1): the kept tokens' positions, -1 elsewhere."""
    return cache.forget_rejected(before, kept_positions_bt >= 0, kept_positions_bt)


def _residual_draw(s: DecodeState, residual_bv):
    """The standard rule's next token (B,): where the last step rejected a draft, drawn from max(0, p -
    residual), renormalised, p being what plain decoding draws from (`sampling.probabilities`); elsewhere
    plain decoding's own draw, with its key (a row without drafts then decodes as it would plainly)."""
    pen = penalized(s.logits, s.sampling, s.seen, s.counts, allowed(s))
    plain = draw(pen, s.sampling, s.generated)
    pending = jnp.any(residual_bv > 0, axis=-1)

    def residual(_):
        p = probabilities(pen, s.sampling)
        left = jnp.maximum(p - residual_bv, 0.0)
        left = jnp.where(left.sum(-1, keepdims=True) > 0, left, p)
        keys = row_keys(s.sampling.seed, s.generated, RESIDUAL)
        return jnp.where(pending, jax.vmap(jax.random.categorical)(keys, jnp.log(left)), plain).astype(jnp.int32)

    # no row with a rejection pending (greedy batches always): no sort over the vocabulary (no recompile)
    return jax.lax.cond(jnp.any(pending), residual, lambda _: plain, None)


def _verify(s: DecodeState, drafts_bw, real_b, logits_bwv, cfg: ModelConfig, base, q_bwv=None):
    """All W drafts checked and recorded in one batched pass (a loop over W would be W rounds of small
    operations). Draft i is drawn with token index generated + i and the penalties' counts as if drafts
    0..i-1 were kept: if one of them was not, draft i is not kept either, so the guess costs nothing.
    Kept: the prefix of drafts drawn as guessed, up to and including one that ends the row (a stop
    sequence, max_new, the context). With `q_bwv` (the standard rule: the drafts' distributions (B, W, V))
    draft i is kept with probability min(1, p(d) / q(d)) instead. Returns the state and the number kept (B,)."""
    b, w = drafts_bw.shape
    v = logits_bwv.shape[-1]
    live = ~s.done
    onehot = jax.nn.one_hot(drafts_bw, v, dtype=jnp.int32)  # (B, W, V)
    before = jnp.cumsum(onehot, axis=1) - onehot  # drafts before i
    counts, seen = s.counts[:, None] + before, s.seen[:, None] | (before > 0)
    index = s.generated[:, None] + jnp.arange(w)[None]
    repeat = jax.tree.map(lambda a: jnp.repeat(a, w, axis=0), s.sampling)
    flat = (b * w, v)
    states = _grammar_states(s, drafts_bw)  # (B, W + 1): before draft i, and after the last
    allowed_bwv = s.grammar_table[jnp.maximum(states[:, :w], 0)] >= 0  # a forbidden draft is never drawn
    pen = penalized(logits_bwv.reshape(flat), repeat, seen.reshape(flat), counts.reshape(flat),
                    allowed_bwv.reshape(flat))  # fmt: skip
    if q_bwv is None:
        accepted = draw(pen, repeat, index.reshape(-1)).reshape(b, w) == drafts_bw
    else:
        p_d, q_d = (jnp.take_along_axis(x, drafts_bw[..., None], axis=-1)[..., 0]
                    for x in (probabilities(pen, repeat).reshape(b, w, v), q_bwv))  # fmt: skip
        u = jax.vmap(jax.random.uniform)(row_keys(repeat.seed, index.reshape(-1), ACCEPT)).reshape(b, w)
        accepted = u * q_d < p_d  # probability min(1, p/q)
    guessed = jnp.cumprod(accepted & (jnp.arange(w)[None] < real_b[:, None]), axis=1).astype(bool)

    # where the row would end: the recent window after each draft, max_new, the context
    ls = s.recent.shape[1]
    seq = jnp.concatenate([s.recent, drafts_bw], axis=1)  # (B, Ls + W)
    windows = jnp.take_along_axis(seq[:, None, :], (jnp.arange(w)[:, None] + 1 + jnp.arange(ls)[None])[None], axis=2)
    hit = stop_hit(s.stop_seqs[:, None], windows)  # (B, W)
    offsets = jnp.arange(w)[None] + 1
    too_long = (s.generated[:, None] + offsets >= s.max_new[:, None]) | (
        s.positions[:, None] + offsets + 1 >= cfg.max_seq_len
    )
    ends = hit | too_long
    ended_before = (jnp.cumsum(ends, axis=1) - ends) > 0
    kept_bw = guessed & live[:, None] & ~ended_before
    kept = kept_bw.sum(1).astype(jnp.int32)

    last = jnp.maximum(kept - 1, 0)[:, None]
    finish = finish_code(s.finish, kept > 0, *(jnp.take_along_axis(x, last, 1)[:, 0] for x in (hit, too_long)))
    rows = jnp.arange(b)[:, None]
    column = jnp.where(kept_bw, index - base[:, None], s.tokens.shape[1])  # past the end: dropped
    recent = jnp.take_along_axis(seq, kept[:, None] + jnp.arange(ls)[None], axis=1)
    s = s.replace(grammar=jnp.where(live, jnp.take_along_axis(states, kept[:, None], axis=1)[:, 0], s.grammar))
    s = append(s, rows, column, drafts_bw, logits_bwv, kept_bw, s.generated + kept, finish, recent)
    return s, kept


def _grammar_states(s: DecodeState, drafts_bw):
    """Each row's constraint state before each draft and after the last (B, W + 1); -1 past a forbidden one."""

    def step(state, tok):
        after = jnp.where(state < 0, -1, s.grammar_table[jnp.maximum(state, 0), tok])
        return after, after

    _, after = jax.lax.scan(step, s.grammar, drafts_bw.T)
    return jnp.concatenate([s.grammar[:, None], after.T], axis=1)
