"""The engine's device steps: pure functions of the decode state, jitted with the state donated.

    init_state(cfg, serve, num_pages, max_pages) -> state      every slot idle, the page pool empty
    set_tables(state, page_table, capacity) -> state           the host's page tables, every slot at once
    admit_rows(params, state, spec, rows, retire, cfg) -> (state, spec)
                                                               a step's prefill chunks (R x C, `pack_rows`), the
                                                               slots they start, the draft model's prefill
    set_wide(state, slot, seen, counts, logit_bias) -> state   a row's penalties' and bias' state (`wide_row`)
    set_grammar_table(state, table) -> state                   the constraints of the slots (structured/pool.py)
    decode_chunk(params, state, limit, retire, cfg) -> (state, outputs)   up to `limit` decode steps, every
                                                               active slot; `outputs` what the host reads
    init_spec(cfg, serve, draft_cfg=None, num_pages=0, max_pages=0) -> spec   speculative decoding's state
    activate_spec(spec, slot, history, length, num_spec) -> spec   a speculating slot's prompt and output so far
                                                               (`spec_history`)
    decode_chunk_speculative(params, state, spec, limit, retire, cfg, w, draft_params, draft_cfg)
                                                               -> (state, spec, outputs and counters)
                                                               with n-gram or draft-model drafts

`retire` (B,) bool: the slots that stop before the call runs (finished, cancelled, preempted), so that a step
changes rows in the calls it makes anyway.

The state is the `DecodeState` of `jaxgen.generate`, its cache a `PagedCache`. The scheduler
(`jaxgen.inference.scheduler`) decides what to run and the engine runs it through these functions;
per-request values are arrays, so nothing a request asks for recompiles them; a prefill call's shape is
its rows and columns, each bucketed (`scheduler.call_shape`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference import scoring, speculative
from jaxgen.inference.decode import (
    FINISH_LENGTH,
    MAX_STOPS,
    RUNNING,
    DecodeState,
    HostRows,
    decode_loop,
    row_history,
    stop_window,
)  # fmt: skip
from jaxgen.inference.sampling import MAX_SPECULATIVE, MAX_STOP_SEQUENCE, SamplingArrays, SamplingConfig
from jaxgen.inference.structured import table_rows
from jaxgen.model import eagle, lora
from jaxgen.model.paged import PagedCache, page_bytes


@flax.struct.dataclass
class Rows:
    """A step's prefill chunks as R rows of C tokens (`pack_rows`), and the decode row of each slot whose prefill
    one completes: everything that changes rows, run by `admit_rows` in one call. Padding rows (slot 0, every
    position -1) write only the null page and start nothing."""

    slot: jax.Array  # (R,) int32, the slot whose pages each row fills
    tokens: jax.Array  # (R, C) int32
    positions: jax.Array  # (R, C) int32, -1 past each chunk
    last: jax.Array  # (R,) int32, the column of each chunk's last token (its logits start decoding)
    activate: jax.Array  # (R,) bool, the chunk completes the prompt and the slot starts (or resumes) decoding
    position: jax.Array  # (R,) int32, the position the next token takes
    generated: jax.Array  # (R,) int32, tokens generated so far (seeded draws are keyed by it)
    max_new: jax.Array  # (R,) int32
    stop_seqs: jax.Array  # (R, MAX_STOPS, MAX_STOP_SEQUENCE) int32, right-aligned, -1 padded
    recent: jax.Array  # (R, MAX_STOP_SEQUENCE) int32, the last generated tokens (-1 before any)
    grammar: jax.Array  # (R,) int32, its state in the engine's grammar table (0: unconstrained)
    sampling: SamplingArrays  # (R,) rows; logit_bias (R, 0): a row with a bias sets it with `set_wide`
    num_spec: jax.Array  # (R,) int32, drafts a step (0: plain decoding)
    length: jax.Array  # (R,) int32, prompt and output so far (the n-gram history's length)
    adapter: jax.Array | None = None  # (R,) int32, its slot in the LoRA bank (0: none); None without a bank


@dataclasses.dataclass
class Admitted:
    """One chunk of a step on the host, with what its slot starts decoding from when `activate` (`pack_rows`)."""

    slot: int
    sequence: list[int]  # the whole sequence so far: prompt, then the tokens kept by a preemption
    start: int  # the chunk: tokens [start, start + length) of `sequence`
    length: int
    activate: bool
    prompt_len: int = 0  # then: the prompt's length (the rest of `sequence` is output)
    sampling: SamplingConfig | None = None
    stops: tuple = ()
    grammar: int = 0
    adapter: int = 0


def pack_rows(chunks: list[Admitted], rows: int, columns: int, cfg: ModelConfig, lora_bank: bool) -> Rows:
    """The host arrays of `chunks` as `rows` x `columns` (`scheduler.call_shape`), padding rows after them."""
    r, c = rows, columns
    tokens, positions = np.zeros((r, c), np.int32), np.full((r, c), -1, np.int32)
    ints = {name: np.zeros(r, np.int32) for name in ("slot", "last", "position", "generated", "max_new", "grammar",
                                                       "num_spec", "length", "adapter")}  # fmt: skip
    activate = np.zeros(r, bool)
    stop_seqs = np.full((r, MAX_STOPS, MAX_STOP_SEQUENCE), -1, np.int32)
    recent = np.full((r, MAX_STOP_SEQUENCE), -1, np.int32)
    configs = [SamplingConfig(temperature=0.0)] * r
    for i, a in enumerate(chunks):
        tokens[i, : a.length] = a.sequence[a.start : a.start + a.length]
        positions[i, : a.length] = np.arange(a.start, a.start + a.length)
        ints["slot"][i], ints["last"][i], ints["adapter"][i] = a.slot, a.length - 1, a.adapter
        if not a.activate:
            continue
        out = a.sequence[a.prompt_len :]
        activate[i], configs[i] = True, dataclasses.replace(a.sampling, logit_bias=())  # bias: `set_wide`
        ints["position"][i], ints["generated"][i], ints["length"][i] = len(a.sequence), len(out), len(a.sequence)
        ints["max_new"][i] = min(a.sampling.max_new_tokens, cfg.max_seq_len)  # the context ends it first anyway
        ints["grammar"][i], ints["num_spec"][i] = a.grammar, a.sampling.num_speculative_tokens
        stop_seqs[i], recent[i] = stop_window(out, a.stops, MAX_STOP_SEQUENCE)
    sampling = SamplingArrays.stack(configs, 0)  # logit_bias (R, 0): `set_wide` writes a row's
    adapter = ints.pop("adapter")
    adapter = adapter if lora_bank else None
    return Rows(tokens=tokens, positions=positions, activate=activate, stop_seqs=stop_seqs, recent=recent,
                sampling=sampling, adapter=adapter, **ints)  # fmt: skip


def needs_wide(c: SamplingConfig) -> bool:
    """Does a row of `c` read the vocabulary-wide arrays (`set_wide`): a logit bias, or penalties?"""
    return bool(c.logit_bias) or c.repetition_penalty != 1 or c.presence_penalty != 0 or c.frequency_penalty != 0


def wide_row(sequence: list[int], prompt_len: int, c: SamplingConfig, vocab: int) -> tuple:
    """(seen (V,) bool, counts (V,) int32, logit_bias (V,) float32) of a row about to decode (`set_wide`)."""
    _, _, seen, counts = row_history(sequence[:prompt_len], sequence[prompt_len:], (), 1, vocab)
    return seen, counts, SamplingArrays.stack([c], vocab).logit_bias[0]


def chunk_columns(serve: ServeConfig) -> int:
    """Columns of a chunk's token buffers: `chunk_steps`, and room for one speculative step beyond."""
    return serve.chunk_steps + MAX_SPECULATIVE + 1


