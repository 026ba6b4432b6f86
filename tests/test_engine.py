"""The serving engine against `Generator` (an independent decode path over a contiguous cache)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.engine import Engine
from jaxgen.generate import Generator
from jaxgen.paged import PageError
from jaxgen.sampling import SamplingConfig
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
    """6 pages of pool for requests that need 3-4 pages each: at most two run at once, all finish."""
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
    assert most == 2
    for r, want in zip(requests, gen.generate(prompts, configs), strict=True):
        _same(r.result(), want)
    engine.pool.clear_cache()
    assert engine.pool.in_use() == 0 and len(engine.pool.free) == engine.pool.usable


def test_impossible_requests_are_refused_before_queueing(engine):
    from jaxgen.sampling import SamplingError

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
    from jaxgen.paged import PagePool, PagesExhausted

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
