"""The engine's scheduler on its own: plain Requests, no model, no device, nothing compiled.

`_step` runs a plan as the engine would, without a device: every chunk runs, and each decoding sequence
takes `chunk_steps` tokens (fewer at its max_new_tokens), finishing at its max_new_tokens.
"""

import ast
from pathlib import Path

import jax
import pytest

from jaxgen.inference.pages import PageError, PagePolicy, spec_margin
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.scheduler import Preemption, Scheduler, StepOutput, StepPlan
from jaxgen.inference.sequence import Sequence, Status

Z, STEPS = 4, 4  # page size and decode chunk of every scheduler here


@pytest.fixture(scope="module", autouse=True)
def compiles_nothing():
    """Every test of this module runs with no JAX compilation (a listener sees each one)."""
    events = []

    def listen(event: str, *args, **kwargs):
        if event.startswith("/jax/core/compile"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield
    jax.monitoring.unregister_event_duration_listener(listen)
    assert events == []


def _scheduler(num_pages=33, slots=4, prefill_chunk=8, context=64, prefix=True) -> Scheduler:
    return Scheduler(PagePolicy(num_pages, Z, slots, context, STEPS, prefix), prefill_chunk)


def _request(n: int, max_new: int = 8, first: int = 0, **settings) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingConfig(max_new_tokens=max_new, **settings))


def _submit(s: Scheduler, *requests: Sequence) -> tuple[Sequence, ...]:
    s.add(list(requests))
    return requests


def _step(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    s.update(StepOutput(prefilled=plan.prefills))
    finished = []
    for r in plan.decode:
        if r.status == Status.RUNNING:
            r.tokens += [7] * min(STEPS, r.sampling.max_new_tokens - len(r.tokens))
            if len(r.tokens) == r.sampling.max_new_tokens:
                finished.append(r)
    s.update(StepOutput(finished=tuple(finished)))
    return plan


def _chunks(plan: StepPlan) -> list[tuple[Sequence, int, int]]:
    return [(c.request, c.start, c.length) for c in plan.prefills]


def test_the_scheduler_imports_no_jax():
    for name in ("scheduler.py", "pages.py"):
        tree = ast.parse((Path(__file__).parents[1] / "jaxgen" / "inference" / name).read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] in ("jax", "flax")], (name, imported)


def test_admission_is_first_come_first_served_up_to_the_slots():
    s = _scheduler(slots=2, prefill_chunk=64)
    a, b, c = _submit(s, _request(3), _request(3, first=10), _request(3, first=20))
    plan = _step(s)
    assert plan.admissions == ((a, 0), (b, 1)) and list(s.waiting) == [c] and c.status == Status.WAITING
    assert _chunks(plan) == [(a, 0, 3), (b, 0, 3)] and plan.decode == (a, b)
    assert a.status == b.status == Status.RUNNING and s.queue_length() == 1
    while a.status != Status.DONE:
        _step(s)
    plan = _step(s)  # a and b finished: c takes the first free slot
    assert plan.admissions == ((c, 0),) and s.slots == [c, None] and b.status == Status.DONE


def test_several_short_prompts_share_a_steps_prefill_budget():
    s = _scheduler(prefill_chunk=8)
    a, b, c = _submit(s, _request(3), _request(3, first=10), _request(3, first=20))
    assert _chunks(_step(s)) == [(a, 0, 3), (b, 0, 3), (c, 0, 2)]  # 8 tokens: c's prefill goes on next step
    assert c.status == Status.PREFILL and c.prefilled == 2
    plan = _step(s)
    assert _chunks(plan) == [(c, 2, 1)] and plan.prefills[0].last and c.status == Status.RUNNING


