"""The engine's executor: what lives on the device, and the jitted steps (`jaxgen.inference.steps`) run to a plan.

    runner = Runner(params, cfg, serve, mesh, draft, stats, automaton)
    out = runner.execute(plan)      # StepOutput: the chunks that ran, the decode chunk's tokens that came back

The runner holds the weights (and the LoRA bank), the decode state with the page pool, speculative decoding's
state and the device's copy of the grammar table, and changes them outside a step too: weight updates, bank
writes, sleep and wake, rebuilding after a failure. It decides nothing (the scheduler plans) and tells no client
(the core does): `execute` returns what ran as a `StepOutput`, a failure included, and never raises.

One step: the plan's page tables, its prefill chunks in one call (`steps.admit_rows`; each prompt-scored chunk in
a call of its own), then one decode chunk. With `serve.overlap` the decode chunk is dispatched before the
previous chunk's results are read, and those are what the output carries (one chunk of lag); slots to stop go
with the next call that changes rows (`retiring`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import executables, model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.executables import Program, describe_mesh
from jaxgen.inference import decode, speculative, steps
from jaxgen.inference import structured as grammar
from jaxgen.inference.decode import HostRows
from jaxgen.inference.scheduler import PrefillChunk, StepOutput, StepPlan, Tables, call_shape, prefill_calls
from jaxgen.inference.sequence import Sequence
from jaxgen.inference.spec_gate import SpecGate
from jaxgen.model import eagle, lora
from jaxgen.sharding import with_mesh


class Runner:
    """The device side of the engine; see the module docstring."""

    def __init__(self, params, cfg: ModelConfig, serve: ServeConfig, mesh, draft, stats,
                 automaton: Callable, eos_ids, num_pages: int, max_pages: int):  # fmt: skip
        # draft: (params, cfg) of a model that drafts for speculating requests, its cfg checked; automaton:
        # a request's settings -> its constraint's token automaton (None when free); eos_ids: the tokenizer's
        self.cfg, self.serve, self.stats, self.automaton, self.eos_ids = cfg, serve, stats, automaton, eos_ids
        self.max_pages = max_pages
        self.params = model.decode_params(params, serve.slots, cfg)  # see model.decode_params
        if serve.max_loras:
            self.params = _with_empty_bank(self.params, cfg, serve, mesh)
        self.draft_params, self.draft_cfg, self.head = None, None, None
        if isinstance(draft, eagle.Head):  # an EAGLE head: its pool is the spec's draft cache
            self.head = draft
        elif draft is not None:
            self.draft_params, self.draft_cfg = model.decode_params(draft[0], serve.slots, draft[1]), draft[1]
        self._to_decode = None  # update_params' jitted layout conversion
        self.gate = SpecGate()  # whether a chunk speculates, per batch size, from measured tokens/s
        self._clock, self._last_results = time.perf_counter, 0.0
        self.compilations = 0
        self.grammars = self._new_grammars()  # the slots' constraints (the device has a copy)
        self.mesh = mesh
        # the programs this engine's settings decide, loaded in threads from the store's list of an earlier start
        head = None if self.head is None else (self.head.cfg, self.head.layers)
        settings = f"{cfg!r}|{serve.for_programs!r}|{self.draft_cfg!r}|{head!r}|{num_pages}|{max_pages}"
        self.group = f"engine|{settings}|{describe_mesh(mesh)}"
        if executables.in_use():
            executables.current().prefetch(self.group)
        self._jit_steps(mesh)
        init = self._jit(steps.init_state, mesh, static=(0, 1, 2, 3))  # jitted: the pool is made in its shardings
        self._new_state = lambda: init(cfg, serve.for_programs, num_pages, max_pages)
        init_spec = self._jit(steps.init_spec, mesh, static=(0, 1, 2, 3, 4, 5))
        pool_cfg, taps = (self.draft_cfg, 0) if self.head is None else (self.head.cfg, len(self.head.layers))
        self._new_spec = lambda: init_spec(cfg, serve.for_programs, pool_cfg, num_pages, max_pages, taps)
        self.state = self._new_state()
        self.spec = self._new_spec()  # speculative decoding's per-slot state (and the draft model's pool)
        self.retiring = np.zeros(serve.slots, bool)  # slots to stop, sent with the next call that changes rows
        self.in_flight = None  # serve.overlap: (outputs, sequences) of the decode chunk whose results wait
        self._in_flight_speculated = False  # whether that chunk is a speculative one
        # the standard rule: the sequence decoding in each slot whose pending residual lives in `spec`
        self._residual_owner: dict[int, Sequence] = {}
        self._compile_row_programs()

    # --- the jitted steps ---------------------------------------------------------------------------

    def _jit(self, fn, mesh, donate=(), static=()) -> Callable:
        """`fn` jitted (`static`: argument names, or positions), each trace counted in `compilations` and, with
        its compile seconds and cache hits, by name in `stats` (/metrics' jaxgen_compiles_total); its
        executables loaded from the store of `jaxgen.executables` where one is in use (no trace then)."""
        names = tuple(s for s in static if isinstance(s, str))
        nums = tuple(s for s in static if isinstance(s, int))
        jitted = Program(decode.counted(self, fn, self.stats), fn.__name__, describe_mesh(mesh), self.group,
                         static_argnames=names, static_argnums=nums, donate_argnums=donate)  # fmt: skip
        return self.stats.attributed(fn.__name__, with_mesh(jitted, mesh))

    def _jit_steps(self, mesh) -> None:
        """The device steps, jitted with the state donated (each trace counted in `compilations`)."""

        def jit(fn, donate=0, static=()):
            return self._jit(fn, mesh, donate, (static,) if isinstance(static, str) else static)

        self._set_tables, self._activate_spec = jit(steps.set_tables), jit(steps.activate_spec)
        self._set_grammar, self._set_wide = jit(steps.set_grammar_table), jit(steps.set_wide)
        self._admit_rows = jit(steps.admit_rows, (1, 2), ("cfg", "top", "draft_cfg"))
        self._chunk = jit(steps.decode_chunk, 1, "cfg")
        self._spec_chunk = jit(steps.decode_chunk_speculative, (1, 2), ("cfg", "w", "draft_cfg", "rule"))
        self._set_residual = jit(steps.set_residual)
        self._plain_chunk = jit(steps.decode_chunk_unspeculated, (1, 2), "cfg")
        self._write_slot = jit(lora.write_slot)  # the bank donated: a slot is written in place

    def _compile_row_programs(self) -> None:
        """Compiles the small per-request programs only some requests reach (penalties or a bias, speculation, the
        standard rule's restored residual) by running them on slot 0, idle, with what an idle slot holds: a
        request asking for them compiles nothing (test_sampling_work)."""
        v = self.cfg.vocab_size
        self.state = self._set_wide(self.state, np.int32(0), np.zeros(v, bool), np.zeros(v, np.int32),
                                    np.zeros(v, np.float32))  # fmt: skip
        history = steps.spec_history(self.max_pages * self.serve.page_size, [0])
        self.spec = self._activate_spec(self.spec, np.int32(0), *history, np.int32(0))
        if self.spec.residual is not None:  # the standard rule: a preempted sequence's pending residual restored
            self.spec = self._set_residual(self.spec, np.int32(0), np.zeros(v, np.float32))

    def compile_prefill_ahead(self, shapes: list[tuple[int, int]], workers: int, done=lambda: None,
                              scored_columns: list[int] = ()) -> None:  # fmt: skip
        """Compiles (or loads) the prefill calls of the (rows, columns) `shapes`, and the prompt-scored calls (one
        row) of `scored_columns`, in `workers` threads without running them (XLA compiles without holding the
        GIL), into `jaxgen.executables`' store (without one in use they would be compiled for nothing: jit keeps
        no executable it did not compile itself). `done()` after each."""
        program = self._admit_rows.jitted  # the Program under the mesh and stats wrappers
        retiring = np.zeros_like(self.retiring)  # what `_take_retiring` gives when none is pending
        rows_of = functools.partial(steps.pack_rows, [], cfg=self.cfg, lora_bank=bool(self.serve.max_loras))
        options = dict(cfg=self.cfg, **self._drafter)
        scoring = dict(top=self.serve.max_logprobs)  # as `_prefill_call` scores a prompt's chunk

        def one(shape, scored=False):
            extra = dict(targets=np.zeros((1, shape[1]), np.int32), **scoring) if scored else {}
            with self.stats.calling("admit_rows"), contextlib.ExitStack() as stack:
                if self.mesh is not None:
                    stack.enter_context(jax.set_mesh(self.mesh))
                program.compile(self.params, self.state, self.spec, rows_of(*shape), retiring, **extra, **options)
            done()

        calls = [(s, False) for s in shapes] + [((1, c), True) for c in scored_columns]
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
            list(pool.map(lambda call: one(*call), calls))

    def compile_prefill(self, rows: int, columns: int) -> None:
        """Compiles the prefill call of `rows` x `columns` (`jaxgen.inference.precompile`) by running it on padding
        rows, which write only the null page and start nothing."""
        packed = steps.pack_rows([], rows, columns, self.cfg, bool(self.serve.max_loras))
        self.state, self.spec = self._admit_rows(
            self.params, self.state, self.spec, packed, self._take_retiring(), cfg=self.cfg,
            **self._drafter,
        )  # fmt: skip

    @property
    def _drafter(self) -> dict:
        """The drafter's arguments of the prefill and speculative calls."""
        return dict(draft_params=self.draft_params, draft_cfg=self.draft_cfg, head=self.head)

    # --- one step -----------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs `plan`: its prefill chunks, its preempted slots stopped, one decode chunk. Returns what ran and
        the tokens of the decode chunk whose results came back (this one's, or the one before with
        `serve.overlap`); a failure as `error` (what ran before it stands)."""
        ran: list[PrefillChunk] = []
        failure = None
        try:
            self._push_tables(plan.prefill_tables)
            for call in prefill_calls(plan.prefills, self.serve.slots):
                self._prefill_call(call)
                ran.extend(call)
        except Exception as e:
            failure = e
        for p in plan.preemptions:  # after the prefills: a slot started and preempted in one plan ends stopped
            self.retiring[p.slot] = True
        self.keep_residuals([(p.request, p.slot) for p in plan.preemptions if p.requeued])
        if failure is not None:
            rest = [c for c in plan.prefills if not any(c is d for d in ran)]
            return StepOutput(tuple(ran), rest[0] if rest else None, tuple(rest[1:]), error=failure, phase="prefill")
        try:
            taken = self._decode_chunk(plan) if plan.decode else self.settle()
        except Exception as e:
            return StepOutput(tuple(ran), error=e, phase="decode")
        return StepOutput(tuple(ran), **taken)

    def _push_tables(self, tables: Tables | None) -> None:
        """The host's page tables to the device, when the plan changed them."""
        if tables is not None:
            self.state = self._set_tables(self.state, *tables)

    def _take_retiring(self) -> np.ndarray:
        """The slots to stop (B,) bool, sent with the call about to run, and none pending after it."""
        retiring, self.retiring = self.retiring, np.zeros_like(self.retiring)
        return retiring

    def _prefill_call(self, chunks: list[PrefillChunk]) -> None:
        """One call of `steps.admit_rows`: the chunks' tokens into their slots' pages, the slots whose prefill they
        complete started (their constraint, speculation and vocabulary-wide state set up beside it)."""
        rows, columns = call_shape([c.length for c in chunks], self.serve.slots)
        admitted = [self._admitted(c) for c in chunks]
        packed = steps.pack_rows(admitted, rows, columns, self.cfg, bool(self.serve.max_loras))
        if self.grammars.changed:
            self.state = self._set_grammar(self.state, self.grammars.table)
            self.grammars.changed = False
        args = (self.params, self.state, self.spec, packed, self._take_retiring())
        options = dict(cfg=self.cfg, **self._drafter)
        r = chunks[0].request
        if r.wants_prompt_scores:  # one chunk: its tokens' next tokens scored
            c = chunks[0]
            targets = np.zeros((1, columns), np.int32)
            nxt = r.sequence[c.start + 1 : c.start + c.length + 1]
            targets[0, : len(nxt)] = nxt
            self.state, self.spec, scores = self._admit_rows(*args, targets=targets, top=self.serve.max_logprobs,
                                                             **options)  # fmt: skip
            r.take_prompt_scores(jax.device_get(scores), c.start, c.length)
        else:
            self.state, self.spec = self._admit_rows(*args, **options)
        for c, a in zip(chunks, admitted, strict=True):
            if c.took_pages:
                self.stats.prefix_lookup(c.looked_up, c.hits)
            self.stats.prefilled(c.length, recomputed=c.recompute)
            if a.activate:
                self._started(c.request, c.slot)

    def _admitted(self, c: PrefillChunk) -> steps.Admitted:
        """A chunk for `steps.pack_rows`; when it completes the prompt, what its slot decodes from: the prompt and
        the tokens so far (none, or those kept by a preemption), its constraint's state after them."""
        r = c.request
        adapter = 0 if r.lora is None else r.lora.slot  # every chunk runs with the sequence's adapter
        activate = c.last and r.sampling.max_new_tokens > 0
        admitted = steps.Admitted(c.slot, r.sequence, c.start, c.length, activate, adapter=adapter)
        if not activate:
            return admitted
        automaton = self.automaton(r.sampling)
        offset = self.grammars.assign(c.slot, automaton)
        start = 0 if automaton is None else offset + automaton.walk(r.tokens)  # where a preempted row was
        stops = tuple(decode.stop_sequences(r.sampling, self.eos_ids))
        return dataclasses.replace(admitted, prompt_len=len(r.prompt), sampling=r.sampling, stops=stops,
                                   grammar=start)  # fmt: skip

    def _started(self, r: Sequence, slot: int) -> None:
        """What a slot that started decoding needs beyond its row: the penalties' or bias' state, the n-gram
        history of a speculating request (each a call of its own: few requests ask)."""
        if steps.needs_wide(r.sampling):
            wide = steps.wide_row(r.sequence, len(r.prompt), r.sampling, self.cfg.vocab_size)
            self.state = self._set_wide(self.state, np.int32(slot), *wide)
        n = r.sampling.num_speculative_tokens
        if n:
            history = steps.spec_history(self.max_pages * self.serve.page_size, r.sequence)
            self.spec = self._activate_spec(self.spec, np.int32(slot), *history, np.int32(n))
        if self.spec.residual is not None:
            self._residual_owner[slot] = r
            if r.residual is not None:  # preempted with a residual draw pending: it is drawn as it would have been
                self.spec = self._set_residual(self.spec, np.int32(slot), r.residual)
                r.residual = None

    def keep_residuals(self, preempted: list[tuple[Sequence, int]]) -> None:
        """The standard rule: each preempted (sequence, slot)'s pending residual, as it was at the tokens the
        sequence keeps, into `Sequence.residual` (`_started` puts it back), fetched in one transfer; call it
        before the slots' next call. With a chunk in flight, the sequences keep the tokens from before it (its own
        are recomputed), so the residual is the one it started from."""
        if self.spec.residual is None:
            return
        owned = [(r, slot) for r, slot in preempted if self._residual_owner.pop(slot, None) is r]
        if not owned:
            return
        in_flight = self.in_flight is not None and self._in_flight_speculated
        source = self.spec.residual_before if in_flight else self.spec.residual
        rows = np.asarray(jax.device_get(source[np.asarray([slot for _, slot in owned])]))
        for (r, _), row in zip(owned, rows, strict=True):
            r.residual = row if row.any() else None

    def drop_residuals(self) -> None:
        """No pending residual is kept by the sequences preempted next (new weights: they go on with the new
        model's distribution)."""
        self._residual_owner.clear()

    def _decode_chunk(self, plan: StepPlan) -> dict:
        """Dispatches one decode chunk and starts fetching what it gives; returns the results of the chunk before
        with `serve.overlap` (this one runs meanwhile), else this one's (`_take`)."""
        self._push_tables(plan.decode_tables)
        limit = jnp.int32(self.serve.chunk_steps)
        w = speculative.window([plan.draft_tokens])
        rows = len(plan.decode)
        # None: the warm-up, which reaches every program; the standard rule speculates in every chunk
        gated = self.serve.spec_gate and self.gate is not None and self.serve.spec_rule == "exact"
        speculate = bool(w) and (not gated or self.gate.choose(rows))
        compiled = self.compilations
        if speculate:
            self.state, self.spec, out = self._spec_chunk(
                self.params, self.state, self.spec, limit, self._take_retiring(), cfg=self.cfg, w=w,
                rule=self.serve.spec_rule, **self._drafter,
            )  # fmt: skip
        elif w:  # rows asked for drafts, but at this batch size speculation does not pay (spec_gate)
            self.state, self.spec, out = self._plain_chunk(
                self.params, self.state, self.spec, limit, self._take_retiring(), cfg=self.cfg
            )  # fmt: skip
        else:
            self.state, out = self._chunk(self.params, self.state, limit, self._take_retiring(), cfg=self.cfg)
        for x in out:
            x.copy_to_host_async()
        # what the gate learns from this chunk once its results are in (nothing when it compiled a program)
        timed = (rows, speculate, self._clock()) if w and gated and compiled == self.compilations else None
        chunk = (out, plan.decode, timed)
        if self.serve.overlap:
            chunk, self.in_flight = self.in_flight, chunk
            self._in_flight_speculated = speculate
        return self._take(chunk)

    def settle(self) -> dict:
        """The results of the chunk still in flight (`serve.overlap`), if any, as `execute`'s output fields."""
        chunk, self.in_flight = self.in_flight, None
        return self._take(chunk)

    def _take(self, chunk) -> dict:
        """`_take` of a chunk, its tokens per second told to the speculation gate (from its dispatch, or the
        results before it if later: with `serve.overlap` the chunks run back to back)."""
        taken, counters = _take(chunk, self.stats)
        if chunk is not None and chunk[2] is not None and self.gate is not None:
            rows, speculated, dispatched = chunk[2]
            now = self._clock()
            if counters is not None:  # kept tokens: a token per target step, and the accepted drafts
                tokens = counters[0] + counters[2]
            else:  # a token per row and step (rows finishing early: a little less)
                tokens = rows * int(taken["host"].step)
            self.gate.observe(rows, speculated, tokens, now - max(dispatched, self._last_results))
            self._last_results = now
        return taken

    def drop_in_flight(self) -> None:
        """Forgets the chunk in flight: its tokens were not emitted, and its sequences are recomputed."""
        self.in_flight = None

    # --- outside a step: weights, adapters, sleep, recovery ------------------------------------------

    def write_bank_entry(self, slot: int, entry) -> None:
        """The jitted write of `entry` into LoRA bank slot `slot`, the bank donated (in place)."""
        written = self._write_slot(lora.bank_of(self.params), np.int32(slot), decode.upload(entry))
        self.params = lora.with_bank(self.params, written)

    def compile_bank(self) -> None:
        """Writes zeros into the LoRA bank's first adapter slot (empty at start): compiles the bank's write
        before a load needs it (`precompile`). Without a bank, nothing."""
        bank = lora.bank_of(self.params)
        if bank is not None:
            self.write_bank_entry(1, lora.bank_entry({}, 1.0, bank))

    def set_params(self, new) -> None:
        """New weights from `checked_params`; the LoRA bank stays (see `Engine.update_params`)."""
        bank = lora.bank_of(self.params)  # the LoRA adapters stay loaded (multi-LoRA serving)
        self.params = new if bank is None else lora.with_bank(new, bank)  # the old weights are freed

    def checked_params(self, params, donate: bool):
        """`params` in the decode layout and the current shardings; ValueError for another structure."""
        to_decode = functools.partial(model.decode_params, rows=self.serve.slots, cfg=self.cfg)
        current = lora.without_bank(self.params)  # the weights the caller gives (the LoRA bank is the engine's)
        try:
            got = jax.eval_shape(to_decode, params)  # nothing computed yet
        except Exception as e:
            message = f"update_params: params do not have the model's structure ({type(e).__name__}: {e})"
            raise ValueError(message) from None
        want = dict(jax.tree_util.tree_flatten_with_path(current)[0])
        have = dict(jax.tree_util.tree_flatten_with_path(got)[0])
        for path in [*want, *have]:
            name = jax.tree_util.keystr(path)
            if path not in have or path not in want:
                missing = "missing" if path not in have else "unexpected"
                raise ValueError(f"update_params: params{name} is {missing}: the engine's model has another structure")
            a, b = want[path], have[path]
            if a.shape != b.shape or a.dtype != b.dtype:
                seen, held = f"{b.dtype}{list(b.shape)}", f"{a.dtype}{list(a.shape)}"
                as_decoded = f"laid out for decoding, floats in model.dtype={self.cfg.dtype}"
                raise ValueError(f"update_params: params{name} is {seen} ({as_decoded}); the engine holds {held}")
        if not donate:  # one program lays them out into new buffers in the engine's shardings (no aliasing)
            if self._to_decode is None:  # made once: compiled at the first swap of each layout, then reused
                shardings = jax.tree.map(lambda x: x.sharding, current)
                self._to_decode = jax.jit(to_decode, out_shardings=shardings)
            return self._to_decode(params)
        return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), to_decode(params), current)

    def _new_grammars(self) -> grammar.GrammarPool:
        """An empty table of serve.grammar_states' rows, as `steps.init_state` makes the device's."""
        rows = grammar.table_rows(self.serve.grammar_states, self.cfg.vocab_size)
        return grammar.GrammarPool(self.cfg.vocab_size, rows)

    def compile_grammar(self) -> None:
        """Pushes the (unchanged) grammar table to the device: compiles that program before any constraint
        needs it (`precompile`)."""
        self.state = self._set_grammar(self.state, self.grammars.table)

    def compile_unspeculated(self) -> None:
        """Runs the plain chunk of speculating rows (`spec_gate`) on idle slots, which stop at once: compiles it
        before a batch where speculation does not pay needs it (`precompile`), and forgets the warm-up's figures.
        With the standard rule no such chunk runs: nothing."""
        self.gate = SpecGate()
        if self.serve.spec_rule != "exact":
            return
        self.state, self.spec, _ = self._plain_chunk(
            self.params, self.state, self.spec, jnp.int32(0), self._take_retiring(), cfg=self.cfg
        )  # fmt: skip

    def free(self) -> None:
        """Frees the decode state's device memory, the page pool above all (`Engine.sleep`); the weights stay."""
        for x in jax.tree.leaves((self.state, self.spec)):
            if not x.is_deleted():
                x.delete()

    def rebuild(self) -> None:
        """A fresh decode state, page pool, speculative state and grammar table (after `free`, or a failure that
        may have consumed the donated state): nothing compiles."""
        self.state, self.spec = self._new_state(), self._new_spec()
        self.grammars = self._new_grammars()  # the device's table is empty again
        self.retiring[:] = False
        self.in_flight = None
        self._residual_owner.clear()  # a preempted sequence's own `residual` is restored when it starts again

    def state_lost(self) -> bool:
        """True when a failed donated call consumed the device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((self.state, self.spec)))


def _take(chunk, stats) -> tuple[dict, tuple | None]:
    """A decode chunk's results on the host (`StepOutput.host` and `decoded`, or none), and a speculative
    chunk's counters summed over slots (target steps, drafts, accepted; None for a plain chunk)."""
    if chunk is None:
        return {}, None
    out, decoded, _ = chunk
    fields = jax.device_get(out)
    n = len(HostRows.names())
    counters = None
    if len(fields) > n:
        counters = tuple(int(x.sum()) for x in fields[n:])
        stats.speculated(*counters)
    return {"host": HostRows(*fields[:n]), "decoded": decoded}, counters


def _with_empty_bank(params: dict, cfg: ModelConfig, serve: ServeConfig, mesh) -> dict:
    """Decode params (per-layer) with an all-zero LoRA bank of serve.max_loras slots of rank serve.max_lora_rank
    in each layer (replicated on a mesh: each row gathers its own slot)."""
    if cfg.lora.rank or any("lora" in p for p in params["layers"]):
        raise ValueError(
            f"serve.max_loras={serve.max_loras} serves adapters over a base model; these params hold a trained "
            "adapter of their own (model.lora.rank > 0): merge it into the base first (convert.py --merge-lora)"
        )
    dtype = jnp.dtype(cfg.dtype)
    stacked = lora.init_bank(cfg, serve.max_loras, serve.max_lora_rank, dtype)
    layers_ = [jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(cfg.num_layers)]
    if mesh is not None:
        layers_ = jax.device_put(layers_, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return lora.with_bank(params, layers_)