def init_state(cfg: ModelConfig, serve: ServeConfig, num_pages: int, max_pages: int) -> DecodeState:
    b, v, m, a = serve.slots, cfg.vocab_size, chunk_columns(serve), serve.max_logprobs
    cache = PagedCache.init(cfg, num_pages, serve.page_size, b, max_pages, serve.cache_dtype).constrain()
    idle = SamplingConfig(temperature=0.0)
    return DecodeState(
        step=jnp.int32(0), limit=jnp.int32(0),
        tokens=jnp.zeros((b, m), jnp.int32), logprobs=jnp.zeros((b, m), jnp.float32),
        top_ids=jnp.zeros((b, m, a), jnp.int32), top_logprobs=jnp.zeros((b, m, a), jnp.float32),
        logits=jnp.zeros((b, v), jnp.float32), positions=jnp.zeros((b,), jnp.int32),
        done=jnp.ones((b,), bool), generated=jnp.zeros((b,), jnp.int32),
        finish=jnp.full((b,), FINISH_LENGTH, jnp.int32), max_new=jnp.zeros((b,), jnp.int32),
        stop_seqs=jnp.full((b, MAX_STOPS, MAX_STOP_SEQUENCE), -1, jnp.int32),
        recent=jnp.full((b, MAX_STOP_SEQUENCE), -1, jnp.int32),
        seen=jnp.zeros((b, v), bool), counts=jnp.zeros((b, v), jnp.int32),
        grammar=jnp.zeros((b,), jnp.int32),
        grammar_table=jnp.zeros((table_rows(serve.grammar_states, v), v), jnp.int32),  # unused rows never read
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack([idle] * b, v)), cache=cache,
        adapter=jnp.zeros((b,), jnp.int32) if serve.max_loras else None,  # each slot's LoRA (multi-LoRA serving)
    )  # fmt: skip


