"""The serving engine: continuous batching over a paged KV cache, with prefix caching.

    engine = Engine(params, cfg, tokenizer, ServeConfig(slots=16, kv_memory_gb=1.0))
    request = engine.submit("Once upon a time", SamplingConfig(max_new_tokens=64))
    engine.run_until_idle()            # or engine.start() for a background thread (the HTTP server)
    request.result()                   # a Completion, as Generator.generate returns

A fixed number of decode slots share one pool of fixed-size pages (`jaxgen.model.paged`). Each scheduler
step (1) gives waiting requests free slots, (2) prefills up to `prefill_chunk` prompt tokens (several
short prompts, or one chunk of a long one: running sequences wait at most one chunk), (3) runs a
jitted `while_loop` of up to `chunk_steps` decode steps for every active slot, and (4) retires
finished sequences, returning their pages. All device state (the `DecodeState` of `jaxgen.generate`,
its cache a `PagedCache`) is passed into and returned from jitted pure functions; the scheduler only
decides what to run.

A request's tokens do not depend on what else runs: each slot has its own sampling settings, and
seeded draws are keyed by (seed, token index), exactly as in `Generator`.

Memory policy: the pool holds `kv_memory_gb` of pages. A request's pages (prompt + max_new_tokens)
are taken when its prefill starts, so a running sequence never runs out; when too few are free, the
request waits. One that could never fit (longer than the context or the whole pool) is refused at
`submit` with `PageError`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.decode import (
    FINISH_LENGTH,
    FINISH_NAMES,
    MAX_STOPS,
    RUNNING,
    Completion,
    DecodeState,
    bucket,
    counted,
    decode_loop,
    encode_prompt,
    finish_row,
    sample_config,
    stop_sequences,
    stop_string_cut,
)
from jaxgen.inference.pages import PageError, PagePool, PagesExhausted
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig, SamplingError, check_prompt
from jaxgen.model.paged import PagedCache, page_bytes
from jaxgen.sharding import with_mesh
from jaxgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_LEN = 8  # the longest stop token sequence a request may give


class Status(str, enum.Enum):
    """Where a sequence is: WAITING -> PREFILL -> RUNNING -> DONE, or CANCELLED / FAILED from any live state.
    A str enum, so `request.status == "running"` reads as it did."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


LIVE = (Status.WAITING, Status.PREFILL, Status.RUNNING)


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped: it admits no new request."""


class RequestFailed(RuntimeError):
    """A request ended with an error (`Request.error`), not with a completion."""


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence in the engine (a request with n samples is n of these)."""

    prompt: list[int]
    sampling: SamplingConfig  # its seed already offset for the sample index
    prompt_index: int = 0
    sample_index: int = 0
    on_update: Callable[[Request], None] | None = None  # called from the engine thread after each chunk
    # progress, written by the engine
    status: Status = Status.WAITING
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop, length; cancelled or error when it ended without a completion
    error: str | None = None  # what went wrong, for a FAILED request
    cached_tokens: int = 0
    t_submit: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event)

    def result(self, timeout: float | None = None) -> Completion:
        """The completion; RequestFailed for a failed request (a cancelled one returns what it had)."""
        if not self.done_event.wait(timeout):
            raise TimeoutError("request not finished")
        if self.status == Status.FAILED:
            raise RequestFailed(self.error)
        alts = self.top_logprobs if self.sampling.logprobs else None
        return Completion(
            self.prompt_index, self.sample_index, self.tokens, self.text, self.finish_reason, self.logprobs, alts
        )


def _set_pages(state: DecodeState, slot, pages_row, capacity) -> DecodeState:
    cache = state.cache.replace(
        page_table=state.cache.page_table.at[slot].set(pages_row), capacity=state.cache.capacity.at[slot].set(capacity)
    )
    return state.replace(cache=cache)


