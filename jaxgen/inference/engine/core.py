"""The serving engine: continuous batching over a paged KV cache, with prefix caching and preemption.

    engine = Engine(params, cfg, tokenizer, ServeConfig(slots=16, kv_memory_gb=1.0))
    request = engine.submit("Once upon a time", SamplingConfig(max_new_tokens=64))
    engine.run_until_idle()            # or engine.start() for a background thread (the HTTP server)
    request.result()                   # a Completion, as Generator.generate returns

One step, as vLLM v1's loop: `plan = scheduler.schedule(); out = runner.execute(plan); update =
scheduler.update(out)`. The scheduler (`jaxgen.inference.scheduler`, no device call) plans admissions, prefill
chunks, preemptions and the decode set, and its update takes the tokens a decode chunk gave, cuts stop strings,
finishes sequences and frees their pages; the runner (`engine.runner`) runs the plan through the jitted device
steps and returns what ran; this core keeps the public API, the thread and drain, and tells the clients. A
failure that concerns one request fails it alone; a failed device step fails those in flight and rebuilds the
device state. Outputs depend neither on what else runs nor on preemption: per-slot settings, seeded draws keyed
by (seed, token index) as in `Generator`, and a readmitted sequence resumes exactly.
Speculating requests draft by n-gram lookup or with `Engine(..., draft=(params, cfg))`, a smaller model
whose KV pages lie in a pool of their own on the target's page tables (`jaxgen.inference.speculative`).
Between steps, `update_params` swaps the weights in (nothing recompiles; sequences in flight are
recomputed on them, the prefix cache emptied) and `sleep` / `wake_up` free and allocate the decode state
and page pool again (reinforcement learning: docs/serving.md).
With `serve.max_loras` > 0 the params hold a bank of that many LoRA adapter slots (`jaxgen.model.lora.Bank`):
`load_lora` writes one into a slot (no recompilation; `update_lora` rewrites it in place), `submit(...,
lora=name)` runs a request with it, and rows with different adapters share every batch (`engine.lora`,
`jaxgen.inference.adapters`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference import decode, speculative, steps
from jaxgen.inference import structured as grammar
from jaxgen.inference.adapters import LoraRegistry
from jaxgen.inference.budget import check_deterministic, check_serving
from jaxgen.inference.decode import Completion
from jaxgen.inference.engine.lora import AdapterControl
from jaxgen.inference.engine.runner import Runner
from jaxgen.inference.pages import PagePolicy, PagePool
from jaxgen.inference.sampling import SamplingConfig, check_prompt, per_prompt
from jaxgen.inference.scheduler import Scheduler, StepPlan, Update
from jaxgen.inference.sequence import LIVE, EngineClosed, Sequence, Status, check_limits
from jaxgen.inference.stats import EngineStats
from jaxgen.model import eagle
from jaxgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineAsleep(EngineClosed):
    """The engine sleeps (`Engine.sleep`: its KV cache freed) and admits no new request until `wake_up()`."""


class Engine(AdapterControl):
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(
        self, params, cfg: ModelConfig, tokenizer: Tokenizer, serve: ServeConfig = ServeConfig(), mesh=None,
        draft: tuple | eagle.Head | None = None,
    ):  # fmt: skip
        # draft=(params, cfg): a smaller model with the same tokenizer drafts for speculating requests; or an
        # EAGLE-3 head trained for this model (its pool of pages beside the target's, as a draft model's)
        head = eagle.check_head(draft, cfg) if isinstance(draft, eagle.Head) else None
        draft_cfg = None if draft is None or head is not None else speculative.check_draft(draft[1], cfg)
        check_serving(cfg, serve, draft_cfg, mesh)  # ConfigError before anything is allocated or compiled
        check_deterministic(cfg, serve, draft, mesh)
        self.cfg, self.tokenizer, self.serve = cfg, tokenizer, serve
        self.loras = LoraRegistry(serve.max_loras)  # adapter names -> slots of the params' bank
        num_pages = steps.pool_pages(cfg, serve, head.cfg if head is not None else draft_cfg)
        ahead = 2 if serve.overlap else 1  # chunks a sequence may run before the host hears of them
        policy = PagePolicy(num_pages, serve.page_size, serve.slots, cfg.max_seq_len, serve.chunk_steps,
                            serve.prefix_caching, ahead)  # fmt: skip
        self.scheduler = Scheduler(policy, serve.prefill_chunk, stopped=self._stopped)
        self.max_pages = policy.max_pages
        self.constraints = grammar.Constraints(tokenizer, cfg.vocab_size)  # structured output's automata
        self.stats = EngineStats(
            serve.slots, queue_length=self.queue_length, running_slots=lambda: len(self.scheduler.running()),
            cache_pages_in_use=lambda: self.pool.in_use(), cache_pages_total=lambda: self.pool.usable,
        )  # fmt: skip
        draft = head if head is not None or draft is None else (draft[0], draft_cfg)
        self.runner = Runner(params, cfg, serve, mesh, draft, self.stats, self.automaton, tokenizer.eos_ids,
                             num_pages, self.max_pages)  # fmt: skip
        self.lock = threading.Lock()  # guards the scheduler (submit and cancel come from other threads)
        self.wake = threading.Condition(self.lock)
        self._thread, self._stop = None, False  # the background thread, if started
        self.accepting = True  # False once drain() began: submit raises EngineClosed
        self.asleep = False  # between sleep() and wake_up(): no device state, submit raises EngineAsleep
        self._exclusive = threading.RLock()  # held by step(); update_params, sleep, wake_up run between steps
        for module in serve.lora_modules:  # "NAME=FOLDER"
            self.load_lora_folder(*module.split("=", 1))

    # --- what the runner holds, as the engine's (tests and LLM read them) -----------------------------

    @property
    def params(self):
        return self.runner.params

    @property
    def state(self):
        return self.runner.state

    @property
    def spec(self):
        return self.runner.spec

    @property
    def grammars(self) -> grammar.GrammarPool:
        return self.runner.grammars

    @property
    def draft_cfg(self) -> ModelConfig | None:
        return self.runner.draft_cfg

    @property
    def compilations(self) -> int:
        """Programs traced (each one XLA compilation) by this engine."""
        return self.runner.compilations

    @property
    def pool(self) -> PagePool:
        """The page pool (free pages, reference counts, prefix cache)."""
        return self.scheduler.policy.pool

    @property
    def slots(self) -> list[Sequence | None]:
        return self.scheduler.slots

    @property
    def waiting(self):
        return self.scheduler.waiting

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

    def _stopped(self, r: Sequence) -> bool:
        """Do a sequence's tokens so far hold one of its stop strings (the scheduler's update asks)?"""
        return decode.stop_string_cut(self.tokenizer, r.tokens, r.sampling.stop) is not None

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt, checked as Generator.encode_prompts checks them."""
        return [decode.encode_prompt(self.tokenizer, p, self.cfg, f"prompt {i}") for i, p in enumerate(prompts)]

    def _stops(self, c: SamplingConfig) -> list[tuple[int, ...]]:
        return decode.stop_sequences(c, self.tokenizer.eos_ids)

    def submit(
        self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(), *, prompt_index: int = 0,
        on_update: Callable[[Sequence], None] | None = None, lora: str | None = None,
    ) -> list[Sequence]:  # fmt: skip
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
            Sequence(ids, decode.sample_config(sampling, s), prompt_index, s, on_update, t_submit=time.perf_counter())
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

    def cancel(self, request: Sequence) -> None:
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
        shapes and dtypes the engine was built with (floats wider than `model.dtype` are cast to it, as at
        construction), in the training layout (stacked layers) or the decode
        layout (`model.decode_params`); laid out for decoding as at construction and placed in the current
        weights' shardings. A mismatch raises ValueError naming the first leaf that differs, before
        anything changes. Sequences in flight are preempted and recomputed on the new weights, keeping the
        tokens (and log-probabilities) they emitted; the prefix cache is emptied, so no page computed with
        the old weights is read again. Copies: the engine holds one copy of the weights in its layout (the
        per-layer slices, output-major matrices); `donate=True` hands the caller's arrays over where the
        layout keeps them (decode-layout params in the engine's dtypes: no copy at all), and the caller must
        then neither change nor donate them; by default the engine shares no buffer with the caller (a
        trainer may donate its params to its next step)."""
        new = self.runner.checked_params(params, donate)
        with self._exclusive:
            self._preempt_all(same_weights=False)
            self.runner.set_params(new)

    def _preempt_all(self, same_weights: bool = True) -> None:
        """Every sequence in a slot back to the queue (recomputed later, its tokens kept); the prefix cache
        emptied. With new weights coming (not `same_weights`), no pending residual draw of speculation's standard
        rule is kept, by these sequences or by those a preemption queued before: they go on with the new
        model's distribution. The caller holds `_exclusive`."""
        with self.lock:
            holding = [(r, r.slot) for r in self.scheduler.slots if r is not None]
        if same_weights:  # before the chunk in flight is dropped: its start is what the sequences resume from
            self.runner.keep_residuals(holding)
        else:
            self.runner.drop_residuals()
        self.runner.drop_in_flight()  # its tokens were not emitted yet: they are recomputed (on the new weights)
        with self.lock:
            preemptions = self.scheduler.preempt_all()
            self.pool.clear_cache()  # every page is idle now: none stays cached
            if not same_weights:
                for r in self.scheduler.waiting:
                    r.residual = None
        for p in preemptions:
            self.runner.retiring[p.slot] = True
        self._preempted(StepPlan(preemptions=tuple(preemptions)))

    def sleep(self) -> None:
        """Frees the device memory of the decode state, the KV page pool above all (and the draft model's
        pool), until `wake_up()`; the weights stay. Sequences in flight are preempted (recomputed after
        `wake_up()`, their tokens kept) and the prefix cache emptied; queued requests wait; `submit`
        raises EngineAsleep (a 503 from the server) while the engine sleeps."""
        with self._exclusive:
            if self.asleep:
                return
            self._preempt_all()
            self.runner.free()
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
            self.runner.rebuild()
            self.scheduler.policy.tables.changed = True
            self.asleep = False
        with self.wake:
            self.wake.notify()

    def compile_prefill_ahead(self, shapes: list[tuple[int, int]], workers: int, done=lambda: None,
                              scored_columns: list[int] = ()) -> None:  # fmt: skip
        """Compiles the prefill calls of `shapes` (and the prompt-scored ones of `scored_columns`) in `workers`
        threads, not run (`Runner.compile_prefill_ahead`); `done()` after each."""
        with self._exclusive:
            self.runner.compile_prefill_ahead(shapes, workers, done, scored_columns)

    def compile_prefill(self, rows: int, columns: int) -> None:
        """Compiles the prefill call of `rows` x `columns` (`jaxgen.inference.precompile`), changing nothing."""
        with self._exclusive:
            self.runner.compile_prefill(rows, columns)

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
        """One step: the scheduler's plan, run by the runner (its prefill chunks, one decode chunk), the outputs
        taken by the scheduler, the clients told. A failure that concerns one request fails that request
        alone; a failed device step fails the sequences in flight (their cache is lost), rebuilds the device
        state and goes on with the queue. Nothing runs while the engine is asleep."""
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
        out = self.runner.execute(plan)
        with self.lock:
            update = self.scheduler.update(out)
        self._preempted(plan)
        self._tell(update)
        if out.error is not None:
            self._failed_step(out.failed.request if out.failed else None, out.phase, out.error)
        self._drop_ended()
        self.stats.count("busy_seconds", time.perf_counter() - t0)

    def _admit(self) -> None:
        with self.lock:
            self.scheduler.admit()

    def _preempted(self, plan: StepPlan) -> None:
        """The plan's preempted sequences (the runner stopped their slots): counted, or ended when they were
        cancelled or failed meanwhile."""
        for p in plan.preemptions:
            if p.requeued:
                self.stats.preempted()
            else:
                self._end(p.request, dropped=True)

    def _tell(self, update: Update) -> None:
        """What the scheduler's update did, told: first tokens and tokens counted, the finished sequences
        completed (their text, stop strings cut) and ended, the others' text streamed to who watches."""
        now = time.perf_counter()
        for r in update.first:
            r.t_first = now
            self.stats.first_token(now - r.t_submit)
        self.stats.count("generated_tokens_total", update.new_tokens)
        for r, reason, slot in update.finished:
            try:
                r.complete(self.tokenizer, self._stops(r.sampling), reason)
            except Exception as e:  # host-side work of one request: it alone fails (its pages are freed)
                log.exception("request failed as it finished")
                r.status, r.error = Status.FAILED, f"{type(e).__name__}: {str(e)[:200]}"
                self._end(r, slot, dropped=True)
                continue
            self.stats.finished(r.t_submit, r.t_first, r.t_done, len(r.tokens))
            self._end(r, slot)
        for r in update.progressed:
            if r.on_update is not None and r.status == Status.RUNNING:
                try:
                    r.text = self.tokenizer.decode(r.tokens)  # the text so far (decoded again at the end)
                    r.on_update(r)
                except Exception as e:
                    self._host_failure(r, e)

    def _host_failure(self, r: Sequence, e: Exception) -> None:
        log.exception("request failed after a decode chunk")
        with self.lock:
            self.scheduler.fail(r, f"{type(e).__name__}: {str(e)[:200]}")

    # --- ending -------------------------------------------------------------------------------------

    def _end(self, r: Sequence, slot: int = -1, dropped: bool = False) -> None:
        """Every sequence ends here, however it ends (the scheduler freed its pages and slot): the slot
        stopped, the client told, waiters woken; a `dropped` one (cancelled or failed) counted once."""
        if dropped:
            self.stats.ended(r.status)
        if slot >= 0:
            self.runner.retiring[slot] = True  # sent with the next call that changes rows
        r.end()

    def _drop_ended(self) -> None:
        """Ends the sequences cancelled or failed since the last look."""
        with self.lock:
            ended = self.scheduler.take_ended()
        for r, slot in ended:
            self._end(r, slot, dropped=True)

    def _failed_step(self, r: Sequence | None, what: str, e: Exception) -> None:
        log.error("engine %s step failed", what, exc_info=e)
        message = f"the engine's {what} step failed: {type(e).__name__}: {str(e)[:200]}"
        if r is not None:
            with self.lock:
                self.scheduler.fail(r, message)
        if r is None or self.runner.state_lost():
            self._recover(message + " (this request was in flight; retry it)")
        self._drop_ended()

    def _recover(self, message: str) -> None:
        """Fails every sequence in flight and rebuilds the device state, the page pool and the page
        tables from scratch (a failed donated call may have consumed them); waiting requests stay queued."""
        with self.lock:
            in_flight = self.scheduler.reset(message)
        self.runner.rebuild()
        for r in in_flight:
            self.stats.ended(Status.FAILED)
            self._end(r)