def set_tables(state: DecodeState, page_table, capacity) -> DecodeState:
    """Every slot's pages (B, M) and capacity in tokens (B,), as the host's `PageTables` hold them."""
    return state.replace(cache=state.cache.replace(page_table=page_table, capacity=capacity))


def admit_rows(params, state: DecodeState, spec: speculative.SpecState, rows: Rows, retire, cfg: ModelConfig,
               targets=None, top: int | None = None, draft_params=None,
               draft_cfg: ModelConfig | None = None, head=None):  # fmt: skip
    """A step's prefill chunks and the slots they start, in one call: the slots in `retire` (B,) bool stop first
    (`retire_rows`); then every row's chunk runs into its slot's pages (rows attend to their own pages, so a row
    may read prefix pages another row of the call writes: each layer writes before it reads), the draft model's
    too when there is one; then the rows that complete a prompt start decoding from their last token's logits.
    The vocabulary-wide row state starts empty (no bias, nothing seen): `set_wide` fills it for rows that read
    it. With `top` (R = 1), also the scores (1, C) of `targets` (1, C), each chunk token's next token, for the
    prompt's log-probabilities. Returns (state, spec) or (state, spec, scores)."""
    state = retire_rows(state, retire)
    x_params = lora.for_rows(params, rows.adapter)
    taps = () if head is None else head.layers
    cache, x, *features = _prefill_pool(x_params, state.cache, state.cache, rows.slot, rows.tokens, rows.positions,
                                        cfg, taps)  # fmt: skip
    x_last = jnp.take_along_axis(x, rows.last[:, None, None], axis=1)  # (R, 1, D)
    logits = model.lm_head(params, x_last, cfg)[:, 0]  # (R, V)
    b, r, v = state.done.shape[0], rows.slot.shape[0], cfg.vocab_size
    index = jnp.where(rows.activate, rows.slot, b)  # rows that start nothing write out of bounds: dropped

    def put(a, new):
        return a.at[index].set(new.astype(a.dtype), mode="drop")

    sampling = rows.sampling.replace(logit_bias=jnp.zeros((r, v), jnp.float32))
    state = state.replace(
        cache=cache, logits=put(state.logits, logits), positions=put(state.positions, rows.position),
        done=put(state.done, jnp.zeros(r, bool)), finish=put(state.finish, jnp.full(r, RUNNING)),
        generated=put(state.generated, rows.generated), max_new=put(state.max_new, rows.max_new),
        stop_seqs=put(state.stop_seqs, rows.stop_seqs), recent=put(state.recent, rows.recent),
        seen=put(state.seen, jnp.zeros((r, v), bool)), counts=put(state.counts, jnp.zeros((r, v), jnp.int32)),
        grammar=put(state.grammar, rows.grammar), sampling=jax.tree.map(put, state.sampling, sampling),
        adapter=None if state.adapter is None else put(state.adapter, rows.adapter),
    )  # fmt: skip
    missing = None if spec.missing is None else put(spec.missing, jnp.zeros(r, bool))
    spec = spec.replace(num_spec=put(spec.num_spec, rows.num_spec), length=put(spec.length, rows.length),
                        missing=missing)  # fmt: skip
    if spec.residual is not None:  # the standard rule: nothing pending (`set_residual` restores a preempted one's)
        nothing = jnp.zeros((r, spec.residual.shape[1]), spec.residual.dtype)
        spec = spec.replace(residual=put(spec.residual, nothing), residual_before=put(spec.residual_before, nothing))
    if draft_params is not None:  # every sequence: a prefix page may later serve one that speculates
        draft_cache, _ = _prefill_pool(draft_params, spec.draft_cache, cache, rows.slot, rows.tokens, rows.positions,
                                       draft_cfg)  # fmt: skip
        spec = spec.replace(draft_cache=draft_cache)
    if head is not None:  # every sequence too (prefix pages), then its last token's feature waits for the next
        spec = _prefill_head(params["embed_vd"], head, spec, cache, rows, features[0])
    if top is None:
        return state, spec
    return state, spec, scoring.score_hidden(params, x, targets, cfg, top)