def test_a_long_prompt_prefills_in_chunks_between_decode_chunks():
    """Running sequences wait at most one prefill chunk: each step decodes them after one chunk."""
    s = _scheduler(prefill_chunk=8)
    (short,) = _submit(s, _request(3, max_new=40))
    _step(s)
    (long,) = _submit(s, _request(30, first=100))
    plans = [_step(s) for _ in range(4)]
    assert [_chunks(p) for p in plans] == [[(long, 0, 8)], [(long, 8, 8)], [(long, 16, 8)], [(long, 24, 6)]]
    assert all(short in p.decode for p in plans) and long not in plans[2].decode and long in plans[3].decode
    assert len(short.tokens) == 5 * STEPS and long.status == Status.RUNNING


def test_preemption_takes_the_latest_admitted_and_recomputes_it_with_its_tokens():
    """6 usable pages, two sequences of 4 + 16 tokens (5 pages each): both run until the pool runs dry,
    then the second admitted is preempted, queued first with its tokens, and prefills them again."""
    s = _scheduler(num_pages=7, slots=2, prefill_chunk=32)
    first, second = _submit(s, _request(4, max_new=16), _request(4, max_new=16, first=50))
    plans = [_step(s), _step(s), _step(s)]
    assert plans[2].preemptions == (Preemption(second, 1, True),) and plans[2].decode == (first,)
    assert second.status == Status.WAITING and second.pages == [] and second.slot == -1
    assert s.waiting[0] is second and second.preemptions == 1 and len(second.tokens) == 2 * STEPS
    assert first.status == Status.RUNNING and s.policy.pool.in_use() == len(first.pages) == 4
    plan = _step(s)  # second takes the free slot; its pages must wait for first to finish
    assert plan.admissions == ((second, 1),) and plan.prefills == () and first.status == Status.DONE
    plan = _step(s)
    (chunk,) = plan.prefills
    assert (chunk.request, chunk.start, chunk.length, chunk.recompute) == (second, 0, 4 + 2 * STEPS, True)
    while second.status != Status.DONE:
        _step(s)
    assert len(second.tokens) == 16 and first.preemptions == 0 and s.idle() and s.policy.pool.in_use() == 0