def _prefill_chunk(params, state: DecodeState, slot, tokens, positions, last, cfg: ModelConfig):
    """One chunk of one slot's prompt: tokens, positions (1, C), padding at -1. Returns the state and
    the next-token logits (V,) after the token at index `last` of the chunk."""
    cache = state.cache
    sub = cache.replace(page_table=cache.page_table[slot][None], capacity=cache.capacity[slot][None])
    x, sub = model.hidden_states(params, tokens, positions, sub, cfg=cfg)
    logits = model.lm_head(params, jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1), cfg)[0, 0]
    return state.replace(cache=cache.replace(k=sub.k, v=sub.v)), logits


def _activate(state: DecodeState, slot, logits, position, max_new, stop_seqs, seen, sampling_row) -> DecodeState:
    """Slot `slot` starts decoding: its row of every per-row array is set."""
    return state.replace(
        logits=state.logits.at[slot].set(logits), positions=state.positions.at[slot].set(position),
        done=state.done.at[slot].set(False), finish=state.finish.at[slot].set(RUNNING),
        generated=state.generated.at[slot].set(0), max_new=state.max_new.at[slot].set(max_new),
        stop_seqs=state.stop_seqs.at[slot].set(stop_seqs), recent=state.recent.at[slot].set(-1),
        seen=state.seen.at[slot].set(seen), counts=state.counts.at[slot].set(0),
        sampling=jax.tree.map(lambda a, r: a.at[slot].set(r[0]), state.sampling, sampling_row),
    )  # fmt: skip


def _retire(state: DecodeState, slot) -> DecodeState:
    """Slot `slot` stops (finished, stopped by a string, or cancelled) and forgets its pages."""
    state = state.replace(done=state.done.at[slot].set(True), finish=state.finish.at[slot].set(FINISH_LENGTH))
    return _set_pages(state, slot, jnp.zeros_like(state.cache.page_table[0]), 0)