def _prefill_pool(params, pool: PagedCache, tables: PagedCache, slots, tokens, positions, cfg: ModelConfig,
                  taps: tuple = ()):  # fmt: skip
    """Rows' chunks through `params` into `pool`, row i addressed by the page table of slot `slots[i]` in `tables`
    (the target's: the draft model's pool has none of its own). Returns the pool on those tables and hidden states
    (and with `taps`, the tapped features)."""
    sub = pool.replace(page_table=tables.page_table[slots], capacity=tables.capacity[slots])
    x, sub, *features = model.hidden_states(params, tokens, positions, sub, cfg=cfg, taps=taps)
    return _on_tables(sub, tables).constrain(), x, *features


def _prefill_head(embed_vd, head, spec: speculative.SpecState, tables: PagedCache, rows: Rows, features_rcf):
    """The EAGLE head's keys for the rows' chunks (`speculative.prefill_with_head` by chunks): the head's token
    at position q pairs the target's feature at q with token q + 1, so a chunk's columns pair the feature before
    each token (the slot's pending one, left by its previous chunk, before the first) with that token; the
    chunk's last feature is left pending (feature_len 1) for the next chunk or the first decode step. A chunk
    after a cached prefix has no pending feature (the prefix's last key stays as its first writer made it)."""
    slots = rows.slot
    pending = spec.features[slots, 0]  # (R, n D)
    ok = (spec.feature_len[slots] > 0) & (spec.feature_pos[slots] == rows.positions[:, 0] - 1)
    hidden = jnp.concatenate([pending[:, None], features_rcf[:, :-1]], axis=1)
    positions = rows.positions - 1
    positions = jnp.where((positions >= 0) & ((jnp.arange(positions.shape[1]) > 0)[None] | ok[:, None]), positions, -1)
    pool = spec.draft_cache
    sub = pool.replace(page_table=tables.page_table[slots], capacity=tables.capacity[slots])
    _, _, sub = eagle.step(head, embed_vd, eagle.project(head, hidden), rows.tokens, positions, sub)
    last = jnp.take_along_axis(features_rcf, rows.last[:, None, None], axis=1)[:, 0]
    real = rows.positions[:, 0] >= 0  # padding rows (slot 0) leave every slot as it was
    index = jnp.where(real, slots, spec.features.shape[0])
    return spec.replace(
        draft_cache=_on_tables(sub, tables).constrain(),
        features=spec.features.at[index, 0].set(last.astype(spec.features.dtype), mode="drop"),
        feature_len=spec.feature_len.at[index].set(1, mode="drop"),
        feature_pos=spec.feature_pos.at[index].set(jnp.take_along_axis(rows.positions, rows.last[:, None], 1)[:, 0],
                                                   mode="drop"),
    )  # fmt: skip