def test_a_speculating_sequence_reserves_room_for_a_draft_window():
    s = _scheduler(context=256, prefill_chunk=64)
    plain, drafting = _submit(s, _request(10, max_new=100), _request(10, max_new=100, num_speculative_tokens=3))
    plan = _step(s)
    assert len(plain.pages) == -(-(10 + STEPS) // Z)  # its prompt and one decode chunk
    assert len(drafting.pages) == -(-(10 + STEPS + spec_margin(drafting)) // Z)  # and a chunk's drafts
    assert spec_margin(plain) == 0 and spec_margin(drafting) > 0 and plan.draft_tokens == 3


def test_prefix_cache_hits_share_pages_counted_once():
    """Two sequences with one 13-token prompt, prefilled in the same step: the second shares the first's
    3 whole prompt pages (the last token always runs) and prefills from token 12."""
    s = _scheduler(prefill_chunk=32)
    a, b = _submit(s, _request(13), _request(13))
    plan = _step(s)
    first, second = plan.prefills
    assert (first.looked_up, first.hits, second.looked_up, second.hits) == (13, 0, 13, 12)
    assert _chunks(plan) == [(a, 0, 13), (b, 12, 1)] and b.cached_tokens == 12
    assert b.pages[:3] == a.pages[:3] and set(a.pages[3:]).isdisjoint(b.pages)
    assert s.policy.pool.in_use() == len(set(a.pages) | set(b.pages)) == 7  # 5 + 2: shared ones once
    scored = _submit(s, _request(13, prompt_logprobs=0))[0]
    assert _step(s).prefills[0].looked_up == 0 and scored.cached_tokens == 0  # a scored prompt runs whole


def test_a_failed_prefill_chunk_undoes_what_the_plan_assumed_of_it():
    """The second chunk shared pages the first was to fill: when the first fails, the prefix entries
    go and the second gives its pages back, to take them again next step."""
    s = _scheduler(prefill_chunk=32)
    a, b = _submit(s, _request(13), _request(13))
    plan = s.schedule()
    s.update(StepOutput(failed=plan.prefills[0], skipped=plan.prefills[1:]))
    s.fail(a, "the device step failed")
    assert s.take_ended() == [(a, 0)] and a.pages == [] and b.pages == [] and b.prefilled == 0
    assert s.policy.pool.in_use() == 0 and not s.policy.pool.cached
    plan = _step(s)
    assert _chunks(plan) == [(b, 0, 13)] and plan.prefills[0].hits == 0


def test_a_request_that_can_never_fit_is_refused_with_the_numbers():
    s = _scheduler(num_pages=4)
    with pytest.raises(PageError, match=r"needs 5 pages of 4 tokens \(prompt 10 \+ max_new_tokens 10\); .* holds 3"):
        s.check(10, 10)
    s.check(10, 2)  # 3 pages: the whole pool, alone
    assert s.idle()


def test_cancel_of_a_waiting_or_running_request_frees_its_slot_and_pages():
    s = _scheduler(slots=1)
    running, waiting = _submit(s, _request(6, max_new=100), _request(6, max_new=100))
    _step(s)
    assert running.status == Status.RUNNING and running.pages and s.policy.pool.in_use() > 0
    s.cancel(running)
    s.cancel(waiting)
    assert s.take_ended() == [(waiting, -1), (running, 0)]
    assert running.pages == [] and s.slots == [None] and s.policy.pool.in_use() == 0 and s.idle()
    assert running.status == waiting.status == Status.CANCELLED
    assert s.policy.tables.take_changes()[1].tolist() == [0]  # the slot's table row cleared


def test_the_pools_count_of_available_pages_follows_every_change():
    """`PagePool.available` keeps a count of idle cached pages instead of walking them: after every change of a
    random sequence of allocations, releases, evictions and forgets it equals the walked count."""
    import random

    from jaxgen.inference.pages import PagePool, PagesExhausted

    rng, pool, held = random.Random(0), PagePool(24, Z), []
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 20))] for _ in range(8)]  # shared prefixes
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.45:
                p = rng.choice(prompts)
                pages, _ = pool.allocate(p, len(p) + rng.randrange(8))
                pool.register_prompt(p, pages)
                held.append(pages)
            elif op < 0.85 and held:
                pool.release(held.pop(rng.randrange(len(held))))
            elif op < 0.95 and held:
                pool.forget(rng.choice(held)[:1])
            else:
                pool.clear_cache()
        except PagesExhausted:
            pass
        walked = len(pool.free) + sum(1 for p in pool.cached.values() if pool.refs[p] == 0)
        assert pool.available() == walked


def _host(rows: dict[int, tuple[list[int], int]], slots: int = 4, finish: dict[int, int] | None = None):
    """A decode chunk's results as the runner hands them over (`decode.HostRows`' fields), made by hand:
    `rows` slot -> (its new tokens, its `generated` after them); `finish` slot -> finish code (the row done)."""
    from types import SimpleNamespace

    import numpy as np

    tokens, generated = np.zeros((slots, 8), np.int32), np.zeros(slots, np.int32)
    for slot, (new, total) in rows.items():
        tokens[slot, : len(new)], generated[slot] = new, total
    finish = finish or {}
    done = np.asarray([s in finish for s in range(slots)])
    codes = np.asarray([finish.get(s, 0) for s in range(slots)], np.int32)
    return SimpleNamespace(tokens=tokens, logprobs=np.zeros((slots, 8), np.float32), generated=generated,
                           done=done, finish=codes)  # fmt: skip


