"""The engine's scheduler: every decision of a step, made on the host with no device call (as vLLM v1
splits its engine); the engine (`jaxgen.inference.engine`) runs the plan through the jitted steps.

    plan = scheduler.schedule()                       # StepPlan: admissions, prefill chunks, preemptions, decode set
    ...                                               # the engine runs it
    freed = scheduler.update(StepOutput(prefilled=..., finished=...))   # bookkeeping; slots to retire

A step's decisions, in order: waiting requests take free slots, first come first served; prefill chunks fill
up to `prefill_chunk` tokens over the sequences in prefill, oldest first (several short prompts, or one chunk
of a long one: running sequences wait at most one chunk), as vLLM's `max_num_batched_tokens`. The engine runs
a step's chunks as one call of R rows x C columns (`call_shape`: both bucketed, so few programs), and the plan
keeps that call within `padded_budget`: a long chunk does not pad many short ones; a sequence takes its pages
when its prefill starts (prefix-cache pages first, keeping back what the running sequences need for their next
decode chunk, and room for a draft window when it speculates: `pages.spec_margin`); then every running
sequence, oldest first, grows room for its next decode chunk, and when the pool runs dry the most recently
admitted sequence holding pages is preempted: back to the front of the queue with its tokens, readmitted later
to prefill prompt + tokens again and decode on where it stopped.

The page policy (`jaxgen.inference.pages.PagePolicy`) owns the page lists. Not thread-safe: the engine
calls it with its lock held (submit and cancel come from other threads). It imports nothing of JAX, so
its tests drive it with plain Requests and compile nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import numpy as np

from jaxgen.inference.pages import PagePolicy
from jaxgen.inference.sequence import LIVE, Sequence, Status

log = logging.getLogger(__name__)
Tables = tuple[np.ndarray, np.ndarray]  # every slot's page table row (B, M) and capacity in tokens (B,)


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """`length` tokens of `request.sequence` from `start` into slot `slot`'s pages."""

    request: Sequence
    slot: int
    start: int
    length: int
    last: bool  # it completes the prefill: the sequence decodes from the next step on
    recompute: bool  # a preempted sequence's tokens, prefilled again
    took_pages: bool = False  # its pages were taken for it in this step
    looked_up: int = 0  # then: prompt tokens looked up in the prefix cache
    hits: int = 0  # and tokens found there (`start` skips them)


@dataclasses.dataclass(frozen=True)
class Preemption:
    request: Sequence
    slot: int  # its slot, freed: the engine retires it before decoding
    requeued: bool  # False: it was cancelled or failed meanwhile, and ends instead


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step, decided: the engine runs the prefills in order, retires the preempted slots, then
    decodes one chunk for `decode`, pushing each table snapshot (None: unchanged) before its phase."""

    admissions: tuple[tuple[Sequence, int], ...] = ()  # (request, slot)
    prefills: tuple[PrefillChunk, ...] = ()
    prefill_tables: Tables | None = None
    preemptions: tuple[Preemption, ...] = ()
    decode: tuple[Sequence, ...] = ()  # the sequences that decode a chunk, by slot
    decode_tables: Tables | None = None
    draft_tokens: int = 0  # the most drafts a step any decoding sequence asks for (0: plain decoding)


FINISH_STOP = 1  # a row's finish code on the device for a stop token or sequence (`decode.FINISH_STOP`)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the runner ran of a plan (`engine.runner.Runner.execute`): the prefill chunks, and the results of a
    decode chunk that came back; or what a test fabricates."""

    prefilled: tuple[PrefillChunk, ...] = ()  # the chunks that ran, in order
    failed: PrefillChunk | None = None  # the chunk that raised (its request marked failed)
    skipped: tuple[PrefillChunk, ...] = ()  # the chunks after it, which did not run
    finished: tuple[Sequence, ...] = ()  # sequences done outside a decode chunk (tests)
    host: object = None  # `decode.HostRows` of a decode chunk: tokens (B, M), finish and done (B,) ...
    decoded: tuple[Sequence, ...] = ()  # the sequences that chunk decoded
    error: Exception | None = None  # a failed device step: what ran before it stands
    phase: str = ""  # "prefill" or "decode": which failed


@dataclasses.dataclass
class Update:
    """What `Scheduler.update` did, for the engine to tell: each list in order."""

    finished: list[tuple[Sequence, str, int]] = dataclasses.field(default_factory=list)  # (seq, reason, freed slot)
    progressed: list[Sequence] = dataclasses.field(default_factory=list)  # running on, with new tokens
    first: list[Sequence] = dataclasses.field(default_factory=list)  # their first tokens came
    new_tokens: int = 0

    @property
    def freed(self) -> list[int]:
        return [slot for _, _, slot in self.finished if slot >= 0]