def set_wide(state: DecodeState, slot, seen, counts, logit_bias) -> DecodeState:
    """Slot `slot`'s vocabulary-wide state (V,) each: tokens seen (prompt and output), the output's counts, its
    logit bias (`wide_row`); for the rows that ask for penalties or a bias, after `admit_rows` started them."""
    sampling = state.sampling.replace(logit_bias=state.sampling.logit_bias.at[slot].set(logit_bias))
    return state.replace(seen=state.seen.at[slot].set(seen), counts=state.counts.at[slot].set(counts),
                         sampling=sampling)  # fmt: skip


def retire_rows(state: DecodeState, retire) -> DecodeState:
    """The slots in `retire` (B,) bool stop (finished, stopped by a string, cancelled or preempted): padding."""
    return state.replace(done=state.done | retire, finish=jnp.where(retire, FINISH_LENGTH, state.finish))


def set_grammar_table(state: DecodeState, table) -> DecodeState:
    """The engine's grammar table (S, V) int32 (`structured.GrammarPool`): every slot's constraint at once."""
    return state.replace(grammar_table=table)


def decode_chunk(params, state: DecodeState, limit, retire, cfg: ModelConfig) -> tuple[DecodeState, tuple]:
    """Up to `limit` decode steps for every active slot, into buffers that start at column 0; the slots in
    `retire` (B,) bool stop first. Returns the state and what the host reads of it (`outputs`)."""
    state = retire_rows(state, retire)
    state = decode_loop(params, state.replace(step=jnp.int32(0), limit=limit), cfg)
    state = state.replace(cache=state.cache.constrain())
    return state, outputs(state)


def decode_chunk_unspeculated(params, state: DecodeState, spec, limit, retire, cfg: ModelConfig):
    """`decode_chunk` for a chunk the speculation gate runs plain (`jaxgen.inference.spec_gate`) although rows
    asked for drafts, their speculative state kept current (`speculative.after_plain`). Returns (state, spec,
    `outputs`)."""
    before = state.generated
    state, out = decode_chunk(params, state, limit, retire, cfg)
    # (a retired slot's `generated` does not move: nothing of it is taken)
    return state, speculative.after_plain(spec, state.tokens, before, state.generated, before), out


def outputs(state: DecodeState) -> tuple:
    """`HostRows`' fields of `state`, as outputs of their own: the host fetches them while the next call, which
    consumes the donated state, runs."""
    return tuple(getattr(state, name) for name in HostRows.names())


def history_size(context: int) -> int:
    """History columns for sequences of at most `context` tokens (the pages a slot can hold, not the
    model's max_seq_len, which config.json may set to 10**9)."""
    return context + MAX_SPECULATIVE + 1


def spec_history(context: int, sequence: list[int]) -> tuple[np.ndarray, np.int32]:
    """A slot's n-gram lookup history (S,) int32, -1 padded, and its length: the prompt and output so far."""
    history = np.full(history_size(context), -1, np.int32)
    history[: len(sequence)] = sequence
    return history, np.int32(len(sequence))