def _chunk(params, state: DecodeState, limit, cfg: ModelConfig) -> DecodeState:
    """Up to `limit` decode steps for every active slot, into buffers that start at column 0."""
    return decode_loop(params, state.replace(step=jnp.int32(0), limit=limit), cfg)


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(self, params, cfg: ModelConfig, tokenizer: Tokenizer, serve: ServeConfig = ServeConfig(), mesh=None):
        self.params = model.unstack_layers(params)
        self.cfg, self.tokenizer, self.serve = cfg, tokenizer, serve
        z = serve.page_size
        self.max_pages = -(-cfg.max_seq_len // z)  # pages one sequence may need at most
        num_pages = serve.num_pages or int(serve.kv_memory_gb * 2**30 // page_bytes(cfg, z, serve.cache_dtype))
        self.pool = PagePool(num_pages, z)
        self.compilations = 0
        donate = functools.partial(jax.jit, donate_argnums=0)
        self._set_pages = with_mesh(donate(counted(self, _set_pages)), mesh)
        self._activate = with_mesh(donate(counted(self, _activate)), mesh)
        self._retire = with_mesh(donate(counted(self, _retire)), mesh)
        self._prefill = with_mesh(jax.jit(counted(self, _prefill_chunk), static_argnames="cfg", donate_argnums=1), mesh)
        self._chunk = with_mesh(jax.jit(counted(self, _chunk), static_argnames="cfg", donate_argnums=1), mesh)
        self.state = self._init_state(num_pages)
        self.slots: list[Request | None] = [None] * serve.slots
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.lock = threading.Lock()  # guards the queues (submit and cancel come from other threads)
        self.wake = threading.Condition(self.lock)
        self.stats = {"requests": 0, "finished": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0}
        self.stats["prompt_tokens"] = 0
        self.stats["busy_s"] = 0.0
        self.ttft: deque[float] = deque(maxlen=1000)
        self.tpot: deque[float] = deque(maxlen=1000)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.accepting = True  # False once drain() began: submit raises EngineClosed

    def _init_state(self, num_pages: int) -> DecodeState:
        b, v, m, a = self.serve.slots, self.cfg.vocab_size, self.serve.chunk_steps, self.serve.max_logprobs
        cache = PagedCache.init(self.cfg, num_pages, self.serve.page_size, b, self.max_pages, self.serve.cache_dtype)
        idle = SamplingConfig(temperature=0.0)
        return DecodeState(
            step=jnp.int32(0), limit=jnp.int32(0),
            tokens=jnp.zeros((b, m), jnp.int32), logprobs=jnp.zeros((b, m), jnp.float32),
            top_ids=jnp.zeros((b, m, a), jnp.int32), top_logprobs=jnp.zeros((b, m, a), jnp.float32),
            logits=jnp.zeros((b, v), jnp.float32), positions=jnp.zeros((b,), jnp.int32),
            done=jnp.ones((b,), bool), generated=jnp.zeros((b,), jnp.int32),
            finish=jnp.full((b,), FINISH_LENGTH, jnp.int32), max_new=jnp.zeros((b,), jnp.int32),
            stop_seqs=jnp.full((b, MAX_STOPS, STOP_LEN), -1, jnp.int32), recent=jnp.full((b, STOP_LEN), -1, jnp.int32),
            seen=jnp.zeros((b, v), bool), counts=jnp.zeros((b, v), jnp.int32),
            sampling=jax.tree.map(jnp.asarray, SamplingArrays.stack([idle] * b, v)), cache=cache,
        )  # fmt: skip

    # --- requests ----------------------------------------------------------------------------------

    def check(self, prompt: list[int], c: SamplingConfig) -> None:
        """Raises SamplingError / PageError for a request this engine can never run, before queueing."""
        prompt = check_prompt(prompt, self.cfg.vocab_size, self.cfg.max_seq_len)
        c.check_for_model(self.cfg.vocab_size)
        if c.logprobs > self.serve.max_logprobs:
            raise SamplingError(f"logprobs={c.logprobs} is not allowed: at most {self.serve.max_logprobs}", "logprobs")
        stops = self._stops(c)
        if any(len(q) > STOP_LEN for q in stops):
            raise SamplingError(f"a stop token sequence is longer than {STOP_LEN} tokens", "stop_token_sequences")
        pages = self._pages_for(len(prompt), c.max_new_tokens)
        if pages > self.pool.usable:
            raise PageError(
                f"the request needs {pages} pages of {self.pool.page_size} tokens (prompt {len(prompt)} + "
                f"max_new_tokens {c.max_new_tokens}); the page pool holds {self.pool.usable} in all "
                "(raise serve.kv_memory_gb or lower max_new_tokens)"
            )

    def _pages_for(self, prompt_len: int, max_new: int) -> int:
        """Pages a sequence takes: its prompt and new tokens, never past the context."""
        return -(-min(prompt_len + max_new, self.cfg.max_seq_len) // self.pool.page_size)

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt, checked as Generator.encode_prompts checks them."""
        return [encode_prompt(self.tokenizer, p, self.cfg, f"prompt {i}") for i, p in enumerate(prompts)]

    def _stops(self, c: SamplingConfig) -> list[tuple[int, ...]]:
        return stop_sequences(c, self.tokenizer.eos_ids)

    def submit(
        self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(), *, prompt_index: int = 0,
        on_update: Callable[[Request], None] | None = None,
    ) -> list[Request]:  # fmt: skip
        """Queues sampling.n sequences for one prompt; returns their Requests (checked first).

        Raises SamplingError / PageError for a request that can never run, EngineClosed when the
        engine is shutting down. `on_update` is called from the engine thread after each chunk and
        once more when the sequence ends, however it ends (finished, cancelled or failed)."""
        ids = encode_prompt(self.tokenizer, prompt, self.cfg)
        self.check(ids, sampling)
        requests = [
            Request(ids, sample_config(sampling, s), prompt_index, s, on_update, t_submit=time.perf_counter())
            for s in range(sampling.n)
        ]  # fmt: skip
        with self.wake:
            if not self.accepting:
                raise EngineClosed("the engine is shutting down: no new requests are admitted")
            self.waiting.extend(requests)
            self.stats["requests"] += len(requests)
            self.wake.notify()
        return requests

    def cancel(self, request: Request) -> None:
        """Stops a request (a client went away); its slot and pages are freed at the next step."""
        with self.wake:
            if request.status in LIVE:
                request.status = Status.CANCELLED
                self.wake.notify()

    def generate(self, prompts, sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig()) -> list[Completion]:
        """Like Generator.generate, on the engine: every prompt queued at once, results in order."""
        configs = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(configs) != len(prompts):
            raise SamplingError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
        requests = [
            r for i, (p, c) in enumerate(zip(prompts, configs, strict=True)) for r in self.submit(p, c, prompt_index=i)
        ]
        if self._thread is None:
            self.run_until_idle()
        return [r.result() for r in requests]

    # --- the scheduler -----------------------------------------------------------------------------

    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and all(r is None for r in self.slots)

    def queue_length(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def run_until_idle(self) -> None:
        while not self.idle():
            self.step()

    @property
    def running(self) -> bool:
        """True while the background scheduler thread serves requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        """Runs the scheduler in a background thread until `stop()`."""
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
            for r in [*self.waiting, *self.prefilling]:
                self._mark_failed(r, reason)
            self.wake.notify()
        deadline = time.monotonic() + grace_s
        while self.running and not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.wake:
            for r in self.slots:
                if r is not None:
                    self._mark_failed(r, reason)
            self.wake.notify()
        if not self.running:  # no thread to end them: end them here
            self._drop_ended()

    def _serve_forever(self) -> None:
        try:
            while True:
                with self.wake:
                    while self.idle() and not self._stop:
                        self.wake.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # step() handles errors itself; anything here is a bug: say so, fail all
            log.exception("the engine thread died")
            self.accepting = False
            self._recover(f"the engine stopped: {type(e).__name__}: {e}")
            raise

    def step(self) -> None:
        """One scheduler iteration: admit, prefill chunks, one decode chunk, retire. A failure that
        concerns one request fails that request alone; a failed device step fails the sequences in
        flight (their cache is lost), rebuilds the device state and goes on with the queue."""
        t0 = time.perf_counter()
        self._drop_ended()
        self._admit()
        budget = self.serve.prefill_chunk  # prompt tokens per step, over as many prompts as it covers
        while budget > 0 and self.prefilling:
            r = self.prefilling[0]
            try:
                done = self._prefill_one_chunk(budget)
            except Exception as e:
                self._failed_step(r, "prefill", e)
                continue
            if not done:
                break
            budget -= done
        if any(r is not None and r.status == Status.RUNNING for r in self.slots):
            try:
                self._decode_chunk()
            except Exception as e:
                self._failed_step(None, "decode", e)
        self._drop_ended()
        self.stats["busy_s"] += time.perf_counter() - t0

    def _failed_step(self, r: Request | None, what: str, e: Exception) -> None:
        log.exception("engine %s step failed", what)
        message = f"the engine's {what} step failed: {type(e).__name__}: {str(e)[:200]}"
        if r is not None:
            with self.lock:
                self._mark_failed(r, message)
        if r is None or self._state_lost():
            self._recover(message + " (this request was in flight; retry it)")
        self._drop_ended()

    def _state_lost(self) -> bool:
        """True when a failed donated call consumed the device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

    def _admit(self) -> None:
        with self.lock:
            for slot, r in enumerate(self.slots):
                if r is None and self.waiting:
                    r = self.waiting.popleft()
                    r.slot, r.status = slot, Status.PREFILL
                    self.slots[slot] = r
                    self.prefilling.append(r)

    def _prefill_one_chunk(self, budget: int) -> int:
        """Prefills up to `budget` tokens of the first prompt waiting; returns how many it ran."""
        r = self.prefilling[0]
        if not r.pages:  # pages are taken when the prefill starts; too few free: wait for some
            total = min(len(r.prompt) + r.sampling.max_new_tokens, self.cfg.max_seq_len)
            try:
                r.pages, r.cached_tokens = self.pool.allocate(r.prompt if self.serve.prefix_caching else [], total)
            except PagesExhausted:
                return 0
            r.prefilled = r.cached_tokens
            row = np.zeros(self.max_pages, np.int32)
            row[: len(r.pages)] = r.pages
            self.state = self._set_pages(self.state, r.slot, row, len(r.pages) * self.pool.page_size)
        start = r.prefilled
        n = min(len(r.prompt) - start, budget)
        c = bucket(n, minimum=16)
        tokens = np.zeros((1, c), np.int32)
        positions = np.full((1, c), -1, np.int32)
        tokens[0, :n] = r.prompt[start : start + n]
        positions[0, :n] = np.arange(start, start + n)
        self.state, logits = self._prefill(self.params, self.state, r.slot, tokens, positions, n - 1, cfg=self.cfg)
        r.prefilled += n
        self.stats["prompt_tokens"] += n
        if r.prefilled < len(r.prompt):
            return n
        self.prefilling.popleft()
        if self.serve.prefix_caching:
            self.pool.register_prompt(r.prompt, r.pages)
        self._start_decoding(r, logits)
        return n

    def _start_decoding(self, r: Request, logits) -> None:
        c = r.sampling
        stop_seqs = np.full((MAX_STOPS, STOP_LEN), -1, np.int32)
        for j, seq in enumerate(self._stops(c)):
            stop_seqs[j, STOP_LEN - len(seq) :] = seq
        seen = np.zeros(self.cfg.vocab_size, bool)
        seen[r.prompt] = True
        sampling_row = jax.tree.map(jnp.asarray, SamplingArrays.stack([c], self.cfg.vocab_size))
        max_new = min(c.max_new_tokens, self.cfg.max_seq_len)  # the context ends it first anyway
        self.state = self._activate(self.state, r.slot, logits, len(r.prompt), max_new, stop_seqs, seen, sampling_row)
        with self.lock:  # a cancel that came during the prefill stands
            if r.status == Status.PREFILL:
                r.status = Status.RUNNING

    def _decode_chunk(self) -> None:
        self.state = self._chunk(self.params, self.state, jnp.int32(self.serve.chunk_steps), cfg=self.cfg)
        s = self.state
        host = jax.device_get((s.generated, s.tokens, s.logprobs, s.top_ids, s.top_logprobs, s.done, s.finish))
        now = time.perf_counter()
        for slot, r in enumerate(self.slots):
            if r is not None and r.status == Status.RUNNING:
                try:
                    self._take_tokens(r, slot, host, now)
                except Exception as e:  # host-side work of one request (decoding, its callback): it alone fails
                    log.exception("request failed after a decode chunk")
                    with self.lock:
                        self._mark_failed(r, f"{type(e).__name__}: {str(e)[:200]}")

    def _take_tokens(self, r: Request, slot: int, host, now: float) -> None:
        """One slot's new tokens from the chunk's host copy; ends the sequence when it is done."""
        generated, tokens, logprobs, top_ids, top_lp, done, finish = host
        n = int(generated[slot]) - len(r.tokens)  # a live row fills columns 0.. of the chunk's buffers
        new = tokens[slot, :n].tolist()
        if new and r.t_first is None:
            r.t_first = now
            self.ttft.append(now - r.t_submit)
        r.tokens += new
        r.logprobs += logprobs[slot, :n].tolist()
        a = r.sampling.logprobs
        if a:
            r.top_logprobs += [
                dict(zip(top_ids[slot, i, :a].tolist(), top_lp[slot, i, :a].tolist(), strict=True)) for i in range(n)
            ]
        self.stats["generated_tokens"] += n
        stopped = stop_string_cut(self.tokenizer, r.tokens, r.sampling.stop) is not None
        if done[slot] or stopped:
            self._finish(r, "stop" if stopped else FINISH_NAMES.get(int(finish[slot]), "length"))
        elif r.on_update is not None:  # the text so far, for those who watch (decoded again at the end)
            r.text = self.tokenizer.decode(r.tokens)
            r.on_update(r)

    def _finish(self, r: Request, reason: str) -> None:
        keep, r.text, r.finish_reason = finish_row(
            self.tokenizer, r.tokens, r.sampling, self._stops(r.sampling), reason
        )
        r.tokens, r.logprobs, r.top_logprobs = r.tokens[:keep], r.logprobs[:keep], r.top_logprobs[:keep]
        r.t_done = time.perf_counter()
        self.stats["finished"] += 1
        if r.t_first is not None and len(r.tokens) > 1:
            self.tpot.append((r.t_done - r.t_first) / (len(r.tokens) - 1))
        with self.lock:
            r.status = Status.DONE
        self._end(r)

    def _mark_failed(self, r: Request, message: str) -> None:
        """(Lock held.) Marks a live sequence failed; the scheduler ends it at its next check."""
        if r.status in LIVE:
            r.status, r.error = Status.FAILED, message

    def _end(self, r: Request) -> None:
        """Every sequence ends here, however it ends: slot and pages back, the client told, waiters woken."""
        self._release(r)
        if r.status == Status.CANCELLED:
            r.finish_reason = "cancelled"
        elif r.status == Status.FAILED:
            r.finish_reason = "error"
        if r.on_update is not None:
            try:
                r.on_update(r)
            except Exception:
                log.exception("a request's on_update failed as it ended")
        r.done_event.set()

    def _release(self, r: Request) -> None:
        if r.slot >= 0:
            self.state = self._retire(self.state, r.slot)
            self.slots[r.slot] = None
            r.slot = -1
        if r.pages:
            self.pool.release(r.pages)
            r.pages = []

    def _drop_ended(self) -> None:
        """Ends the sequences cancelled or failed since the last look (each counted once)."""
        with self.lock:
            queued = {id(r): r for r in [*self.waiting, *self.prefilling, *self.slots] if r is not None}
            ended = [r for r in queued.values() if r.status in (Status.CANCELLED, Status.FAILED)]
            self.waiting = deque(r for r in self.waiting if r.status in LIVE)
            self.prefilling = deque(r for r in self.prefilling if r.status in LIVE)
        for r in ended:
            self.stats["cancelled" if r.status == Status.CANCELLED else "failed"] += 1
            self._end(r)

    def _recover(self, message: str) -> None:
        """Fails every sequence in flight and rebuilds the device state and the page pool from scratch
        (a failed donated call may have consumed them); waiting requests stay queued."""
        with self.lock:
            in_flight = list({id(r): r for r in [*self.prefilling, *self.slots] if r is not None}.values())
            for r in in_flight:
                self._mark_failed(r, message)
                r.slot, r.pages = -1, []
            self.prefilling.clear()
            self.slots = [None] * self.serve.slots
        self.pool = PagePool(self.pool.num_pages, self.pool.page_size)
        self.state = self._init_state(self.pool.num_pages)
        for r in in_flight:
            self.stats["failed"] += 1
            self._end(r)

    # --- metrics -----------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        running = sum(1 for r in self.slots if r is not None and r.status == Status.RUNNING)
        pool = self.pool
        return {
            "queue_length": self.queue_length(),
            "running_slots": running,
            "slots": self.serve.slots,
            "cache_pages_in_use": pool.in_use(),
            "cache_pages_total": pool.usable,
            "prefix_cache_hit_rate": pool.hits / pool.lookups if pool.lookups else 0.0,
            "prefix_cache_hit_tokens": pool.hits,
            "requests_total": self.stats["requests"],
            "requests_finished": self.stats["finished"],
            "requests_cancelled": self.stats["cancelled"],
            "requests_failed": self.stats["failed"],
            "generated_tokens_total": self.stats["generated_tokens"],
            "prompt_tokens_total": self.stats["prompt_tokens"],
            "tokens_per_second": self.stats["generated_tokens"] / self.stats["busy_s"] if self.stats["busy_s"] else 0.0,
            "time_to_first_token_seconds": float(np.mean(self.ttft)) if self.ttft else 0.0,
            "time_per_output_token_seconds": float(np.mean(self.tpot)) if self.tpot else 0.0,
        }