def row_bucket(rows: int, slots: int) -> int:
    """Rows of a prefill call holding `rows` chunks: the next power of 4 (1, 4, 16, ...), at most `slots`."""
    r = 1
    while r < rows:
        r *= 4
    return min(r, max(slots, rows))


def column_bucket(n: int) -> int:
    """Columns of a prefill call whose longest chunk has `n` tokens: the next power of two, at least 16."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def call_shape(lengths: list[int], slots: int) -> tuple[int, int]:
    """(rows, columns) of the prefill call running chunks of `lengths` tokens (`steps.pack_rows`)."""
    return row_bucket(len(lengths), slots), column_bucket(max(lengths))


def padded_budget(prefill_chunk: int, slots: int) -> int:
    """The most tokens a step's prefill calls may hold, padding included: the token budget's bucket, and at
    least every slot's 16-token chunk (short prompts always enter together)."""
    return max(column_bucket(prefill_chunk), row_bucket(slots, slots) * 16)


def call_shapes(prefill_chunk: int, slots: int, longest: int) -> list[tuple[int, int]]:
    """Every (rows, columns) a prefill call can have, chunks of at most `longest` tokens (the precompile's grid)."""
    budget, shapes, rows = padded_budget(prefill_chunk, slots), [], {row_bucket(k, slots) for k in range(1, slots + 1)}
    for r in sorted(rows):
        c = 16
        while c <= column_bucket(min(longest, prefill_chunk)) and r * c <= budget:
            shapes.append((r, c))
            c *= 2
    return shapes


def prefill_calls(chunks, slots: int) -> list[list[PrefillChunk]]:
    """The calls that run a step's chunks: each prompt-scored chunk alone, first (they never read the prefix
    cache); the others in plan order (a chunk may read prefix pages a chunk before it registered: within a call
    each layer writes before it reads), each call the longest run of them that costs no more than its chunks
    in calls of their own (`call_shape`'s padding: rows in powers of 4, columns in powers of 2): prompts of
    like lengths share a call, unlike ones do not pad each other."""
    calls = [[c] for c in chunks if c.request.wants_prompt_scores]
    plain = [c for c in chunks if not c.request.wants_prompt_scores]
    i = 0
    while i < len(plain):  # the longest run from i within the bound (a run of one always is)
        j = max(j for j in range(i + 1, len(plain) + 1) if j == i + 1 or _thrifty(plain[i:j], slots))
        calls.append(plain[i:j])
        i = j
    return calls


def _thrifty(call: list[PrefillChunk], slots: int) -> bool:
    """Does one call of these chunks cost no more than they cost in calls of their own? (Measured on CPU, where
    padding costs what tokens cost: bench/serving.py's mixed lengths ran at 0.76x of one call per chunk when
    a call could pad twice that, 0.9x this way; docs/performance.md.)"""
    return _size(call_shape([c.length for c in call], slots)) <= sum(column_bucket(c.length) for c in call)


