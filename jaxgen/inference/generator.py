"""Generator: static batches of ragged prompts through the decode core (`jaxgen.inference.decode`), the
static-batch tool beneath `LLM` (jaxgen.inference.llm, the Python front door: start there). Use it
for a fixed batch run start to finish, or to score without a serving engine.

    gen = Generator(params, cfg, tokenizer)
    outs = gen.generate(["def fib(", "import "], SamplingConfig(temperature=0, max_new_tokens=32))
    for update in gen.stream(["def fib("], SamplingConfig(max_new_tokens=64)): ...
    nll = gen.score(["x = "], ["1\n"])

Shapes are bucketed (batch to powers of two, prompt and cache lengths to powers of two >= 16) so a
job with many distinct prompt lengths compiles a handful of programs; `gen.compilations` counts
them. All decode state lives in a `DecodeState` pytree that the jitted loop takes and returns
(donated, so the cache is updated in place).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference import scoring, speculative, structured
from jaxgen.inference.decode import (
    FINISH_LENGTH,
    FINISH_NAMES,
    RUNNING,
    Completion,
    DecodeState,
    HostRows,
    bucket,
    counted,
    decode_loop,
    encode_prompt,
    finish_row,
    padded,
    prefill,
    row_history,
    sample_config,
    stop_sequences,
    stop_string_cut,
    upload,
)
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig, SamplingError, per_prompt
from jaxgen.inference.spec_gate import SpecGate
from jaxgen.inference.structured import pool
from jaxgen.model import eagle
from jaxgen.sharding import with_mesh
from jaxgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
    """How a Generator batches and caches (static: a change compiles new programs)."""

    max_batch: int = 32  # rows decoded together; larger jobs run batch after batch
    chunk_steps: int = 32  # decode steps per jitted chunk, between host checks (stop strings, streaming)
    # float32, bfloat16 (kept as uint16 bits on CPU: updated in place) or int8 (a scale per token and kv head)
    cache_dtype: str = "float32"
    min_cache_len: int = 0  # preallocate at least this many cache slots (a power of two)
    # speculation only where it pays: per batch size, a group of requests speculates while measured tokens/s of
    # speculating groups reach 0.95 of plain decoding's (jaxgen.inference.spec_gate); False: whenever a row asks
    spec_gate: bool = True
    # how drafts are checked: "exact", token for token what plain decoding gives; "standard", standard
    # speculative sampling (exact in distribution, keeps more sampled drafts; jaxgen.inference.speculative).
    # "standard" speculates in every chunk (a plain chunk cannot take over its pending residual draw)
    spec_rule: str = "exact"

    def __post_init__(self):
        if self.spec_rule not in speculative.RULES:
            raise SamplingError(
                f"spec_rule={self.spec_rule!r} is not allowed: {', '.join(map(repr, speculative.RULES))}", "spec_rule"
            )
        if self.cache_dtype not in ("float32", "bfloat16", "int8"):
            raise SamplingError(
                f"cache_dtype={self.cache_dtype!r} is not allowed: float32, bfloat16, int8", "cache_dtype"
            )
        for name in ("max_batch", "chunk_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SamplingError(f"{name}={value!r} is not allowed: a positive integer", name)
        if not isinstance(self.min_cache_len, int) or self.min_cache_len < 0:
            raise SamplingError(
                f"min_cache_len={self.min_cache_len!r} is not allowed: an integer >= 0", "min_cache_len"
            )


class Generator:
    """Holds params, config, tokenizer and the jitted programs; every call is a pure function of arrays.

    `Generator(params, cfg, tokenizer, GeneratorConfig(max_batch=64))`; keyword overrides of the
    config's fields (`Generator(params, cfg, tokenizer, chunk_steps=16)`) are the same thing.
    `draft=(draft_params, draft_cfg)`: a smaller model with the same tokenizer that proposes the drafts
    of requests with `num_speculative_tokens` > 0 (without it, n-gram lookup does); or `draft=head`, an
    EAGLE-3 head trained for this model (`jaxgen.model.eagle.Head`).
    """

    def __init__(
        self, params, cfg: ModelConfig, tokenizer: Tokenizer, config: GeneratorConfig = GeneratorConfig(), mesh=None,
        draft: tuple | None = None, **overrides,
    ):  # fmt: skip
        config = dataclasses.replace(config, **overrides)
        self.draft_params, self.draft_cfg, self.head = None, None, None
        if isinstance(draft, eagle.Head):
            self.head = eagle.check_head(draft, cfg)
        elif draft is not None:
            self.draft_cfg = speculative.check_draft(draft[1], cfg)
            self.draft_params = model.decode_params(draft[0], config.max_batch, draft[1])
        # per-layer weights, output-major from 8 rows on: see model.decode_params
        self.params = model.decode_params(params, config.max_batch, cfg)
        self.cfg, self.tokenizer, self.config = cfg, tokenizer, config
        self.max_batch, self.chunk_steps, self.cache_dtype = config.max_batch, config.chunk_steps, config.cache_dtype
        self.min_cache_len = config.min_cache_len
        self.compilations = 0  # programs traced (each trace is one XLA compilation)
        self.constraints = structured.Constraints(tokenizer, cfg.vocab_size)  # structured output's automata
        self._table = None  # (automata ids, device table, automata) of the last batch
        # With a mesh, place params with `model.param_shardings`; batch rows and the cache's kv heads
        # follow the sharding rules (jaxgen.sharding) through the constraints in the model and cache.
        jitted_prefill = jax.jit(counted(self, prefill), static_argnames=("cfg", "cache_len", "cache_dtype"))
        self._prefill = with_mesh(jitted_prefill, mesh)
        self._loop = with_mesh(jax.jit(counted(self, decode_loop), static_argnames="cfg", donate_argnums=1), mesh)
        self._spec_loop = with_mesh(
            jax.jit(
                counted(self, speculative.speculative_loop),
                static_argnames=("cfg", "w", "draft_cfg", "rule"),
                donate_argnums=(1, 2),
            ),
            mesh,
        )
        self._prefill_with_head = with_mesh(
            jax.jit(counted(self, speculative.prefill_with_head), static_argnames=("cfg", "cache_len", "cache_dtype")),
            mesh,
        )
        self.gate = SpecGate()  # per batch size: whether a group speculates, from measured tokens/s
        # speculative decoding so far: target steps and drafts proposed and kept, summed over rows
        self.speculation = {"target_steps": 0, "tokens": 0, "proposed": 0, "accepted": 0, "kept_at": np.zeros(8, int)}
        self.scorer = scoring.Scorer(
            cfg, tokenizer, self.max_batch, self.cache_dtype,
            jit=lambda fn, statics: with_mesh(jax.jit(counted(self, fn), static_argnames=statics), mesh),
        )  # fmt: skip

    def prefill(self, tokens, positions, rows, lengths, cache_len: int):
        """The jitted `decode.prefill` on this Generator's params: (cache, next-token logits)."""
        return self._prefill(
            self.params, tokens, positions, rows, lengths, cfg=self.cfg, cache_len=cache_len,
            cache_dtype=self.cache_dtype,
        )  # fmt: skip

    # --- input checks, before any compilation -----------------------------------------------------

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt, checked (SamplingError naming the prompt) before any compilation."""
        return [encode_prompt(self.tokenizer, p, self.cfg, f"prompt {i}") for i, p in enumerate(prompts)]

    # --- generation -------------------------------------------------------------------------------

    def generate(self, prompts, sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig()) -> list[Completion]:
        """Completions for a batch of prompts (ragged), each with its own settings; n per prompt."""
        results: dict[tuple[int, int], Completion] = {}
        for update in self.stream(prompts, sampling):
            for c in update:
                if c.finish_reason:
                    results[(c.prompt_index, c.sample_index)] = c
        return [results[k] for k in sorted(results)]

    def stream(self, prompts, sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig()) -> Iterator[list]:
        """Yields, after each chunk of decode steps, a `Completion` per row so far (finish_reason ''
        while running). Batches larger than `max_batch` rows run one after another."""
        ids = self.encode_prompts(prompts)
        configs = per_prompt(sampling, len(ids))
        for c in configs:
            c.check_for_model(self.cfg.vocab_size)
            self._stops(c)
        automata = [self.automaton(c) for c in configs]  # a bad constraint fails before anything runs
        rows = [(p, s) for p in range(len(ids)) for s in range(configs[p].n)]
        for start in range(0, len(rows), self.max_batch):
            yield from self._stream_group(ids, configs, automata, rows[start : start + self.max_batch])

    def automaton(self, c: SamplingConfig) -> structured.Automaton | None:
        """The token automaton of `c.structured` (None when free), compiled once per constraint."""
        return self.constraints.automaton(c.structured)

    def _sizes(self, ids, configs, group, prompt_idx, speculate: bool = True) -> tuple[int, int, int, int]:
        """A group's static sizes: prompt bucket T, new tokens, cache slots and draft window W (0 when
        not `speculate`: the group decodes as plain requests do)."""
        t = bucket(max(len(ids[p]) for p in prompt_idx))
        # no row can generate past the context, whatever max_new_tokens asks (it ends with "length")
        # (at least 1: the buffers need a column even when every row asks none, max_new_tokens=0)
        longest_new = max(min(max(configs[p].max_new_tokens for p, _ in group), self.cfg.max_seq_len), 1)
        # Slots for the padded prompts plus every new token: the padding (up to the bucket t) takes slots
        # too, so capping at the context length would leave no room when t reaches it.
        cache_len = max(bucket(t + min(longest_new, self.cfg.max_seq_len)), self.min_cache_len)
        w = speculative.window([configs[p].num_speculative_tokens for p, _ in group]) if speculate else 0
        if w:  # every step writes W + 1 slots (rejected drafts' slots are not reused)
            cache_len = max(bucket(speculative.cache_len_needed(t, longest_new, w)), self.min_cache_len)
        return t, longest_new, cache_len, w

    def _stream_group(self, ids, configs, automata, group):
        cfg = self.cfg
        started, compiled = time.perf_counter(), self.compilations  # the group's setup counts in its first chunk
        prompt_idx = sorted({p for p, _ in group})
        b = bucket(len(group), minimum=1)
        p_count = bucket(len(prompt_idx), minimum=1)
        gated = self.config.spec_gate and self.config.spec_rule == "exact"  # "standard": never gated, as in the engine
        t, longest_new, cache_len, w = self._sizes(ids, configs, group, prompt_idx)
        # The gate chooses once for the group (`spec_gate`, its chunks its "chunks"): where speculation does not
        # pay at this batch size, the group runs as plain requests do, from its prefill on (no drafter's
        # prefill, no speculative state, the plain requests' programs). Its setup is part of what a group
        # pays, so a group's choice covers all of it, and a group never switches programs halfway.
        if w and gated and not self.gate.choose(len(group)):
            t, longest_new, cache_len, w = self._sizes(ids, configs, group, prompt_idx, speculate=False)
        tokens, positions, lengths = padded([ids[p] for p in prompt_idx], p_count, t)
        where = {p: i for i, p in enumerate(prompt_idx)}
        batch_rows = group + [group[0]] * (b - len(group))  # filler rows, finished from the start
        rows = np.asarray([where[p] for p, _ in batch_rows], np.int32)
        eagle_start = None
        if w and self.head is not None:  # the head's prefill rides on the target's: the features it taps
            cache, logits, *eagle_start = self._prefill_with_head(
                self.params, self.head, tokens, positions, rows, lengths, cfg=cfg, cache_len=cache_len,
                cache_dtype=self.cache_dtype,
            )  # fmt: skip
        else:
            cache, logits = self.prefill(tokens, positions, rows, lengths, cache_len)
        state = self._init_state(ids, configs, automata, batch_rows, len(group), cache, logits, longest_new)
        prompt_scores = self.scorer.prompt_scores(self.params, ids, configs, prompt_idx)
        stop_at: list[int | None] = [None] * len(group)
        spec = None
        if w:
            spec = self._spec_state(ids, configs, batch_rows, (tokens, positions, rows, lengths), cache_len,
                                    bucket(t + longest_new + w + 1), eagle_start and (*eagle_start, w))  # fmt: skip
        step, made = 0, np.zeros((b,), np.int32)  # tokens of each row so far
        while True:
            state = state.replace(limit=np.int32(min(step + self.chunk_steps, longest_new)))
            if spec is not None:
                state, spec = self._spec_loop(
                    self.params, state, spec, cfg=cfg, w=w, draft_params=self.draft_params,
                    draft_cfg=self.draft_cfg, head=self.head, rule=self.config.spec_rule,
                )  # fmt: skip
            else:
                state = self._loop(self.params, state, cfg=cfg)
            host = HostRows.of(state)
            step = int(host.step)
            new = int((host.generated - made)[: len(group)].sum())
            if gated and compiled == self.compilations:  # plain requests' chunks tell the gate plain's rate too
                self.gate.observe(len(group), spec is not None, new, time.perf_counter() - started)
            made = host.generated
            done = np.pad(self._check_stop_strings(host, configs, group, stop_at), (0, b - len(group)))
            if done.any():
                state = state.replace(done=state.done | done)
            yield self._completions(host, configs, group, stop_at, prompt_scores)
            started, compiled = time.perf_counter(), self.compilations  # (the caller's time between chunks is not)
            if self._table is not None:  # the donated table lives on in the state
                self._table = (*self._table[:1], state.grammar_table, *self._table[2:])
            if np.all(host.done | done):
                if spec is not None:
                    self._count_speculation(spec, int(made[: len(group)].sum()), len(group))
                return

    def _spec_state(self, ids, configs, batch_rows, prompts_in, cache_len: int, history: int, eagle_start=None):
        """The rows' speculative state; with a draft model, its own prefill of the prompts (`prompts_in`:
        `prefill`'s tokens, positions, rows and lengths) into as many slots as the target's; with an EAGLE
        head, `eagle_start` (its cache, the last features, W: `prefill_with_head`)."""
        draft_cache = None
        if self.draft_cfg is not None:
            draft_cache, _ = self._prefill(
                self.draft_params, *prompts_in, cfg=self.draft_cfg, cache_len=cache_len, cache_dtype=self.cache_dtype
            )
        num_spec = [configs[p].num_speculative_tokens for p, _ in batch_rows]
        vocab = self.cfg.vocab_size if self.config.spec_rule == "standard" else 0
        return speculative.SpecState.init([ids[p] for p, _ in batch_rows], num_spec, history, draft_cache,
                                          eagle=eagle_start, vocab=vocab)  # fmt: skip

    def _count_speculation(self, spec, tokens: int, live: int) -> None:
        """Adds a speculating group's counters; `tokens`: those it made."""
        steps, proposed, accepted, kept_at = jax.device_get(
            (spec.target_steps, spec.proposed, spec.accepted, spec.kept_at)
        )  # fmt: skip
        self.speculation["kept_at"] = self.speculation["kept_at"] + kept_at[:live].sum(0)
        self.speculation["target_steps"] += int(steps[:live].sum())
        self.speculation["tokens"] += tokens
        self.speculation["proposed"] += int(proposed[:live].sum())
        self.speculation["accepted"] += int(accepted[:live].sum())

    def speculation_stats(self) -> dict:
        """Speculative decoding so far: drafts kept / proposed, and tokens per target step (per row)."""
        c = self.speculation
        return {
            **c,
            "acceptance_rate": c["accepted"] / c["proposed"] if c["proposed"] else 0.0,
            "tokens_per_step": c["tokens"] / c["target_steps"] if c["target_steps"] else 0.0,
            # by draft position i: the share of target steps that kept drafts 1..i
            "accepted_at": [round(int(n) / c["target_steps"], 4) if c["target_steps"] else 0.0 for n in c["kept_at"]],
        }

    def _init_state(self, ids, configs, automata, batch_rows, live, cache, logits, longest_new) -> DecodeState:
        b, v = len(batch_rows), self.cfg.vocab_size
        alternatives = max(configs[p].logprobs for p, _ in batch_rows)
        stops = [self._stops(configs[p]) for p, _ in batch_rows]
        longest = bucket(max((len(q) for row in stops for q in row), default=1), minimum=4)
        rows = [row_history(ids[p], [], stops[r], longest, v) for r, (p, _) in enumerate(batch_rows)]
        stop_seqs, recent, seen, counts = (np.stack(x) for x in zip(*rows, strict=True))
        row_configs = [sample_config(configs[p], s) for p, s in batch_rows]
        done = (np.arange(b) >= live) | np.asarray([configs[p].max_new_tokens == 0 for p, _ in batch_rows])
        distinct, starts = pool.layout([automata[p] for p, _ in batch_rows])
        host = dict(  # built here and sent in one transfer: each eager jnp op would dispatch on its own
            step=np.int32(0), limit=np.int32(0),
            tokens=np.zeros((b, longest_new), np.int32), logprobs=np.zeros((b, longest_new), np.float32),
            top_ids=np.zeros((b, longest_new, alternatives), np.int32),
            top_logprobs=np.zeros((b, longest_new, alternatives), np.float32),
            positions=np.asarray([len(ids[p]) for p, _ in batch_rows], np.int32),
            done=done, generated=np.zeros((b,), np.int32),
            finish=np.where(done, FINISH_LENGTH, RUNNING).astype(np.int32),
            max_new=np.asarray([configs[p].max_new_tokens for p, _ in batch_rows], np.int32),
            stop_seqs=stop_seqs, recent=recent, seen=seen, counts=counts, grammar=starts,
            sampling=SamplingArrays.stack(row_configs, v),
        )  # fmt: skip
        return DecodeState(**upload(host), grammar_table=self._grammar_table(distinct), logits=logits, cache=cache)

    def _grammar_table(self, distinct):
        """The device table of a batch's automata: the last batch's again when it had the same ones (a job with
        one schema builds and uploads it once; the loop hands the donated table back in its state)."""
        kept = self._table
        if kept is not None and kept[0] == tuple(map(id, distinct)) and not kept[1].is_deleted():
            return kept[1]
        table = pool.stack(distinct, self.cfg.vocab_size)
        placed = jax.tree.leaves(self.params)[0].sharding
        if isinstance(placed, jax.sharding.NamedSharding):  # as the loop hands it back: the next call's key
            table = jax.device_put(table, jax.sharding.NamedSharding(placed.mesh, jax.sharding.PartitionSpec()))
        self._table = (tuple(map(id, distinct)), table, distinct)  # the automata kept alive: ids stay theirs
        return table

    def _check_stop_strings(self, host: HostRows, configs, group, stop_at) -> np.ndarray:
        """Stop strings, on decoded text after each chunk: the output is cut before the string."""
        tokens, generated = host.tokens, host.generated
        newly = np.zeros(len(group), bool)
        for r, (p, _) in enumerate(group):
            if not configs[p].stop or stop_at[r] is not None:
                continue
            if stop_string_cut(self.tokenizer, tokens[r, : int(generated[r])].tolist(), configs[p].stop) is not None:
                stop_at[r] = int(generated[r])
                newly[r] = True
        return newly

    def _completions(self, host: HostRows, configs, group, stop_at, prompt_scores) -> list[Completion]:
        tokens, generated = host.tokens, host.generated
        out = []
        for r, (p, s) in enumerate(group):
            n = int(generated[r]) if stop_at[r] is None else stop_at[r]
            reason = "stop" if stop_at[r] is not None else FINISH_NAMES.get(int(host.finish[r]), "")
            toks = tokens[r, :n].tolist()
            if reason:
                n, text, reason = finish_row(self.tokenizer, toks, configs[p], self._stops(configs[p]), reason)
                toks = toks[:n]
            else:
                text = self.tokenizer.decode(toks)
            alts = host.alternatives(r, 0, n, configs[p].logprobs) if configs[p].logprobs else None
            out.append(Completion(p, s, toks, text, reason, host.logprobs[r, :n].tolist(), alts, *prompt_scores[p]))
        return out

    def _stops(self, c: SamplingConfig) -> list[tuple[int, ...]]:
        return stop_sequences(c, self.tokenizer.eos_ids)

    # --- scoring ----------------------------------------------------------------------------------

    def score(self, prompts, continuations) -> list[dict]:
        """Teacher-forced log-likelihood of each continuation given its prompt.

        Returns per pair: {'logprob': sum, 'tokens': count, 'nll': mean negative log-likelihood per
        token, 'perplexity': exp(nll), 'token_logprobs': [...], 'greedy': whether every continuation
        token is the model's most likely one (as evaluation harnesses ask)}. Same padding rules as generation.
        """
        return self.scorer.score(self.params, prompts, continuations)

    def score_shared(self, prompts, continuations) -> list[dict]:
        """`score`, with each distinct prompt run once: its continuations read its KV cache (a multiple-choice
        question's context runs once for all its endings). The same dicts as `score`, in order."""
        return self.scorer.score_shared(self.params, prompts, continuations)


def generate(
    source, prompts, sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(), *,
    cfg: ModelConfig | None = None, tokenizer: Tokenizer | None = None, **kwargs,
) -> list[Completion]:  # fmt: skip
    """One-shot generation. `source` is a run folder written by train.py (its latest checkpoint), a
    Hugging Face model folder, or params given with their `cfg` and `tokenizer`. kwargs go to `Generator`."""
    if isinstance(source, str | Path):
        from jaxgen.inference.loading import load_model  # the checkpoint reader only when a folder is given

        cfg, tokenizer, source = load_model(source)
    if cfg is None or tokenizer is None:
        raise SamplingError("generate(params, ...) needs cfg= and tokenizer= (or pass a run folder)")
    return Generator(source, cfg, tokenizer, **kwargs).generate(prompts, sampling)
