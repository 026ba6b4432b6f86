"""The engine's device steps: pure functions of the decode state, jitted with the state donated.

    init_state(cfg, serve, num_pages, max_pages) -> state      every slot idle, the page pool empty
    set_tables(state, page_table, capacity) -> state           the host's page tables, every slot at once
    prefill_chunk(params, state, slot, tokens, positions, last, cfg) -> (state, logits)   (`prefill_inputs`)
    prefill_chunk_scored(..., targets, cfg, top) -> (state, logits, TokenScores)        prompt log-probabilities
    activate(state, slot, row: SlotRow) -> state               a slot starts (or resumes) decoding
    set_grammar_table(state, table) -> state                   the constraints of the slots (structured/pool.py)
    retire(state, slot) -> state                               a slot stops
    decode_chunk(params, state, limit, cfg) -> state           up to `limit` decode steps, every active slot
    init_spec(cfg, serve, draft_cfg=None, num_pages=0, max_pages=0) -> spec   speculative decoding's state
    activate_spec(spec, slot, history, length, num_spec) -> spec   a slot's prompt and output so far
                                                               (`spec_history`)
    prefill_draft_chunk(draft_params, spec, cache, slot, tokens, positions, draft_cfg) -> spec
                                                               the draft model's prefill of the same chunk
    decode_chunk_speculative(params, state, spec, limit, cfg, w, draft_params, draft_cfg) -> (state, spec)
                                                               with n-gram or draft-model drafts

The state is the `DecodeState` of `jaxgen.generate`, its cache a `PagedCache`. The scheduler
(`jaxgen.inference.scheduler`) decides what to run and the engine runs it through these functions;
per-request values are arrays, so nothing a request asks for recompiles them. `slot_row` builds a
slot's row on the host.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference import scoring, speculative
from jaxgen.inference.decode import FINISH_LENGTH, MAX_STOPS, RUNNING, DecodeState, bucket, decode_loop, row_history
from jaxgen.inference.sampling import MAX_SPECULATIVE, MAX_STOP_SEQUENCE, SamplingArrays, SamplingConfig
from jaxgen.model import lora
from jaxgen.model.paged import PagedCache, page_bytes


@flax.struct.dataclass
class SlotRow:
    """One slot's row of every per-row array of the decode state: where its decoding starts or resumes."""

    logits: jax.Array  # (V,) the distribution of the next token
    position: jax.Array  # () int32, the position the next token takes
    generated: jax.Array  # () int32, tokens generated so far (seeded draws are keyed by it)
    max_new: jax.Array  # () int32
    stop_seqs: jax.Array  # (MAX_STOPS, MAX_STOP_SEQUENCE) int32, right-aligned, -1 padded
    recent: jax.Array  # (MAX_STOP_SEQUENCE,) int32, the last generated tokens (-1 before any)
    seen: jax.Array  # (V,) bool, tokens in the prompt or the output
    counts: jax.Array  # (V,) int32, occurrences in the output
    grammar: jax.Array  # () int32, its state in the engine's grammar table (0: unconstrained)
    sampling: SamplingArrays  # rows of one
    adapter: jax.Array | None = None  # () int32, its slot in the LoRA bank (0: none); None without a bank


def slot_row(logits, prompt: list[int], tokens: list[int], c: SamplingConfig, stops, cfg: ModelConfig,
             grammar_state: int = 0) -> SlotRow:  # fmt: skip
    """The row of a sequence that has its prompt and `tokens` in the cache (none yet, or those it had
    when it was preempted): the penalties' state, the stop window and the draw index as if it had
    decoded without a break; `grammar_state`, its constraint's state after `tokens`."""
    v = cfg.vocab_size
    stop_seqs, recent, seen, counts = row_history(prompt, tokens, stops, MAX_STOP_SEQUENCE, v)
    return SlotRow(
        logits=logits, position=np.int32(len(prompt) + len(tokens)), generated=np.int32(len(tokens)),
        max_new=np.int32(min(c.max_new_tokens, cfg.max_seq_len)),  # the context ends it first anyway
        stop_seqs=stop_seqs, recent=recent, seen=seen, counts=counts, grammar=np.int32(grammar_state),
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack([c], v)),
    )  # fmt: skip


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
        grammar=jnp.zeros((b,), jnp.int32), grammar_table=jnp.zeros((1, v), jnp.int32),
        sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack([idle] * b, v)), cache=cache,
        adapter=jnp.zeros((b,), jnp.int32) if serve.max_loras else None,  # each slot's LoRA (multi-LoRA serving)
    )  # fmt: skip