def _size(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


class Scheduler:
    """The queues, the slots and the decisions of each step; see the module docstring."""

    def __init__(self, policy: PagePolicy, prefill_chunk: int, stopped=lambda r: False):
        # stopped(request) -> bool: do its tokens hold one of its stop strings (the engine decodes the text)?
        self.policy, self.prefill_chunk, self.stopped = policy, prefill_chunk, stopped
        self.slots: list[Sequence | None] = [None] * policy.slots
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.admissions = 0  # slots given so far: each admission's order (preemption takes the latest)

    # --- the queues ---------------------------------------------------------------------------------

    def check(self, prompt_len: int, max_new: int) -> None:
        """PageError for a request that could never fit, even alone in the whole pool."""
        self.policy.check(prompt_len, max_new)

    def add(self, requests: list[Sequence]) -> None:
        for r in requests:
            r.held = self.policy.held  # so `r.pages` reads the policy's list
        self.waiting.extend(requests)

    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and all(r is None for r in self.slots)

    def queue_length(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def running(self) -> list[Sequence]:
        return [r for r in self.slots if r is not None and r.status == Status.RUNNING]

    def holders(self) -> list[Sequence]:
        return [r for r in self.slots if r is not None and self.policy.holds(r)]

    def cancel(self, r: Sequence) -> None:
        """Stops a live request; its slot and pages are freed when the engine next takes the ended."""
        if r.status in LIVE:
            r.status = Status.CANCELLED

    def fail(self, r: Sequence, message: str) -> None:
        if r.status in LIVE:
            r.status, r.error = Status.FAILED, message

    def fail_queued(self, message: str) -> None:
        """Fails every sequence that has not started decoding."""
        for r in [*self.waiting, *self.prefilling]:
            self.fail(r, message)

    def fail_all(self, message: str) -> None:
        for r in [*self.waiting, *self.slots]:  # preempted ones went back to waiting
            if r is not None:
                self.fail(r, message)

    def take_ended(self) -> list[tuple[Sequence, int]]:
        """The sequences cancelled or failed since the last look, out of the queues, their pages and slot
        freed: (request, the slot it held or -1), for the engine to retire and tell."""
        queued = {id(r): r for r in [*self.waiting, *self.prefilling, *self.slots] if r is not None}
        ended = [r for r in queued.values() if r.status in (Status.CANCELLED, Status.FAILED)]
        self.waiting = deque(r for r in self.waiting if r.status in LIVE)
        self.prefilling = deque(r for r in self.prefilling if r.status in LIVE)
        return [(r, self.release(r)) for r in ended]

    def release(self, r: Sequence) -> int:
        """A sequence gives back its pages and slot; returns the slot (-1: it held none)."""
        slot = r.slot
        self.policy.release(r, slot)
        if slot >= 0:
            self.slots[slot] = None
            r.slot = -1
        return slot

    def reset(self, message: str) -> list[Sequence]:
        """Fails every sequence in flight and empties the slots and the page pool (the engine rebuilds
        its device state); waiting requests stay queued. Returns those in flight."""
        in_flight = list({id(r): r for r in [*self.prefilling, *self.slots] if r is not None}.values())
        for r in in_flight:
            self.fail(r, message)
            r.slot = -1
        self.prefilling.clear()
        self.slots = [None] * len(self.slots)
        self.policy.reset()
        return in_flight

    # --- one step -----------------------------------------------------------------------------------

    def admit(self) -> list[tuple[Sequence, int]]:
        """Waiting requests into free slots, first come first served."""
        admitted = []
        for slot, r in enumerate(self.slots):
            if r is None and self.waiting:
                r = self.waiting.popleft()
                r.slot, r.status, r.admitted = slot, Status.PREFILL, self.admissions
                self.admissions += 1
                self.slots[slot] = r
                self.prefilling.append(r)
                admitted.append((r, slot))
        return admitted

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring); pages are taken and freed here."""
        admissions = self.admit()
        running = self.running()
        prefills = self._plan_prefills(running)
        prefill_tables = self.policy.tables.take_changes()
        preemptions = self._grow(running)
        ids = {id(q) for q in running}
        decode = tuple(r for r in self.slots if r is not None and id(r) in ids)
        return StepPlan(
            tuple(admissions), tuple(prefills), prefill_tables, tuple(preemptions), decode,
            self.policy.tables.take_changes(), max((r.sampling.num_speculative_tokens for r in decode), default=0),
        )  # fmt: skip

    def _plan_prefills(self, running: list[Sequence]) -> list[PrefillChunk]:
        """Chunks of up to `prefill_chunk` tokens in all, oldest first, their calls within `padded_budget`; a
        sequence whose prefill completes joins `running` (its prompt pages registered now: a later chunk of
        this step may share them)."""
        chunks, budget = [], self.prefill_chunk
        reserve = sum(self.policy.short(q) for q in running)  # pages the running sequences lack for their next chunk
        for r in list(self.prefilling):
            room = self._room(chunks, min(len(r.sequence) - r.prefilled, budget), r.wants_prompt_scores)
            if budget <= 0 or room <= 0:
                break
            took, looked_up, hits = not self.policy.holds(r), 0, 0
            if took:
                taken = self.policy.take_for_prefill(r, reserve)
                if taken is None:
                    break  # too few pages free: it waits for running sequences to finish
                looked_up, hits = taken
                r.prefilled = r.cached_tokens = hits
            n = min(len(r.sequence) - r.prefilled, room)
            last = r.prefilled + n == len(r.sequence)
            chunks.append(PrefillChunk(r, r.slot, r.prefilled, n, last, r.preemptions > 0, took, looked_up, hits))
            budget -= n
            if last and self.policy.prefix:
                self.policy.register(r)
            if last and r.sampling.max_new_tokens > 0:  # with none, it only scores the prompt
                running.append(r)
                reserve += self.policy.short(r)
        return chunks

    def _room(self, chunks: list[PrefillChunk], n: int, scored: bool) -> int:
        """Tokens of a next chunk (up to `n`) that keep the step's calls within `padded_budget`: the plain chunks
        run as one call (`call_shape`), each prompt-scored chunk as a call of its own. 0: none fit."""
        slots, budget = len(self.slots), padded_budget(self.prefill_chunk, len(self.slots))
        plain = [c.length for c in chunks if not c.request.wants_prompt_scores]
        spent = sum(column_bucket(c.length) for c in chunks if c.request.wants_prompt_scores)
        if scored:
            free = budget - spent - (_size(call_shape(plain, slots)) if plain else 0)
            return min(n, 1 << (free.bit_length() - 1)) if free >= 16 else 0
        per_row = (budget - spent) // row_bucket(len(plain) + 1, slots)
        if per_row < column_bucket(max(plain, default=1)):
            return 0  # the chunks planned already would not fit
        return min(n, 1 << (per_row.bit_length() - 1)) if per_row >= 16 else 0

    def _grow(self, running: list[Sequence]) -> list[Preemption]:
        """Room for the next decode chunk for each running sequence, oldest first; when the pool runs dry
        the latest admitted sequence holding pages is preempted (perhaps the one growing: the oldest
        always fits, `check`)."""
        preemptions, preempted = [], set()
        for r in sorted(running, key=lambda q: q.admitted):
            while id(r) not in preempted and self.policy.short(r) > 0:
                if not self.policy.extend(r):
                    victim = max(self.holders(), key=lambda q: q.admitted)
                    preemptions.append(self.preempt(victim))
                    preempted.add(id(victim))
        running[:] = [q for q in running if id(q) not in preempted]
        return preemptions

    def preempt(self, r: Sequence) -> Preemption:
        """Frees a sequence's slot and pages and queues it first again with its tokens so far; one that
        was cancelled or failed meanwhile ends instead."""
        if r in self.prefilling:
            self.prefilling.remove(r)
        live = r.status in (Status.PREFILL, Status.RUNNING)
        log.debug("preempting a sequence with %d pages and %d tokens", len(self.policy.pages_of(r)), len(r.tokens))
        slot = self.release(r)
        if live:
            r.status = Status.WAITING
            self.waiting.appendleft(r)
            r.prefilled = r.cached_tokens = 0
            r.preemptions += 1
        return Preemption(r, slot, live)

    def preempt_all(self) -> list[Preemption]:
        """Every sequence in a slot preempted (a weight swap, or the engine going to sleep): back to the
        queue in admission order, ahead of those waiting, with their tokens so far."""
        holding = sorted((r for r in self.slots if r is not None), key=lambda q: q.admitted, reverse=True)
        return [self.preempt(r) for r in holding]  # newest first: appendleft leaves the oldest in front

    def update(self, out: StepOutput) -> Update:
        """Moves the bookkeeping on by what ran: prefilled chunks counted (a prompt that was only to be scored
        finishes), a failed chunk undone; a decode chunk's tokens taken by each sequence it decoded that still
        runs (one whose host work raises fails alone), stop strings found, finished sequences' pages and
        slots freed. Returns what the engine tells its clients (`Update`)."""
        update, done = Update(), [(r, "length") for r in out.finished]
        for c in out.prefilled:
            r = c.request
            if not self.policy.holds(r):
                continue  # preempted in the same plan: it prefills again from the start
            r.prefilled = c.start + c.length
            if c.last:
                self.prefilling.remove(r)
                if r.status == Status.PREFILL:  # a cancel that came during the prefill stands
                    r.status = Status.RUNNING
                if r.sampling.max_new_tokens == 0 and r.status == Status.RUNNING:  # the prompt only (scored)
                    done.append((r, "length"))
        if out.failed is not None:
            self._undo(out.failed, out.skipped)
        if out.host is not None:
            done += self._take(out.host, out.decoded, update)
        for r, reason in done:
            r.status = Status.DONE
            update.finished.append((r, reason, self.release(r)))
        return update

    def _take(self, host, decoded: tuple[Sequence, ...], update: Update) -> list[tuple[Sequence, str]]:
        """A decode chunk's tokens into each sequence it decoded that still runs; returns those that ended."""
        done = []
        for r in decoded:
            if r.status != Status.RUNNING:
                continue  # ended, or preempted since (its tokens are recomputed)
            try:
                new = r.take(host, r.slot)
                stopped = self.stopped(r)
            except Exception as e:  # host-side work of one request (decoding its text): it alone fails
                log.exception("request failed after a decode chunk")
                self.fail(r, f"{type(e).__name__}: {str(e)[:200]}")
                continue
            update.new_tokens += len(new)
            if new and r.t_first is None:
                update.first.append(r)
            if host.done[r.slot] or stopped:
                done.append((r, "stop" if stopped or int(host.finish[r.slot]) == FINISH_STOP else "length"))
            else:
                update.progressed.append(r)
        return done

    def _undo(self, failed: PrefillChunk, skipped: tuple[PrefillChunk, ...]) -> None:
        """After a failed prefill chunk, what the plan assumed of it and of the chunks after it: their
        prefix-cache entries (never written) go, and pages taken for a chunk that did not run go back."""
        for c in (failed, *skipped):
            if c.last and self.policy.holds(c.request):
                self.policy.forget(c.request)
        for c in skipped:
            if c.took_pages and self.policy.holds(c.request):
                self.policy.release(c.request, c.slot)
                c.request.prefilled = c.request.cached_tokens = 0
        self.policy.tables.changed = True  # the decode phase's tables were not pushed
