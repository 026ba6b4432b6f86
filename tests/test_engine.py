"""The serving engine against `Generator` (an independent decode path over a contiguous cache)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.pages import PageError
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)
SERVE = ServeConfig(slots=8, page_size=16, num_pages=96, chunk_steps=4, prefill_chunk=32)


@pytest.fixture(scope="module")
def params():
    p = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, p)  # sharper logits: no near-ties in argmax


@pytest.fixture(scope="module")
def gen(params):
    return Generator(params, CFG, Tokenizer.byte_level(), max_batch=64, chunk_steps=16)


@pytest.fixture(scope="module")
def engine(params):
    return Engine(params, CFG, Tokenizer.byte_level(), SERVE)


def _workload(n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 120, n)]
    configs = [
        SamplingConfig(
            max_new_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1000)),
            stop_token_ids=[int(rng.integers(256))] if rng.random() < 0.3 else [],
        )
        for _ in range(n)
    ]  # fmt: skip
    return prompts, configs


def _same(a, b):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and a.text == b.text
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_64_concurrent_mixed_requests_equal_their_results_alone(engine, gen):
    prompts, configs = _workload(64, seed=0)
    together = engine.generate(prompts, configs)  # 64 requests through 8 slots
    reference = gen.generate(prompts, configs)  # Generator results are batch-invariant (test_generate)
    for a, b in zip(together, reference, strict=True):
        _same(a, b)
    for i in (0, 17, 42):  # and through the engine on its own
        _same(engine.generate([prompts[i]], configs[i])[0], together[i])
    assert engine.pool.in_use() == 0 and all(s is None for s in engine.slots)


def test_n_samples_share_the_prompt_pages_and_match_generate(engine, gen):
    prompt = list(range(40, 90))  # 50 tokens: 3 whole pages shareable
    sc = SamplingConfig(max_new_tokens=12, temperature=1.0, n=4, seed=5)
    hits = engine.pool.hits
    got = engine.generate([prompt], sc)
    assert engine.pool.hits - hits == 3 * 3 * 16  # samples 2-4 each reuse 3 pages of the first
    for a, b in zip(got, gen.generate([prompt], sc), strict=True):
        _same(a, b)


def test_prefix_cache_hit_gives_the_same_output_as_a_miss(params):
    system = list(range(100, 164))  # a shared 64-token system prompt
    prompts = [[*system, 7, 8, 9], [*system, 10, 11]]
    sc = SamplingConfig(max_new_tokens=10, temperature=0.0)
    cached = Engine(params, CFG, Tokenizer.byte_level(), SERVE)
    uncached = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, prefix_caching=False))
    first = cached.generate([prompts[0]], sc)[0]
    second = cached.generate([prompts[1]], sc)[0]
    assert cached.metrics()["prefix_cache_hit_tokens"] == 64  # the second prompt's 4 system pages
    for a, b in zip(uncached.generate(prompts, sc), [first, second], strict=True):
        _same(a, b)
    assert uncached.metrics()["prefix_cache_hit_tokens"] == 0


def test_page_exhaustion_queues_requests_and_leaks_nothing(params, gen):
    """8 pages of pool for requests that need 3-4 pages each in the end: pages grow as they decode, so
    more run at once than reserving prompt + max_new_tokens up front allowed (two); all finish."""
    serve = dataclasses.replace(SERVE, num_pages=9, slots=4)
    engine = Engine(params, CFG, Tokenizer.byte_level(), serve)
    prompts, configs = _workload(6, seed=3)
    configs = [dataclasses.replace(c, max_new_tokens=30, stop_token_ids=[]) for c in configs]
    prompts = [p[:30] for p in prompts]
    requests = [
        r for i, (p, c) in enumerate(zip(prompts, configs, strict=True)) for r in engine.submit(p, c, prompt_index=i)
    ]
    most = 0
    while not engine.idle():
        engine.step()
        most = max(most, sum(r.status == "running" for r in requests))
        assert engine.pool.in_use() <= 8
    assert most > 2  # reserving prompt + max_new_tokens up front ran two at most
    for r, want in zip(requests, gen.generate(prompts, configs), strict=True):
        _same(r.result(), want)
    engine.pool.clear_cache()
    assert engine.pool.in_use() == 0 and len(engine.pool.free) == engine.pool.usable


def test_impossible_requests_are_refused_before_queueing(engine):
    from jaxgen.inference.sampling import SamplingError

    small = Engine(engine.params, CFG, engine.tokenizer, dataclasses.replace(SERVE, num_pages=4))
    with pytest.raises(PageError, match=r"needs 5 pages of 16 tokens \(prompt 10 \+ max_new_tokens 64\); .* holds 3"):
        small.submit([1] * 10, SamplingConfig(max_new_tokens=64))
    with pytest.raises(SamplingError, match=r"the prompt has 300 tokens; the model's context is 256"):
        small.submit([1] * 300, SamplingConfig(max_new_tokens=1))
    assert small.idle()


def test_long_prompts_prefill_in_chunks_between_decode_steps(params):
    engine = Engine(params, CFG, Tokenizer.byte_level(), SERVE)
    (short,) = engine.submit([1, 2, 3], SamplingConfig(max_new_tokens=60, temperature=0.0, ignore_eos=True))
    engine.step()  # short prefills and starts decoding
    (long,) = engine.submit(list(range(200)), SamplingConfig(max_new_tokens=4, temperature=0.0))
    progress = []
    while long.status in ("waiting", "prefill"):
        engine.step()
        progress.append(len(short.tokens))
    assert len(progress) >= 200 // SERVE.prefill_chunk  # 7 chunks of 32 tokens
    assert progress == sorted(progress) and progress[-1] - progress[0] >= 5 * SERVE.chunk_steps
    engine.run_until_idle()
    assert len(short.result().tokens) == 60 and long.result().finish_reason


def test_cancel_frees_the_slot_and_pages(engine):
    (r,) = engine.submit([5] * 20, SamplingConfig(max_new_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    assert r.status == "running" and engine.pool.in_use() > 0
    engine.cancel(r)
    engine.step()
    assert r.finish_reason == "cancelled" and r.slot == -1
    assert engine.pool.in_use() == 0 and all(s is None for s in engine.slots)


def test_page_pool_shares_by_reference_and_evicts_least_recently_used():
    from jaxgen.inference.pages import PagePool, PagesExhausted

    pool = PagePool(num_pages=7, page_size=4)  # 6 usable pages
    a, b = list(range(100, 109)), list(range(200, 209))  # 9 tokens: 2 whole pages each are cacheable
    pages_a, cached = pool.allocate(a, 9)
    assert cached == 0 and len(pages_a) == 3
    pool.register_prompt(a, pages_a)
    pages_a2, cached = pool.allocate(a, 9)  # the same prompt again: 2 pages shared by reference
    assert cached == 8 and pages_a2[:2] == pages_a[:2] and pool.refs[pages_a[0]] == 2
    pool.release(pages_a)
    pool.release(pages_a2)
    assert pool.in_use() == 0 and pool.available() == 6  # idle cached pages still count as available
    pages_b, _ = pool.allocate(b, 9)
    pool.register_prompt(b, pages_b)
    pool.release(pages_b)
    pool.release(pool.allocate(a, 9)[0])  # touches a's entries: b's are now the least recently used
    with pytest.raises(PagesExhausted):
        pool.allocate(list(range(300, 340)), 40)  # 10 pages: more than the pool will ever have free
    pool.allocate(list(range(300, 316)), 16)  # 4 pages: the 2 free ones, then b's 2 cached ones (LRU)
    assert pool.match_prefix(b) == [] and len(pool.match_prefix(a)) == 2


# --- hardening: one request never hurts another -----------------------------------------------------


def test_a_request_that_fails_fails_alone(engine, gen):
    """A request whose own host-side work raises (here its callback) among 16 others: it alone fails,
    with an error; the other 16 return exactly what they return without it."""
    from jaxgen.inference.engine import RequestFailed

    prompts, configs = _workload(16, seed=7)

    def explode(seq):
        raise RuntimeError("this client's callback is broken")

    requests = [
        r for i, (p, c) in enumerate(zip(prompts, configs, strict=True)) for r in engine.submit(p, c, prompt_index=i)
    ]
    (bad,) = engine.submit([3] * 30, SamplingConfig(max_new_tokens=40, ignore_eos=True), on_update=explode)
    engine.run_until_idle()
    assert bad.status == "failed" and bad.finish_reason == "error" and "callback is broken" in bad.error
    with pytest.raises(RequestFailed, match="callback is broken"):
        bad.result()
    for r, want in zip(requests, gen.generate(prompts, configs), strict=True):
        _same(r.result(), want)
    assert engine.pool.in_use() == 0 and all(s is None for s in engine.slots)
    assert engine.metrics()["requests_failed"] >= 1


def test_a_failed_device_step_fails_only_the_requests_in_flight_and_the_engine_goes_on(params, gen, monkeypatch):
    engine = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, slots=2))
    prompts, configs = _workload(5, seed=11)
    configs = [dataclasses.replace(c, stop_token_ids=[], max_new_tokens=20) for c in configs]
    requests = [
        r for i, (p, c) in enumerate(zip(prompts, configs, strict=True)) for r in engine.submit(p, c, prompt_index=i)
    ]
    real_chunk, calls = engine.runner._chunk, []

    def failing_once(params, state, limit, retire, cfg):
        calls.append(1)
        if len(calls) == 1:
            for x in jax.tree.leaves(state):  # as a failed donated call leaves it: the device state is gone
                x.delete()
            raise RuntimeError("device lost")
        return real_chunk(params, state, limit, retire, cfg=cfg)

    monkeypatch.setattr(engine.runner, "_chunk", failing_once)
    engine.run_until_idle()
    in_flight = [r for r in requests if r.status == "failed"]
    assert len(in_flight) == 2 and all("device lost" in r.error and "retry" in r.error for r in in_flight)
    wants = gen.generate(prompts, configs)
    for r, want in zip(requests, wants, strict=True):
        if r.status != "failed":  # the three that waited ran on the rebuilt state, unharmed
            _same(r.result(), want)
    again = engine.generate([prompts[0]], configs[0])[0]  # and the failed ones run fine when retried
    _same(again, wants[0])
    assert engine.pool.in_use() == 0 and engine.metrics()["requests_failed"] == 2


def test_cancel_during_prefill_is_counted_once(engine):
    before = engine.metrics()["requests_cancelled"]
    (r,) = engine.submit([7] * 20, SamplingConfig(max_new_tokens=5))
    engine._admit()  # in a slot and in the prefill queue at once
    assert r.status == "prefill"
    engine.cancel(r)
    engine.step()
    assert r.finish_reason == "cancelled" and engine.metrics()["requests_cancelled"] == before + 1


def test_drain_ends_every_request_and_admits_nothing_new(params):
    from jaxgen.inference.engine import EngineClosed

    engine = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, slots=1))
    ended = []
    running, waiting = (
        engine.submit([i] * 10, SamplingConfig(max_new_tokens=100, ignore_eos=True), on_update=ended.append)[0]
        for i in (1, 2)
    )
    engine.step()
    engine.drain(grace_s=0)
    assert running.finish_reason == "error" and waiting.finish_reason == "error"
    assert "shutting down" in running.error and {id(r) for r in ended} >= {id(running), id(waiting)}
    with pytest.raises(EngineClosed):
        engine.submit([1], SamplingConfig())
    assert engine.pool.in_use() == 0 and engine.idle()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"max_new_tokens": 2**31}, "max_new_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 258}, "top_k"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 5.0}}, "logit_bias"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop_token_ids": [257]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_out_of_range_settings_are_refused_at_submit_naming_the_field(engine, settings, field):
    """Values that used to overflow int32 inside the engine thread (failing every request in flight)."""
    from jaxgen.inference.sampling import SamplingError

    with pytest.raises(SamplingError) as info:
        engine.submit([1, 2, 3], SamplingConfig.from_dict(settings))
    assert info.value.field == field and str(info.value).startswith(field)
    assert engine.idle()


def test_a_huge_max_new_tokens_is_capped_by_the_context(engine, gen):
    """max_new_tokens up to 2**31 - 1 is allowed: the context ends the sequence ("length") first."""
    sc = SamplingConfig(max_new_tokens=2**31 - 1, temperature=0.0, ignore_eos=True)
    (got,) = engine.generate([[1, 2, 3]], sc)
    (want,) = gen.generate([[1, 2, 3]], sc)
    assert got.finish_reason == "length" and len(got.tokens) == CFG.max_seq_len - 3
    _same(got, want)


# --- the page policy: pages grow as sequences decode; a dry pool preempts the latest admitted ----------


def _mixed(n: int, seed: int):
    """Greedy and seeded requests, some with penalties, some with a stop token, each up to 10 pages long."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(5, 60, n)]
    configs = [
        SamplingConfig(
            max_new_tokens=int(rng.integers(40, 90)), temperature=(0.0, 0.8, 1.2)[i % 3], seed=int(rng.integers(1000)),
            top_k=int(rng.choice([0, 20])), ignore_eos=True,
            presence_penalty=0.8 if i % 4 == 1 else 0.0, frequency_penalty=0.5 if i % 4 == 2 else 0.0,
            repetition_penalty=1.5 if i % 4 == 3 else 1.0,
            stop_token_ids=[int(rng.integers(256))] if i % 5 == 0 else [],
        )
        for i in range(n)
    ]  # fmt: skip
    return prompts, configs


