"""The serving engine: continuous batching over a paged KV cache, with prefix caching and preemption.

    engine = Engine(params, cfg, tokenizer, ServeConfig(slots=16, kv_memory_gb=1.0))
    request = engine.submit("Once upon a time", SamplingConfig(max_new_tokens=64))
    engine.run_until_idle()            # or engine.start() for a background thread (the HTTP server)
    request.result()                   # a Completion, as Generator.generate returns

One step: schedule -> execute -> update. The scheduler (`jaxgen.inference.scheduler`, no device call)
plans admissions, prefill chunks, preemptions and the decode set; the engine runs the plan through the
jitted device steps (`jaxgen.inference.steps`) and tells the scheduler what ran and what finished. A
failure that concerns one request fails it alone; a failed device step fails those in flight and
rebuilds the device state. Outputs depend neither on what else runs nor on preemption: per-slot settings,
seeded draws keyed by (seed, token index) as in `Generator`, and a readmitted sequence resumes exactly.
Speculating requests draft by n-gram lookup or with `Engine(..., draft=(params, cfg))`, a smaller model
whose KV pages lie in a pool of their own on the target's page tables (`jaxgen.inference.speculative`).
Between steps, `update_params` swaps the weights in (nothing recompiles; sequences in flight are
recomputed on them, the prefix cache emptied) and `sleep` / `wake_up` free and allocate the decode state
and page pool again (reinforcement learning: docs/serving.md).
With `serve.max_loras` > 0 the params hold a bank of that many LoRA adapter slots (`jaxgen.model.lora.Bank`):
`load_lora` writes one into a slot (no recompilation; `update_lora` rewrites it in place), `submit(...,
lora=name)` runs a request with it, and rows with different adapters share every batch
(`jaxgen.inference.adapters`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ConfigError, ModelConfig, ServeConfig
from jaxgen.inference import decode, speculative, steps
from jaxgen.inference import structured as grammar
from jaxgen.inference.adapters import LoraError, LoraRegistry, read_adapter_folder
from jaxgen.inference.budget import check_serving
from jaxgen.inference.decode import Completion, HostRows
from jaxgen.inference.pages import PagePolicy, PagePool
from jaxgen.inference.requests import LIVE, EngineClosed, Request, RequestFailed, Status, check_limits
from jaxgen.inference.sampling import SamplingConfig, check_prompt, per_prompt
from jaxgen.inference.scheduler import PrefillChunk, Scheduler, StepOutput, StepPlan, Tables, call_shape
from jaxgen.inference.stats import EngineStats
from jaxgen.model import lora
from jaxgen.sharding import with_mesh
from jaxgen.tokenizer import Tokenizer

__all__ = ["LIVE", "Engine", "EngineAsleep", "EngineClosed", "Request", "RequestFailed", "Status"]
log = logging.getLogger(__name__)


class EngineAsleep(EngineClosed):
    """The engine sleeps (`Engine.sleep`: its KV cache freed) and admits no new request until `wake_up()`."""


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(
        self, params, cfg: ModelConfig, tokenizer: Tokenizer, serve: ServeConfig = ServeConfig(), mesh=None,
        draft: tuple | None = None,
    ):  # fmt: skip
        # draft=(params, cfg): a smaller model with the same tokenizer drafts for speculating requests
        self.draft_params, self.draft_cfg = None, None
        if draft is not None:
            self.draft_cfg = speculative.check_draft(draft[1], cfg)
        check_serving(cfg, serve, self.draft_cfg, mesh)  # ConfigError before anything is allocated or compiled
        check_deterministic(cfg, serve, draft, mesh)
        self.params = model.decode_params(params, serve.slots, cfg)  # see model.decode_params
        self._to_decode = None  # update_params' jitted layout conversion
        self.cfg, self.tokenizer, self.serve = cfg, tokenizer, serve
        self.loras = LoraRegistry(serve.max_loras)  # adapter names -> slots of the params' bank
        if serve.max_loras:
            self.params = _with_empty_bank(self.params, cfg, serve, mesh)
        if draft is not None:
            self.draft_params = model.decode_params(draft[0], serve.slots)
        num_pages, z = steps.pool_pages(cfg, serve, self.draft_cfg), serve.page_size
        ahead = 2 if serve.overlap else 1  # chunks a sequence may run before the host hears of them
        policy = PagePolicy(num_pages, z, serve.slots, cfg.max_seq_len, serve.chunk_steps, serve.prefix_caching, ahead)
        self.scheduler, self.max_pages = Scheduler(policy, serve.prefill_chunk), policy.max_pages
        self.compilations = 0
        self.grammars = grammar.GrammarPool(cfg.vocab_size)  # the slots' constraints (the device has a copy)
        self.constraints = grammar.Constraints(tokenizer, cfg.vocab_size)  # structured output's automata
        self.stats = EngineStats(
            serve.slots, queue_length=self.queue_length, running_slots=lambda: len(self.scheduler.running()),
            cache_pages_in_use=lambda: self.pool.in_use(), cache_pages_total=lambda: self.pool.usable,
        )  # fmt: skip
        self._jit_steps(mesh)
        init = self._jit(steps.init_state, mesh, static=(0, 1, 2, 3))  # jitted: the pool is made in its shardings
        self.state = init(cfg, serve, num_pages, self.max_pages)
        self._new_state = lambda: init(cfg, serve, num_pages, self.max_pages)  # wake_up()
        init_spec = self._jit(steps.init_spec, mesh, static=(0, 1, 2, 3, 4))
        self._new_spec = lambda: init_spec(cfg, serve, self.draft_cfg, num_pages, self.max_pages)
        self.spec = self._new_spec()  # speculative decoding's per-slot state (and the draft model's pool)
        self.retiring = np.zeros(serve.slots, bool)  # slots to stop, sent with the next call that changes rows
        self._compile_row_programs()
        self._in_flight = None  # serve.overlap: (outputs, sequences) of the decode chunk whose results wait
        self.lock = threading.Lock()  # guards the scheduler (submit and cancel come from other threads)
        self.wake = threading.Condition(self.lock)
        self._thread, self._stop = None, False  # the background thread, if started
        self.accepting = True  # False once drain() began: submit raises EngineClosed
        self.asleep = False  # between sleep() and wake_up(): no device state, submit raises EngineAsleep
        self._exclusive = threading.RLock()  # held by step(); update_params, sleep, wake_up run between steps
        for module in serve.lora_modules:  # "NAME=FOLDER"
            self.load_lora_folder(*module.split("=", 1))

    def _compile_row_programs(self) -> None:
        """Compiles the two small per-request programs only some requests reach (penalties or a bias, speculation)
        by running them on slot 0, idle, with what an idle slot holds: a request asking for them compiles
        nothing (test_sampling_work)."""
        v = self.cfg.vocab_size
        self.state = self._set_wide(self.state, np.int32(0), np.zeros(v, bool), np.zeros(v, np.int32),
                                    np.zeros(v, np.float32))  # fmt: skip
        history = steps.spec_history(self.max_pages * self.serve.page_size, [0])
        self.spec = self._activate_spec(self.spec, np.int32(0), *history, np.int32(0))

    @property
    def pool(self) -> PagePool:
        """The page pool (free pages, reference counts, prefix cache)."""
        return self.scheduler.policy.pool

    @property
    def slots(self) -> list[Request | None]:
        return self.scheduler.slots

    @property
    def waiting(self):
        return self.scheduler.waiting

    def _jit(self, fn, mesh, donate=(), static=()) -> Callable:
        """`fn` jitted (`static`: argument names, or positions), each trace counted in `compilations` and, with
        its compile seconds and cache hits, by name in `stats` (/metrics' jaxgen_compiles_total)."""
        names = tuple(s for s in static if isinstance(s, str))
        nums = tuple(s for s in static if isinstance(s, int))
        jitted = jax.jit(decode.counted(self, fn, self.stats), static_argnames=names, static_argnums=nums,
                         donate_argnums=donate)  # fmt: skip
        return self.stats.attributed(fn.__name__, with_mesh(jitted, mesh))

    def _jit_steps(self, mesh) -> None:
        """The device steps, jitted with the state donated (each trace counted in `compilations`)."""

        def jit(fn, donate=0, static=()):
            return self._jit(fn, mesh, donate, (static,) if isinstance(static, str) else static)

        self._set_tables, self._activate_spec = jit(steps.set_tables), jit(steps.activate_spec)
        self._set_grammar, self._set_wide = jit(steps.set_grammar_table), jit(steps.set_wide)
        self._admit_rows = jit(steps.admit_rows, (1, 2), ("cfg", "top", "draft_cfg"))
        self._chunk = jit(steps.decode_chunk, 1, "cfg")
        self._spec_chunk = jit(steps.decode_chunk_speculative, (1, 2), ("cfg", "w", "draft_cfg"))
        self._write_slot = jit(lora.write_slot)  # the bank donated: a slot is written in place

    # --- requests ----------------------------------------------------------------------------------

    def check(self, prompt: list[int], c: SamplingConfig) -> None:
        """Raises SamplingError / PageError for a request this engine can never run, before queueing."""
        prompt = check_prompt(prompt, self.cfg.vocab_size, self.cfg.max_seq_len)
        c.check_for_model(self.cfg.vocab_size)
        check_limits(c, self._stops(c), self.serve.max_logprobs)
        self.scheduler.check(len(prompt), c.max_new_tokens)  # PageError
        self.automaton(c)  # a constraint that does not compile fails here (then it is cached)

    def automaton(self, c: SamplingConfig) -> grammar.Automaton | None:
        """The token automaton of `c.structured` (None when free), compiled once per constraint."""
        return self.constraints.automaton(c.structured)

    # --- LoRA adapters (multi-LoRA serving) -----------------------------------------------------------

    def load_lora(self, name: str, adapters: dict, scale: float = 1.0, replace: bool = False) -> None:
        """Loads adapters ({target: {"a_..": (L, *in, r), "b_..": (L, r, *out)}}, `jaxgen.model.lora`'s layout)
        as `name`, their product scaled by `scale` (alpha / rank), into a free slot of the bank: a jitted write,
        nothing recompiles. LoraError (a ValueError) when it does not fit: no free slot (serve.max_loras), a
        rank above serve.max_lora_rank, a target the bank lacks, shapes of another model, a NaN weight, a name
        in use. `replace`: a loaded `name` is replaced at once (its slot reused when no running request holds
        it); on any error the old adapter stays loaded as it was."""
        entry = self._bank_entry(name, adapters, scale, "load")
        with self._exclusive:  # no step runs meanwhile (it would read the donated bank), nor another load
            with self.lock:
                ref = self.loras.reserve(name, self._lora_slots_in_use(), replace)
                if replace and name in self.loras.loaded:  # the swap is atomic: no request sees its slot half-new
                    self._write_entry(ref.slot, entry)
                    self.loras.add(ref)
                    return
            self._write_entry(ref.slot, entry)
            with self.lock:
                self.loras.add(ref)  # requests may name it from now on

    def update_lora(self, name: str, adapters: dict, scale: float = 1.0) -> None:
        """New weights for the loaded adapter `name` (reinforcement learning's LoRA-only swap), written into its
        slot by `load_lora`'s jitted write with the bank donated: in place, nothing recompiles, the base and the
        other slots untouched. As `update_params`: sequences in flight are preempted and recomputed on the new
        weights, the prefix cache emptied. LoraNotFound when `name` is not loaded; LoraError when it does not fit."""
        entry = self._bank_entry(name, adapters, scale, "update")
        with self._exclusive:  # no step reads the bank meanwhile; an unload cannot free the slot under us
            with self.lock:
                ref = self.loras.resolve(name)
            self._preempt_all()
            self._write_entry(ref.slot, entry)

    def _bank_entry(self, name: str, adapters: dict, scale: float, verb: str):
        """The bank slot's contents for `adapters` (host arrays), or LoraError saying why they do not fit."""
        bank = lora.bank_of(self.params)
        if bank is None:
            raise LoraError("this engine serves no LoRA adapters: start it with serve.max_loras > 0")
        try:
            return lora.bank_entry(adapters, scale, bank)
        except ValueError as e:
            raise LoraError(f"cannot {verb} lora_name={name!r}: {e}") from None

    def _write_entry(self, slot: int, entry) -> None:
        """The jitted write of `entry` into bank slot `slot`, the bank donated. The caller holds `_exclusive`."""
        written = self._write_slot(lora.bank_of(self.params), np.int32(slot), decode.upload(entry))
        self.params = lora.with_bank(self.params, written)

    def load_lora_folder(self, name: str, folder, replace: bool = False) -> None:
        """`load_lora` of a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`); with
        `replace`, the folder is read and checked before the loaded `name` is replaced."""
        with self.lock:
            if name in self.loras.loaded and not replace:  # before reading the folder
                raise LoraError(f"lora_name={name!r} is loaded already: unload it first (or load it in place)")
        adapters, scale = read_adapter_folder(folder, self.cfg)
        self.load_lora(name, adapters, scale, replace)

    def unload_lora(self, name: str) -> None:
        """New requests cannot name `name` any more (LoraNotFound if not loaded); requests already using it
        finish with it, and its slot is reused only once they are done."""
        with self.lock:
            self.loras.remove(name)

    def lora_names(self) -> list[str]:
        """The adapters loaded, in load order."""
        with self.lock:
            return self.loras.names()

    def _lora_slots_in_use(self) -> set[int]:
        live = [*self.scheduler.waiting, *self.scheduler.prefilling, *self.scheduler.slots]
        return {r.lora.slot for r in live if r is not None and r.lora is not None}

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt, checked as Generator.encode_prompts checks them."""
        return [decode.encode_prompt(self.tokenizer, p, self.cfg, f"prompt {i}") for i, p in enumerate(prompts)]

    def _stops(self, c: SamplingConfig) -> list[tuple[int, ...]]:
        return decode.stop_sequences(c, self.tokenizer.eos_ids)

    def submit(
        self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(), *, prompt_index: int = 0,
        on_update: Callable[[Request], None] | None = None, lora: str | None = None,
    ) -> list[Request]:  # fmt: skip
        """Queues sampling.n sequences for one prompt; returns their Requests (checked first).

        Raises SamplingError / PageError for a request that can never run, EngineClosed when the
        engine is shutting down, LoraNotFound when `lora` names no loaded adapter (None: the base model).
        `on_update` is called from the engine thread after each chunk and once more when the sequence ends,
        however it ends (finished, cancelled or failed)."""
        ids = decode.encode_prompt(self.tokenizer, prompt, self.cfg)
        with self.lock:
            self.loras.resolve(lora)  # an unknown name fails before any other check
        self.check(ids, sampling)
        requests = [
            Request(ids, decode.sample_config(sampling, s), prompt_index, s, on_update, t_submit=time.perf_counter())
            for s in range(sampling.n)
        ]  # fmt: skip
        with self.wake:
            if not self.accepting:
                raise EngineClosed("the engine is shutting down: no new requests are admitted")
            if self.asleep:
                raise EngineAsleep("the engine is asleep (its KV cache is freed): retry after wake_up()")
            ref = self.loras.resolve(lora)  # again, with the lock held until queued: an unload cannot slip between
            for r in requests:
                r.lora = ref
            self.scheduler.add(requests)
            self.stats.submitted(len(requests))
            self.wake.notify()
        return requests

    def cancel(self, request: Request) -> None:
        """Stops a request (a client went away); its slot and pages are freed at the next step."""
        with self.wake:
            self.scheduler.cancel(request)
            self.wake.notify()

    def generate(self, prompts, sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
                 lora: str | list[str | None] | None = None) -> list[Completion]:  # fmt: skip
        """Like Generator.generate, on the engine: every prompt queued at once, results in order. `lora`: the
        adapter of every prompt, or one per prompt (None: the base model)."""
        configs = per_prompt(sampling, len(prompts))
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        requests = [
            r for i, (p, c, a) in enumerate(zip(prompts, configs, loras, strict=True))
            for r in self.submit(p, c, prompt_index=i, lora=a)
        ]  # fmt: skip
        if self._thread is None:
            self.run_until_idle()
        return [r.result() for r in requests]

    def metrics(self) -> dict[str, float]:
        """Every statistic as a dict (the same figures /metrics exports from `stats.registry`)."""
        return self.stats.snapshot()

    # --- weights swapped in place, sleep and wake (reinforcement learning, docs/serving.md) -------------

    def update_params(self, params, *, donate: bool = False) -> None:
        """Replaces the weights between steps, without recompiling. `params`: a pytree of the structure,
        shapes and dtypes the engine was built with, in the training layout (stacked layers) or the decode
        layout (`model.decode_params`); laid out for decoding as at construction and placed in the current
        weights' shardings. A mismatch raises ValueError naming the first leaf that differs, before
        anything changes. Sequences in flight are preempted and recomputed on the new weights, keeping the
        tokens (and log-probabilities) they emitted; the prefix cache is emptied, so no page computed with
        the old weights is read again. Copies: the engine holds one copy of the weights in its layout (the
        per-layer slices, output-major matrices); `donate=True` hands the caller's arrays over where the
        layout keeps them (decode-layout params: no copy at all), and the caller must then neither change
        nor donate them; by default the engine shares no buffer with the caller (a trainer may donate its
        params to its next step)."""
        new = self._checked_params(params, donate)
        with self._exclusive:
            self._preempt_all()
            bank = lora.bank_of(self.params)  # the LoRA adapters stay loaded (multi-LoRA serving)
            self.params = new if bank is None else lora.with_bank(new, bank)  # the old weights are freed

    def _checked_params(self, params, donate: bool):
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
                raise ValueError(f"update_params: params{name} is {seen}; the engine holds {held}")
        if not donate:  # one program lays them out into new buffers in the engine's shardings (no aliasing)
            if self._to_decode is None:  # made once: compiled at the first swap of each layout, then reused
                shardings = jax.tree.map(lambda x: x.sharding, current)
                self._to_decode = jax.jit(to_decode, out_shardings=shardings)
            return self._to_decode(params)
        return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), to_decode(params), current)

    def _preempt_all(self) -> None:
        """Every sequence in a slot back to the queue (recomputed later, its tokens kept); the prefix cache
        emptied. The caller holds `_exclusive`."""
        self._in_flight = None  # its tokens were not emitted yet: they are recomputed (on the new weights)
        with self.lock:
            preemptions = self.scheduler.preempt_all()
            self.pool.clear_cache()  # every page is idle now: none stays cached
        self._retire_preempted(StepPlan(preemptions=tuple(preemptions)))

    def sleep(self) -> None:
        """Frees the device memory of the decode state, the KV page pool above all (and the draft model's
        pool), until `wake_up()`; the weights stay. Sequences in flight are preempted (recomputed after
        `wake_up()`, their tokens kept) and the prefix cache emptied; queued requests wait; `submit`
        raises EngineAsleep (a 503 from the server) while the engine sleeps."""
        with self._exclusive:
            if self.asleep:
                return
            self._preempt_all()
            for x in jax.tree.leaves((self.state, self.spec)):
                if not x.is_deleted():
                    x.delete()
            self.asleep = True

    def _ended_asleep(self) -> bool:
        """Queued sequences cancelled or failed while the engine sleeps (the thread ends them)."""
        return any(r.status not in LIVE for r in self.scheduler.waiting)

    def wake_up(self) -> None:
        """Allocates the decode state and the page pool again (compiled at construction: nothing compiles)
        and runs what was queued."""
        with self._exclusive:
            if not self.asleep:
                return
            self.state, self.spec = self._new_state(), self._new_spec()
            self.retiring[:] = False
            self.grammars = grammar.GrammarPool(self.cfg.vocab_size)  # the device's table is empty again
            self.scheduler.policy.tables.changed = True
            self.asleep = False
        with self.wake:
            self.wake.notify()

    # --- the thread --------------------------------------------------------------------------------

    def idle(self) -> bool:
        """No request queued or in a slot (the results of a chunk still in flight, if any, belong to sequences
        that ended: a sequence ends only once its last chunk's results are taken)."""
        return self.scheduler.idle()

    def queue_length(self) -> int:
        return self.scheduler.queue_length()

    def run_until_idle(self) -> None:
        while not self.idle():
            if self.asleep:
                raise EngineAsleep("the engine is asleep with requests queued: call wake_up() to run them")
            self.step()

    @property
    def running(self) -> bool:
        """True while the background engine thread serves requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        """Runs the engine in a background thread until `stop()`. The engine is ready from now on: a program
        compiled later counts as "after_ready" in /metrics (a request waited for it)."""
        self.stats.ready = True
        self._stop = False
        self._thread = threading.Thread(target=self._serve_forever, name="jaxgen-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.wake:
            self._stop = True
            self.wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def drain(self, grace_s: float = 0.0, reason: str = "the server is shutting down") -> None:
        """Admits nothing more, fails what has not started decoding, lets running sequences finish for
        up to `grace_s` seconds, then fails the rest: every request ends (its on_update is called)."""
        with self.wake:
            self.accepting = False
            self.scheduler.fail_queued(reason)
            self.wake.notify()
        deadline = time.monotonic() + grace_s
        while self.running and not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.wake:
            self.scheduler.fail_all(reason)
            self.wake.notify()
        if not self.running:  # no thread to end them: end them here
            with self._exclusive:
                self._settle()
            self._drop_ended()

    def _serve_forever(self) -> None:
        try:
            while True:
                with self.wake:
                    while (self.idle() or (self.asleep and not self._ended_asleep())) and not self._stop:
                        self.wake.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # step() handles errors itself; anything here is a bug: say so, fail all
            log.exception("the engine thread died")
            self.accepting = False
            self._recover(f"the engine stopped: {type(e).__name__}: {e}")
            raise

    # --- one step: schedule, execute, update ----------------------------------------------------------

    def step(self) -> None:
        """One step: the scheduler's plan, its prefill chunks, its preempted slots retired, one decode
        chunk. A failure that concerns one request fails that request alone; a failed device step fails
        the sequences in flight (their cache is lost), rebuilds the device state and goes on with the queue.
        Nothing runs while the engine is asleep."""
        with self._exclusive:
            if self.asleep:
                self._drop_ended()  # cancelled or failed while asleep: they end now, nothing else runs
            else:
                self._step()

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._drop_ended()
        with self.lock:
            plan = self.scheduler.schedule()
        prefilled = self._run_prefills(plan)
        try:
            self._retire_preempted(plan)
            if prefilled and plan.decode:
                self._decode_chunk(plan)
            else:
                self._settle()
        except Exception as e:
            self._failed_step(None, "decode", e)
        self._drop_ended()
        self.stats.count("busy_seconds", time.perf_counter() - t0)

    def _admit(self) -> None:
        with self.lock:
            self.scheduler.admit()

    def _push_tables(self, tables: Tables | None) -> None:
        """The host's page tables to the device, when the plan changed them."""
        if tables is not None:
            self.state = self._set_tables(self.state, *tables)

    def _take_retiring(self) -> np.ndarray:
        """The slots to stop (B,) bool, sent with the call about to run, and none pending after it."""
        retiring, self.retiring = self.retiring, np.zeros_like(self.retiring)
        return retiring

    def _run_prefills(self, plan: StepPlan) -> bool:
        """The plan's prefill chunks: each prompt-scored one in a call of its own, then all the others in one call
        (a chunk may read prefix pages registered by one before it in the plan: the scored ones never read the
        prefix cache, and within a call each layer writes before it reads). False when a call failed (its
        chunks and those after it do not count as run)."""
        ran: list[PrefillChunk] = []
        scored = [c for c in plan.prefills if c.request.wants_prompt_scores]
        plain = [c for c in plan.prefills if not c.request.wants_prompt_scores]
        calls = [[c] for c in scored] + ([plain] if plain else [])
        try:
            self._push_tables(plan.prefill_tables)
            for call in calls:
                self._prefill_call(call)
                ran.extend(call)
        except Exception as e:
            rest = [c for c in plan.prefills if not any(c is d for d in ran)]
            failed = rest[0] if rest else None
            with self.lock:
                self.scheduler.update(StepOutput(tuple(ran), failed, tuple(rest[1:])))
            self._failed_step(failed.request if failed else None, "prefill", e)
            return False
        with self.lock:
            self.scheduler.update(StepOutput(tuple(ran)))
        for c in ran:  # the prompt only (scored): done once it is in the cache
            if c.last and c.request.sampling.max_new_tokens == 0 and c.request.status == Status.RUNNING:
                self._finish(c.request, "length")
        return True

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
        options = dict(cfg=self.cfg, draft_params=self.draft_params, draft_cfg=self.draft_cfg)
        r = chunks[0].request
        if r.wants_prompt_scores:  # one chunk: its tokens' next tokens scored
            c = chunks[0]
            targets = np.zeros((1, columns), np.int32)
            nxt = r.sequence[c.start + 1 : c.start + c.length + 1]
            targets[0, : len(nxt)] = nxt
            self.state, self.spec, scores = self._admit_rows(
                *args, targets=targets, top=self.serve.max_logprobs, **options
            )
            r.take_prompt_scores(jax.device_get(scores), c.start, c.length)
        else:
            self.state, self.spec = self._admit_rows(*args, **options)
        for c, a in zip(chunks, admitted, strict=True):
            if c.took_pages:
                self.stats.prefix_lookup(c.looked_up, c.hits)
            self.stats.prefilled(c.length, recomputed=c.recompute)
            if a.activate:
                self._started(c.request, c.slot)

    def compile_prefill(self, rows: int, columns: int) -> None:
        """Compiles the prefill call of `rows` x `columns` (`jaxgen.inference.precompile`) by running it on padding
        rows, which write only the null page and start nothing."""
        with self._exclusive:
            packed = steps.pack_rows([], rows, columns, self.cfg, bool(self.serve.max_loras))
            self.state, self.spec = self._admit_rows(
                self.params, self.state, self.spec, packed, self._take_retiring(), cfg=self.cfg,
                draft_params=self.draft_params, draft_cfg=self.draft_cfg,
            )  # fmt: skip

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
        return dataclasses.replace(admitted, prompt_len=len(r.prompt), sampling=r.sampling,
                                   stops=tuple(self._stops(r.sampling)), grammar=start)  # fmt: skip

    def _started(self, r: Request, slot: int) -> None:
        """What a slot that started decoding needs beyond its row: the penalties' or bias' state, the n-gram
        history of a speculating request (each a call of its own: few requests ask)."""
        if steps.needs_wide(r.sampling):
            wide = steps.wide_row(r.sequence, len(r.prompt), r.sampling, self.cfg.vocab_size)
            self.state = self._set_wide(self.state, np.int32(slot), *wide)
        n = r.sampling.num_speculative_tokens
        if n:
            history = steps.spec_history(self.max_pages * self.serve.page_size, r.sequence)
            self.spec = self._activate_spec(self.spec, np.int32(slot), *history, np.int32(n))

    def _retire_preempted(self, plan: StepPlan) -> None:
        for p in plan.preemptions:
            self.retiring[p.slot] = True
            if p.requeued:
                self.stats.preempted()
            else:  # it was cancelled or failed meanwhile: it ends
                self._end(p.request, dropped=True)

    def _decode_chunk(self, plan: StepPlan) -> None:
        """Dispatches one decode chunk and starts fetching what it gives; with `serve.overlap` the results of the
        chunk before are taken while this one runs (one chunk of lag), else this one's at once."""
        self._push_tables(plan.decode_tables)
        limit = jnp.int32(self.serve.chunk_steps)
        w = speculative.window([plan.draft_tokens])
        if w:
            self.state, self.spec, out = self._spec_chunk(
                self.params, self.state, self.spec, limit, self._take_retiring(), cfg=self.cfg, w=w,
                draft_params=self.draft_params, draft_cfg=self.draft_cfg,
            )  # fmt: skip
        else:
            self.state, out = self._chunk(self.params, self.state, limit, self._take_retiring(), cfg=self.cfg)
        for x in out:
            x.copy_to_host_async()
        chunk = (out, plan.decode)
        if self.serve.overlap:
            chunk, self._in_flight = self._in_flight, chunk
        if chunk is not None:
            self._take_chunk(*chunk)

    def _settle(self) -> None:
        """Takes the results of the chunk still in flight (`serve.overlap`), if any."""
        chunk, self._in_flight = self._in_flight, None
        if chunk is not None:
            self._take_chunk(*chunk)

    def _take_chunk(self, out: tuple, decode: tuple[Request, ...]) -> None:
        """A decode chunk's results on the host: each running sequence's new tokens, the finished ones ended."""
        fields = jax.device_get(out)
        host = HostRows(*fields[: len(HostRows.names())])
        if len(fields) > len(host.names()):  # a speculative chunk's counters
            self.stats.speculated(*(int(x.sum()) for x in fields[len(host.names()) :]))
        now = time.perf_counter()
        for r in decode:
            if r.status == Status.RUNNING:
                try:
                    self._take_tokens(r, host, now)
                except Exception as e:  # host-side work of one request (decoding, its callback): it alone fails
                    log.exception("request failed after a decode chunk")
                    with self.lock:
                        self.scheduler.fail(r, f"{type(e).__name__}: {str(e)[:200]}")

    def _take_tokens(self, r: Request, host: HostRows, now: float) -> None:
        """One sequence's new tokens from the chunk's host copy; ends the sequence when it is done."""
        slot = r.slot
        new = r.take(host, slot)
        if new and r.t_first is None:
            r.t_first = now
            self.stats.first_token(now - r.t_submit)
        self.stats.count("generated_tokens_total", len(new))
        stopped = decode.stop_string_cut(self.tokenizer, r.tokens, r.sampling.stop) is not None
        if host.done[slot] or stopped:
            self._finish(r, "stop" if stopped else decode.FINISH_NAMES.get(int(host.finish[slot]), "length"))
        elif r.on_update is not None:  # the text so far, for those who watch (decoded again at the end)
            r.text = self.tokenizer.decode(r.tokens)
            r.on_update(r)

    # --- ending -------------------------------------------------------------------------------------

    def _finish(self, r: Request, reason: str) -> None:
        r.complete(self.tokenizer, self._stops(r.sampling), reason)
        self.stats.finished(r.t_submit, r.t_first, r.t_done, len(r.tokens))
        with self.lock:
            freed = self.scheduler.update(StepOutput(finished=(r,)))
        self._end(r, *freed)

    def _end(self, r: Request, slot: int = -1, dropped: bool = False) -> None:
        """Every sequence ends here, however it ends (the scheduler freed its pages and slot): the slot
        retired, the client told, waiters woken; a `dropped` one (cancelled or failed) counted once."""
        if dropped:
            self.stats.ended(r.status)
        if slot >= 0:
            self.retiring[slot] = True  # sent with the next call that changes rows
        r.end()

    def _drop_ended(self) -> None:
        """Ends the sequences cancelled or failed since the last look."""
        with self.lock:
            ended = self.scheduler.take_ended()
        for r, slot in ended:
            self._end(r, slot, dropped=True)

    def _failed_step(self, r: Request | None, what: str, e: Exception) -> None:
        log.exception("engine %s step failed", what)
        message = f"the engine's {what} step failed: {type(e).__name__}: {str(e)[:200]}"
        if r is not None:
            with self.lock:
                self.scheduler.fail(r, message)
        if r is None or self._state_lost():
            self._recover(message + " (this request was in flight; retry it)")
        self._drop_ended()

    def _state_lost(self) -> bool:
        """True when a failed donated call consumed the device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((self.state, self.spec)))

    def _recover(self, message: str) -> None:
        """Fails every sequence in flight and rebuilds the device state, the page pool and the page
        tables from scratch (a failed donated call may have consumed them); waiting requests stay queued."""
        with self.lock:
            in_flight = self.scheduler.reset(message)
        self.state = steps.init_state(self.cfg, self.serve, self.pool.num_pages, self.max_pages)
        self.grammars = grammar.GrammarPool(self.cfg.vocab_size)
        self.spec = self._new_spec()
        self.retiring[:] = False
        self._in_flight = None
        for r in in_flight:
            self.stats.ended(Status.FAILED)
            self._end(r)


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


def check_deterministic(cfg: ModelConfig, serve: ServeConfig, draft, mesh) -> None:
    """ConfigError, before anything compiles, for serving settings deterministic mode cannot keep bitwise."""
    if not cfg.deterministic:
        return
    why = "with model.deterministic=true"
    refused = [
        (serve.page_size % cfg.attention_block != 0, "serve.page_size", serve.page_size,
         f"a multiple of model.attention_block={cfg.attention_block} (key blocks align to pages)"),
        (serve.cache_dtype != "float32", "serve.cache_dtype", serve.cache_dtype, "float32"),
        (serve.quantize != "none", "serve.quantize", serve.quantize, "none"),
        (draft is not None, "draft", "a draft model", "none (speculative decoding)"),
        (serve.max_loras > 0, "serve.max_loras", serve.max_loras, "0 (no adapters)"),
        (mesh is not None and mesh.size > 1, "mesh", f"{mesh.size if mesh else 1} devices", "one device"),
    ]  # fmt: skip
    for bad, field, value, allowed in refused:
        if bad:
            raise ConfigError(f"{field}={value} is not allowed {why}: {allowed}")