def pool_pages(cfg: ModelConfig, serve: ServeConfig, draft_cfg: ModelConfig | None = None) -> int:
    """Pages in the pool: `serve.num_pages`, or as many as `serve.kv_memory_gb` holds (with a draft model or
    an EAGLE head, whose `head.cfg` is passed as `draft_cfg`, a page of each pool)."""
    per_page = page_bytes(cfg, serve.page_size, serve.cache_dtype)
    if draft_cfg is not None:
        per_page += page_bytes(draft_cfg, serve.page_size, serve.cache_dtype)
    return serve.num_pages or int(serve.kv_memory_gb * 2**30 // per_page)


def init_spec(cfg: ModelConfig, serve: ServeConfig, draft_cfg: ModelConfig | None = None, num_pages: int = 0,
              max_pages: int = 0, taps: int = 0) -> speculative.SpecState:  # fmt: skip
    """Every slot's speculative state; with `draft_cfg`, the draft model's page pool: as many pages as the
    target's and addressed by the same page tables (a slot's page p holds the same positions in both). With
    `taps` > 0, `draft_cfg` is an EAGLE head's (`eagle.Head.cfg`, tapping `taps` layers): its pool, and each
    slot's features (MAX_WINDOW + 1 of them, none pending: `admit_rows` sets a prompt's last)."""
    draft_cache = None
    if draft_cfg is not None:
        draft_cache = PagedCache.init(draft_cfg, num_pages, serve.page_size, serve.slots, max_pages, serve.cache_dtype)
        draft_cache = draft_cache.constrain()
    size = history_size(max_pages * serve.page_size)
    vocab = cfg.vocab_size if serve.spec_rule == "standard" else 0
    empty = [[0]] * serve.slots, [0] * serve.slots, size
    if not taps:
        spec = speculative.SpecState.init(*empty, draft_cache, vocab=vocab)
    else:
        last = jnp.zeros((serve.slots, taps * cfg.d_model), jnp.dtype(cfg.dtype))
        spec = speculative.SpecState.init(*empty, eagle=(draft_cache, last, speculative.MAX_WINDOW), vocab=vocab)
        spec = spec.replace(feature_len=jnp.zeros_like(spec.feature_len))
    return spec if not vocab else spec.replace(residual_before=jnp.zeros_like(spec.residual))


def activate_spec(spec: speculative.SpecState, slot, history, length, num_spec) -> speculative.SpecState:
    """Slot `slot` speculates with `num_spec` drafts a step (0: not at all) over `history` (S,) int32,
    its prompt and output so far (`length` tokens); its draft cache (if any) holds all of them."""
    missing = None if spec.missing is None else spec.missing.at[slot].set(False)
    return spec.replace(
        history=spec.history.at[slot].set(history), length=spec.length.at[slot].set(length),
        num_spec=spec.num_spec.at[slot].set(num_spec), missing=missing,
    )  # fmt: skip


def set_residual(spec: speculative.SpecState, slot, residual) -> speculative.SpecState:
    """Slot `slot`'s pending residual (V,) of the standard rule: a preempted sequence's, as it was at the tokens
    it keeps (`Runner.keep_residuals`), so that its next token is drawn as it would have been without the preemption."""
    return spec.replace(residual=spec.residual.at[slot].set(residual),
                        residual_before=spec.residual_before.at[slot].set(residual))  # fmt: skip


def _on_tables(pool: PagedCache, tables: PagedCache) -> PagedCache:
    """`pool` addressed by `tables`' page tables (the host pushes only the target's)."""
    return pool.replace(page_table=tables.page_table, capacity=tables.capacity)


def decode_chunk_speculative(params, state: DecodeState, spec, limit, retire, cfg: ModelConfig, w: int,
                             draft_params=None, draft_cfg: ModelConfig | None = None, head=None,
                             rule: str = "exact"):  # fmt: skip
    """`decode_chunk` with up to W drafts a step for the slots that ask (`jaxgen.inference.speculative`):
    n-gram drafts, or the draft model's (`draft_params`, its pool in `spec.draft_cache`). A slot's tokens
    fill columns 0.. of the buffers; the chunk ends early when a slot might not have room for another
    step. The spec's counters count this chunk only. rule: `serve.spec_rule` (the standard one keeps the
    residual the chunk starts from in `spec.residual_before`). Returns (state, spec, `outputs` and the three
    counters)."""
    spec = spec.replace(
        proposed=jnp.zeros_like(spec.proposed), accepted=jnp.zeros_like(spec.accepted),
        target_steps=jnp.zeros_like(spec.target_steps),
    )  # fmt: skip
    if spec.residual is not None:
        spec = spec.replace(residual_before=spec.residual)
    if draft_params is not None or head is not None:
        spec = spec.replace(draft_cache=_on_tables(spec.draft_cache, state.cache))
    state = retire_rows(state, retire).replace(step=jnp.int32(0), limit=limit)
    drafter = dict(draft_params=draft_params, draft_cfg=draft_cfg, head=head)
    state, spec = speculative.speculative_loop(params, state, spec, cfg, w, base=state.generated, rule=rule, **drafter)
    if spec.draft_cache is not None:
        spec = spec.replace(draft_cache=spec.draft_cache.constrain())
    state = state.replace(cache=state.cache.constrain())
    return state, spec, (*outputs(state), spec.target_steps, spec.proposed, spec.accepted)