def test_outputs_under_heavy_preemption_equal_the_outputs_without_it(params, gen, engine):
    """12 requests through 8 slots and a pool that holds one or two of them whole: sequences are preempted
    and recomputed many times, and every output is exactly what it is without preemption."""
    from prometheus_client import generate_latest

    tight = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, num_pages=15))  # 14 usable
    prompts, configs = _mixed(12, seed=5)
    got = tight.generate(prompts, configs)
    preempted = tight.metrics()["requests_preempted"]
    assert preempted >= 8, preempted
    assert f"jaxgen_requests_preempted_total {preempted:.1f}" in generate_latest(tight.stats.registry).decode()
    assert tight.metrics()["recomputed_tokens_total"] > 0
    for a, b in zip(got, gen.generate(prompts, configs), strict=True):  # an independent path: no pages at all
        _same(a, b)
    for a, b in zip(got, engine.generate(prompts, configs), strict=True):  # the engine with pages to spare
        _same(a, b)
    assert tight.pool.in_use() == 0 and all(s is None for s in tight.slots) and tight.idle()
    tight.pool.clear_cache()
    assert len(tight.pool.free) == tight.pool.usable


def test_a_request_for_the_whole_context_holds_only_the_pages_it_uses(engine):
    """max_new_tokens up to the context: pages for the prompt and one decode chunk, then page by page."""
    z, steps = SERVE.page_size, SERVE.chunk_steps
    (r,) = engine.submit(list(range(30, 50)), SamplingConfig(max_new_tokens=2**31 - 1, ignore_eos=True))
    engine.step()  # the 20-token prompt prefills, then one chunk of 4 tokens decodes (its tokens: next step)
    assert r.status == "running" and len(r.pages) == 2  # 24 tokens: 2 pages, not the 16 of the whole context
    while len(r.tokens) < 60:
        engine.step()  # room for what it has, the chunk in flight and the next (serve.overlap), no more
        assert -(-(20 + len(r.tokens)) // z) <= len(r.pages) <= -(-(20 + len(r.tokens) + 2 * steps) // z)
    engine.cancel(r)
    engine.step()
    assert engine.pool.in_use() == 0 and engine.idle()


def test_preemption_frees_the_latest_admitted_and_requeues_it_first(params, engine):
    """Two sequences that each outgrow half the pool: the second admitted is preempted, goes back to the
    front of the queue with its tokens, and resumes after the first finishes."""
    alone = engine.generate([[2] * 10], SamplingConfig(max_new_tokens=60, temperature=0.9, seed=3, ignore_eos=True))[0]
    engine = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, num_pages=7, slots=2))
    sc = SamplingConfig(max_new_tokens=60, temperature=0.9, seed=3, ignore_eos=True)  # 10 + 60 tokens: 5 pages
    first, second = (engine.submit([i] * 10, sc)[0] for i in (1, 2))
    while second.preemptions == 0:
        engine.step()
        assert engine.pool.in_use() <= 6
    assert second.status == "waiting" and second.pages == [] and second.slot == -1 and second.tokens
    assert engine.waiting[0] is second and first.status == "running"
    engine.run_until_idle()
    _same(second.result(), alone)
    assert first.preemptions == 0 and engine.metrics()["requests_preempted"] == second.preemptions