def test_update_takes_a_chunks_tokens_finds_stop_strings_and_frees_pages_without_a_device():
    """The scheduler's update with a fabricated decode chunk (no JAX, no model): tokens appended, a stop found by
    the engine's `stopped` (here: token 9 stands for a stop string), a finish code from the device, an n > 1
    pair sharing prompt pages ending one at a time, a sequence preempted after the chunk left (its tokens are
    dropped, to be recomputed), every page back at the end."""
    s = Scheduler(PagePolicy(33, Z, 4, 64, STEPS, True), 64, stopped=lambda r: 9 in r.tokens)
    a, b, c = _submit(s, _request(9, max_new=8), _request(9, max_new=8), _request(5, first=50, max_new=8))
    plan = s.schedule()
    s.update(StepOutput(prefilled=plan.prefills))
    assert plan.decode == (a, b, c) and a.pages[:2] == b.pages[:2]  # a and b: one prompt, shared pages
    u = s.update(StepOutput(host=_host({0: ([1, 2, 3, 4], 4), 1: ([1, 9, 5, 5], 4), 2: ([7, 7], 2)}, finish={2: 1}),
                            decoded=plan.decode))  # fmt: skip
    assert (a.tokens, b.tokens, c.tokens) == ([1, 2, 3, 4], [1, 9, 5, 5], [7, 7]) and u.new_tokens == 10
    assert [(r, reason) for r, reason, _ in u.finished] == [(b, "stop"), (c, "stop")] and u.progressed == [a]
    assert u.first == [a, b, c] and sorted(u.freed) == [1, 2] and b.status == c.status == Status.DONE
    plan = s.schedule()
    assert plan.decode == (a,)
    preempted = s.preempt(a)  # the pool ran dry after this chunk was dispatched
    u = s.update(StepOutput(host=_host({0: ([5, 6, 7, 8], 8)}), decoded=plan.decode))
    assert preempted.requeued and a.tokens == [1, 2, 3, 4] and u.new_tokens == 0 and u.finished == []
    while not s.idle():
        plan = s.schedule()
        s.update(StepOutput(prefilled=plan.prefills))
        if plan.decode:
            (r,) = plan.decode
            s.update(StepOutput(host=_host({r.slot: ([5, 6, 7, 8], 8)}, finish={r.slot: 2}), decoded=plan.decode))
    assert a.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and a.status == Status.DONE and s.policy.pool.in_use() == 0


def test_the_schedulers_stop_code_is_the_devices():
    from jaxgen.inference import decode, scheduler

    assert scheduler.FINISH_STOP == decode.FINISH_STOP


def test_a_steps_chunks_run_in_calls_that_cost_no_more_than_alone():
    """`prefill_calls`: like chunks share a call (16 of 100 tokens: one call of 16 x 128); a long one among
    short ones runs apart; five alike make a call of 4 and one of 1 (one of 16 rows would pad 3.2x), and
    unlike lengths in one column bucket share one (30 and 20: 2 rows of 32); scored chunks alone and first;
    the plan's order kept within the plain ones."""
    from jaxgen.inference.scheduler import PrefillChunk, call_shape, prefill_calls

    def chunks(*lengths, scored=()):
        return [PrefillChunk(_request(n, **({"prompt_logprobs": 0} if i in scored else {})), i, 0, n, True, False)
                for i, n in enumerate(lengths)]  # fmt: skip

    def shapes(calls):
        return [call_shape([c.length for c in call], 16) for call in calls]

    assert shapes(prefill_calls(chunks(*[100] * 16), 16)) == [(16, 128)]
    assert shapes(prefill_calls(chunks(500, 20, 20, 20, 20), 16)) == [(1, 512), (4, 32)]
    assert shapes(prefill_calls(chunks(*[100] * 5), 16)) == [(4, 128), (1, 128)]
    assert shapes(prefill_calls(chunks(30, 20, 17, 32), 16)) == [(4, 32)]
    assert shapes(prefill_calls(chunks(30, 20, 17), 16)) == [(1, 32)] * 3  # 4 rows would pad a fourth
    calls = prefill_calls(chunks(30, 40, 30, 30, 30, scored=(1,)), 16)
    assert [[c.slot for c in call] for call in calls] == [[1], [0, 2, 3, 4]]