def set_tables(state: DecodeState, page_table, capacity) -> DecodeState:
    """Every slot's pages (B, M) and capacity in tokens (B,), as the host's `PageTables` hold them."""
    return state.replace(cache=state.cache.replace(page_table=page_table, capacity=capacity))


def prefill_inputs(seq: list[int], start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, positions and targets (each token's next, 0 past the end) (1, C) of `seq[start:start + n]`,
    padded (position -1) to a power of two."""
    c = bucket(n, minimum=16)
    tokens = np.zeros((1, c), np.int32)
    positions = np.full((1, c), -1, np.int32)
    targets = np.zeros((1, c), np.int32)
    tokens[0, :n] = seq[start : start + n]
    positions[0, :n] = np.arange(start, start + n)
    nxt = seq[start + 1 : start + n + 1]
    targets[0, : len(nxt)] = nxt
    return tokens, positions, targets


def prefill_chunk(params, state: DecodeState, slot, tokens, positions, last, cfg: ModelConfig, adapter=None):
    """One chunk of one slot's sequence: tokens, positions (1, C), padding at -1. Returns the state and
    the next-token logits (V,) after the token at index `last` of the chunk. `adapter`: () int32, the
    sequence's slot in the params' LoRA bank (None without a bank)."""
    state, x = _prefill_hidden(params, state, slot, tokens, positions, cfg, adapter)
    logits = model.lm_head(params, jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1), cfg)[0, 0]
    return state, logits


def prefill_chunk_scored(params, state: DecodeState, slot, tokens, positions, last, targets, cfg: ModelConfig, top,
                         adapter=None):  # fmt: skip
    """`prefill_chunk`, and the scores (1, C) of `targets` (1, C): each chunk token's next token, for the
    prompt's log-probabilities (the head runs over the chunk in blocks, `jaxgen.inference.scoring`)."""
    state, x = _prefill_hidden(params, state, slot, tokens, positions, cfg, adapter)
    logits = model.lm_head(params, jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1), cfg)[0, 0]
    return state, logits, scoring.score_hidden(params, x, targets, cfg, top)


def _prefill_hidden(params, state: DecodeState, slot, tokens, positions, cfg: ModelConfig, adapter=None):
    params = lora.for_rows(params, None if adapter is None else jnp.reshape(adapter, (1,)))
    cache, x = _prefill_pool(params, state.cache, state.cache, slot, tokens, positions, cfg)
    return state.replace(cache=cache), x


def _prefill_pool(params, pool: PagedCache, tables: PagedCache, slot, tokens, positions, cfg: ModelConfig):
    """One slot's chunk through `params` into `pool`, addressed by `tables`' page tables (the target's:
    the draft model's pool has none of its own). Returns the pool on those tables and hidden states."""
    sub = pool.replace(page_table=tables.page_table[slot][None], capacity=tables.capacity[slot][None])
    x, sub = model.hidden_states(params, tokens, positions, sub, cfg=cfg)
    return _on_tables(sub, tables).constrain(), x


def activate(state: DecodeState, slot, row: SlotRow) -> DecodeState:
    """Slot `slot` starts decoding from `row`."""
    return state.replace(
        logits=state.logits.at[slot].set(row.logits), positions=state.positions.at[slot].set(row.position),
        done=state.done.at[slot].set(False), finish=state.finish.at[slot].set(RUNNING),
        generated=state.generated.at[slot].set(row.generated), max_new=state.max_new.at[slot].set(row.max_new),
        stop_seqs=state.stop_seqs.at[slot].set(row.stop_seqs), recent=state.recent.at[slot].set(row.recent),
        seen=state.seen.at[slot].set(row.seen), counts=state.counts.at[slot].set(row.counts),
        grammar=state.grammar.at[slot].set(row.grammar),
        sampling=jax.tree.map(lambda a, r: a.at[slot].set(r[0]), state.sampling, row.sampling),
        adapter=None if state.adapter is None else state.adapter.at[slot].set(row.adapter),
    )  # fmt: skip


def set_grammar_table(state: DecodeState, table) -> DecodeState:
    """The engine's grammar table (S, V) int32 (`structured.GrammarPool`): every slot's constraint at once."""
    return state.replace(grammar_table=table)


def retire(state: DecodeState, slot) -> DecodeState:
    """Slot `slot` stops (finished, stopped by a string, cancelled or preempted); it runs as padding."""
    return state.replace(done=state.done.at[slot].set(True), finish=state.finish.at[slot].set(FINISH_LENGTH))


def decode_chunk(params, state: DecodeState, limit, cfg: ModelConfig) -> DecodeState:
    """Up to `limit` decode steps for every active slot, into buffers that start at column 0."""
    state = decode_loop(params, state.replace(step=jnp.int32(0), limit=limit), cfg)
    return state.replace(cache=state.cache.constrain())


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
    """Pages in the pool: `serve.num_pages`, or as many as `serve.kv_memory_gb` holds (with a draft model,
    a page of each pool)."""
    per_page = page_bytes(cfg, serve.page_size, serve.cache_dtype)
    if draft_cfg is not None:
        per_page += page_bytes(draft_cfg, serve.page_size, serve.cache_dtype)
    return serve.num_pages or int(serve.kv_memory_gb * 2**30 // per_page)


def init_spec(cfg: ModelConfig, serve: ServeConfig, draft_cfg: ModelConfig | None = None, num_pages: int = 0,
              max_pages: int = 0) -> speculative.SpecState:  # fmt: skip
    """Every slot's speculative state; with `draft_cfg`, the draft model's page pool: as many pages as the
    target's and addressed by the same page tables (a slot's page p holds the same positions in both)."""
    draft_cache = None
    if draft_cfg is not None:
        draft_cache = PagedCache.init(draft_cfg, num_pages, serve.page_size, serve.slots, max_pages, serve.cache_dtype)
        draft_cache = draft_cache.constrain()
    size = history_size(max_pages * serve.page_size)
    return speculative.SpecState.init([[0]] * serve.slots, [0] * serve.slots, size, draft_cache)


def activate_spec(spec: speculative.SpecState, slot, history, length, num_spec) -> speculative.SpecState:
    """Slot `slot` speculates with `num_spec` drafts a step (0: not at all) over `history` (S,) int32,
    its prompt and output so far (`length` tokens); its draft cache (if any) holds all of them."""
    missing = None if spec.missing is None else spec.missing.at[slot].set(False)
    return spec.replace(
        history=spec.history.at[slot].set(history), length=spec.length.at[slot].set(length),
        num_spec=spec.num_spec.at[slot].set(num_spec), missing=missing,
    )  # fmt: skip


def _on_tables(pool: PagedCache, tables: PagedCache) -> PagedCache:
    """`pool` addressed by `tables`' page tables (the host pushes only the target's)."""
    return pool.replace(page_table=tables.page_table, capacity=tables.capacity)


def prefill_draft_chunk(draft_params, spec, cache: PagedCache, slot, tokens, positions, draft_cfg: ModelConfig):
    """The draft model's prefill of the chunk `prefill_chunk` ran (tokens, positions (1, C)) for `slot`,
    into its own pool on `cache`'s page tables: the draft then proposes from the whole sequence."""
    draft_cache, _ = _prefill_pool(draft_params, spec.draft_cache, cache, slot, tokens, positions, draft_cfg)
    return spec.replace(draft_cache=draft_cache)


def decode_chunk_speculative(params, state: DecodeState, spec, limit, cfg: ModelConfig, w: int, draft_params=None,
                             draft_cfg: ModelConfig | None = None):  # fmt: skip
    """`decode_chunk` with up to W drafts a step for the slots that ask (`jaxgen.inference.speculative`):
    n-gram drafts, or the draft model's (`draft_params`, its pool in `spec.draft_cache`). A slot's tokens
    fill columns 0.. of the buffers; the chunk ends early when a slot might not have room for another
    step. The spec's counters count this chunk only."""
    spec = spec.replace(
        proposed=jnp.zeros_like(spec.proposed), accepted=jnp.zeros_like(spec.accepted),
        target_steps=jnp.zeros_like(spec.target_steps),
    )  # fmt: skip
    if draft_params is not None:
        spec = spec.replace(draft_cache=_on_tables(spec.draft_cache, state.cache))
    state = state.replace(step=jnp.int32(0), limit=limit)
    state, spec = speculative.speculative_loop(
        params, state, spec, cfg, w, draft_params=draft_params, draft_cfg=draft_cfg, base=state.generated
    )
    if spec.draft_cache is not None:
        spec = spec.replace(draft_cache=spec.draft_cache.constrain())
    return state.replace(cache=state.cache.constrain()), spec