def test_prompt_logprobs_equal_score_in_the_engine_and_generator(engine, gen):
    """Prompt log-probabilities, computed during the engine's chunked prefill (prompts longer than its
    32-token chunk, so scores cross chunks) and by Generator, equal teacher-forced `score`."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, k).tolist() for k in (1, 7, 45, 100)]
    c = SamplingConfig(max_new_tokens=3, temperature=0.0, prompt_logprobs=2)
    for outs in (engine.generate(prompts, c), gen.generate(prompts, c)):
        for p, out in zip(prompts, outs, strict=True):
            assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
            assert out.prompt_top_logprobs[0] is None
            if len(p) > 1:
                (want,) = gen.score([p[:1]], [p[1:]])
                np.testing.assert_allclose(out.prompt_logprobs[1:], want["token_logprobs"], atol=1e-4)
            for lp, top in zip(out.prompt_logprobs[1:], out.prompt_top_logprobs[1:], strict=True):
                best = sorted(top.values(), reverse=True)
                assert len(top) == 2 and list(top.values()) == best and lp <= best[0] + 1e-6
    plain = engine.generate(prompts, dataclasses.replace(c, prompt_logprobs=None))
    assert [o.tokens for o in plain] == [o.tokens for o in outs]  # scoring the prompt changes nothing else
    assert all(o.prompt_logprobs is None for o in plain)


def test_max_new_tokens_zero_scores_the_prompt_only(engine, gen):
    prompt = list(range(40, 90))
    c = SamplingConfig(max_new_tokens=0, prompt_logprobs=0)
    (a,), (b,) = engine.generate([prompt], c), gen.generate([prompt], c)
    assert a.tokens == b.tokens == [] and a.finish_reason == b.finish_reason == "length"
    np.testing.assert_allclose(a.prompt_logprobs[1:], b.prompt_logprobs[1:], atol=1e-4)
    assert a.prompt_top_logprobs[1] == {} == b.prompt_top_logprobs[1]


def test_score_greedy_flag_matches_the_argmax(gen):
    prompt = [5, 6, 7]
    first = gen.generate([prompt], SamplingConfig(max_new_tokens=4, temperature=0.0))[0].tokens
    (g,) = gen.score([prompt], [first])
    assert g["greedy"]
    other = [(first[0] + 1) % 256, *first[1:]]
    assert not gen.score([prompt], [other])[0]["greedy"]


def test_engine_on_a_data_and_tensor_mesh_equals_one_device(params, engine):
    """4 devices, (data=2, tensor=2): params sharded by the model's rules, the same tokens for a mixed workload."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
    placed = jax.device_put(params, model.param_shardings(CFG, mesh))
    sharded = Engine(placed, CFG, Tokenizer.byte_level(), SERVE, mesh=mesh)
    prompts, configs = _workload(24, seed=3)
    for a, b in zip(sharded.generate(prompts, configs), engine.generate(prompts, configs), strict=True):
        _same(a, b)
    k = sharded.state.cache.k  # (K, L, Q, Z, H): each device holds its kv head of every page
    assert k.sharding.shard_shape(k.shape)[0] == CFG.num_kv_heads // 2 and len(k.devices()) == 4


def test_a_step_prefills_every_admitted_prompt_in_one_call_and_the_lag_changes_no_token(params, gen, monkeypatch):
    """With a token budget for them all, the first step admits 8 prompts of like lengths and prefills them in
    one call (`scheduler.prefill_calls`); with and without the one-chunk lag of `serve.overlap` (the host takes
    a chunk's tokens while the next runs) every request ends as the Generator's, stop strings and early
    stops included (preemption under the lag: the page-exhaustion tests, which run with it)."""
    prompts, configs = _workload(24, seed=5)
    prompts[:8] = [p[:40] + [7] * (40 - len(p)) for p in prompts[:8]]  # like lengths share a call (prefill_calls)
    configs[3] = dataclasses.replace(configs[3], stop=["a"], max_new_tokens=30)  # a stop string, found a chunk late
    wants = gen.generate(prompts, configs)
    for overlap in (True, False):
        serve = dataclasses.replace(SERVE, prefill_chunk=2048, overlap=overlap)
        engine = Engine(params, CFG, Tokenizer.byte_level(), serve)
        calls = []
        real = engine.runner._admit_rows

        def counted(*args, _real=real, calls=calls, **kwargs):
            calls.append(int((args[3].positions >= 0).any(axis=1).sum()))  # chunks in the call
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "_admit_rows", counted)
        requests = [r for i, (p, c) in enumerate(zip(prompts, configs, strict=True))
                    for r in engine.submit(p, c, prompt_index=i)]  # fmt: skip
        engine.step()
        assert calls == [8], (overlap, calls)
        engine.run_until_idle()
        for r, want in zip(requests, wants, strict=True):
            _same(r.result(), want)
        assert engine.pool.in_use() == 0 and engine.idle()
