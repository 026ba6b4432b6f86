"""The engine as reinforcement learning uses it: weights swapped in place, sleep and wake, and the
sampler's log-probabilities against the training forward's (`jaxgen.rl.objectives.token_logprobs`).

One tiny float32 model, one engine with a small page pool (so a busy batch preempts) and small prefill
chunks (so long prompts prefill in several chunks). References are the training forward itself."""

import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine, EngineAsleep
from jaxgen.inference.sampling import SamplingConfig, SamplingError
from jaxgen.rl.objectives import token_logprobs
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128)
SERVE = ServeConfig(slots=4, page_size=8, num_pages=26, chunk_steps=4, prefill_chunk=32)
T = 128  # the reference forward's padded length (one compiled shape)
PROMPT_LENS = (5, 23, 40, 61)  # ragged; 40 and 61 prefill in two chunks of at most 32


def _params(seed: int, sharpen: float = 5.0):
    p = model.init_params(CFG, jax.random.key(seed))
    return jax.tree.map(lambda w: w * sharpen if w.ndim > 1 else w, p)  # sharper logits: no near-ties in argmax


@pytest.fixture(scope="module")
def p1():
    return _params(0)


@pytest.fixture(scope="module")
def p2():
    return _params(1)


@pytest.fixture(scope="module")
def engine(p1):
    return Engine(p1, CFG, Tokenizer.byte_level(), SERVE)


@pytest.fixture
def on_p1(engine, p1):
    """The engine on p1 at the start of a test, whatever the test before it left."""
    engine.update_params(p1)
    return engine


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, k).tolist() for k in PROMPT_LENS]


def _padded(seqs):
    tokens = np.zeros((len(seqs), T), np.int32)
    positions = np.full((len(seqs), T), -1, np.int32)
    for i, q in enumerate(seqs):
        tokens[i, : len(q)], positions[i, : len(q)] = q, np.arange(len(q))
    return tokens, positions


@functools.partial(jax.jit, static_argnames="cfg")
def _logprobs(params, tokens, positions, temperature, cfg):
    return token_logprobs(params, tokens, positions, cfg=cfg, temperature=temperature)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _argmax_at(params, tokens, positions, last, cfg):
    logits, _ = model.forward(params, tokens, positions, cfg=cfg)
    return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1)


def _greedy(params, prompts, steps: int) -> list[list[int]]:
    """Greedy continuations by the training forward over the whole sequence at each step."""
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        tokens, positions = _padded(seqs)
        nxt = _argmax_at(params, tokens, positions, np.array([len(q) - 1 for q in seqs]), cfg=CFG)
        for q, t in zip(seqs, np.asarray(nxt).tolist(), strict=True):
            q.append(t)
    return [q[len(p) :] for q, p in zip(seqs, prompts, strict=True)]


GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)


# --- weights swapped in place ---------------------------------------------------------------------


def test_swapped_weights_give_the_new_models_outputs_without_compiling(on_p1, p1, p2):
    engine, prompts = on_p1, _prompts()
    assert [c.tokens for c in engine.generate(prompts, GREEDY)] == _greedy(p1, prompts, 8)
    compiled = engine.compilations
    engine.update_params(p2)
    assert [c.tokens for c in engine.generate(prompts, GREEDY)] == _greedy(p2, prompts, 8)
    assert engine.compilations == compiled  # the same programs, the new weights as their argument
    engine.update_params(model.decode_params(p1, SERVE.slots))  # the decode layout is taken as it is
    assert [c.tokens for c in engine.generate(prompts, GREEDY)] == _greedy(p1, prompts, 8)
    assert engine.compilations == compiled


def test_the_prefix_cache_never_serves_pages_of_the_old_weights(on_p1, p2):
    engine, prompt = on_p1, list(range(30, 60))  # 30 tokens: 3 whole pages of 8 cacheable
    engine.generate([prompt], GREEDY)
    hits = engine.pool.hits
    engine.generate([prompt], GREEDY)
    assert engine.pool.hits - hits == 24  # on the same weights the pages are reused
    engine.update_params(p2)
    hits = engine.pool.hits
    assert engine.generate([prompt], GREEDY)[0].tokens == _greedy(p2, [prompt], 8)[0]
    assert engine.pool.hits == hits  # nothing computed with p1 was read
    engine.generate([prompt], GREEDY)
    assert engine.pool.hits - hits == 24  # and pages computed with p2 are cached again


def test_requests_in_flight_are_recomputed_on_the_new_weights_keeping_their_tokens(on_p1, p2):
    engine, prompts = on_p1, _prompts(1)
    sc = SamplingConfig(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    requests = [r for i, p in enumerate(prompts) for r in engine.submit(p, sc, prompt_index=i)]
    while not any(len(r.tokens) >= 4 for r in requests):
        engine.step()
    before = [list(r.tokens) for r in requests]
    engine.update_params(p2)
    assert all(r.slot == -1 for r in requests) and engine.pool.in_use() == 0  # all preempted
    engine.run_until_idle()
    for r, kept, p in zip(requests, before, prompts, strict=True):
        out = r.result().tokens
        assert out[: len(kept)] == kept  # emitted on p1, kept
        assert out[len(kept) :] == _greedy(p2, [p + kept], 16 - len(kept))[0]  # the rest on p2


def test_the_engine_shares_no_buffer_with_the_callers_params(on_p1, p1):
    engine, mine = on_p1, _params(0)  # p1's values, in arrays of this test's own
    engine.update_params(mine)
    for x in jax.tree.leaves(mine):
        x.delete()  # as a trainer's step does when it donates its params
    assert engine.generate(_prompts()[:1], GREEDY)[0].tokens == _greedy(p1, _prompts()[:1], 8)[0]


def test_params_of_another_structure_are_refused_naming_the_leaf(on_p1, p1):
    engine = on_p1
    wrong_shape = p1 | {"embed_vd": jnp.zeros((CFG.vocab_size, 32))}
    with pytest.raises(ValueError, match=r"embed_vd.*float32\[257, 32\].*float32\[257, 64\]"):
        engine.update_params(wrong_shape)
    with pytest.raises(ValueError, match=r"embed_vd.*bfloat16"):
        engine.update_params(p1 | {"embed_vd": p1["embed_vd"].astype(jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"extra.*unexpected"):
        engine.update_params(p1 | {"extra": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"final_norm.*missing"):
        engine.update_params({k: v for k, v in p1.items() if k != "final_norm"})
    assert engine.generate(_prompts()[:1], GREEDY)[0].tokens == _greedy(p1, _prompts()[:1], 8)[0]  # unchanged


# --- sleep and wake -------------------------------------------------------------------------------


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_frees_the_page_pool_and_wake_up_restores_it(on_p1, p1, capsys):
    engine, prompts = on_p1, _prompts(2)
    pool_bytes = engine.state.cache.k.nbytes + engine.state.cache.v.nbytes
    requests = [r for i, p in enumerate(prompts) for r in engine.submit(p, GREEDY, prompt_index=i)]
    engine.step()  # some in flight: they are preempted and wait in the queue
    awake = _live_bytes()
    engine.sleep()
    asleep = _live_bytes()
    with pytest.raises(EngineAsleep, match="wake_up"):
        engine.submit(prompts[0], GREEDY)  # refused, clearly
    with pytest.raises(EngineAsleep, match="wake_up"):
        engine.run_until_idle()  # the queued ones cannot run
    engine.cancel(requests[-1])  # a client gone away while the engine sleeps: its request ends now
    engine.step()
    assert requests[-1].done_event.is_set() and requests[-1].result().finish_reason == "cancelled"
    compiled = engine.compilations
    engine.wake_up()
    woken = _live_bytes()
    engine.run_until_idle()
    assert [r.result().tokens for r in requests[:-1]] == _greedy(p1, prompts[:-1], 8)
    assert engine.compilations == compiled
    with capsys.disabled():
        print(f"\nlive device bytes: awake {awake}, asleep {asleep}, woken {woken}; pool {pool_bytes}")
    assert awake - asleep >= pool_bytes and woken - asleep >= pool_bytes


def test_sleep_and_wake_up_with_the_engine_thread_and_the_server(on_p1, p1):
    from fastapi.testclient import TestClient

    from jaxgen.serving.server import create_app

    engine, prompts = on_p1, _prompts(4)
    engine.start()
    try:
        engine.sleep()
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
        r = TestClient(create_app(engine, "m")).post("/v1/completions", json=body)
        assert r.status_code == 503 and "wake_up" in r.json()["error"]["message"]
        engine.wake_up()
        requests = [r for i, p in enumerate(prompts) for r in engine.submit(p, GREEDY, prompt_index=i)]
        engine.sleep()  # whatever ran is preempted; the thread waits
        engine.cancel(requests[0])
        assert requests[0].done_event.wait(30) and requests[0].finish_reason == "cancelled"  # ended asleep
        engine.wake_up()
        assert [r.result(30).tokens for r in requests[1:]] == _greedy(p1, prompts[1:], 8)
    finally:
        engine.stop()


# --- log-probabilities for reinforcement learning -------------------------------------------------


# the bound reached: float32 rounding of the logits, which grows with their size (the engine's decode
# layout and paged attention sum in another order than the training forward: measured in the test's output)
@pytest.mark.parametrize(("sharpen", "bound"), [(1.0, 2e-6), (5.0, 5e-5)])
def test_processed_logprobs_equal_the_training_forwards_over_a_ragged_preempting_batch(on_p1, sharpen, bound, capsys):
    engine, p2 = on_p1, _params(1, sharpen)  # logits within about +-0.7 (as initialised) and +-4
    engine.update_params(p2)  # and on swapped weights
    prompts, temps = _prompts(3), (0.7, 1.0, 0.85, 1.0)
    requests = []
    for i, (p, t) in enumerate(zip(prompts, temps, strict=True)):
        sc = SamplingConfig(max_new_tokens=40, temperature=t, n=3, seed=i, logprobs_mode="processed")
        requests += engine.submit(p, sc, prompt_index=i)
    preempted = engine.metrics()["requests_preempted"]
    engine.run_until_idle()
    assert engine.metrics()["requests_preempted"] > preempted  # the small pool preempted some
    diffs = []
    for t in sorted(set(temps)):
        rows = [r for r in requests if temps[r.prompt_index] == t]
        tokens, positions = _padded([r.prompt + r.result().tokens for r in rows])
        ref = np.asarray(_logprobs(p2, tokens, positions, np.float32(t), cfg=CFG))
        for r, lp in zip(rows, ref, strict=True):
            n = len(r.tokens)
            assert n > 0 and np.isfinite(r.logprobs).all()
            diffs += np.abs(np.asarray(r.logprobs) - lp[len(r.prompt) - 1 : len(r.prompt) - 1 + n]).tolist()
    diffs = np.asarray(diffs)
    with capsys.disabled():
        q = np.quantile(diffs, [0.5, 0.9, 0.99, 1.0])
        print(f"\nweights x{sharpen}: |engine - training| over {diffs.size} tokens: median {q[0]:.2e} p90 {q[1]:.2e} "
              f"p99 {q[2]:.2e} max {q[3]:.2e}")  # fmt: skip
    assert diffs.max() < bound


def test_raw_logprobs_stay_the_models_and_processed_needs_no_speculation(on_p1):
    engine, prompt = on_p1, _prompts()[1]
    raw, processed = (
        engine.generate([prompt], SamplingConfig(max_new_tokens=6, temperature=0.5, seed=3, logprobs_mode=m))[0]
        for m in ("raw", "processed")
    )
    assert raw.tokens == processed.tokens  # the mode changes what is reported, not what is drawn
    assert not np.allclose(raw.logprobs, processed.logprobs)
    forced = [
        engine.generate([prompt], SamplingConfig(max_new_tokens=3, logit_bias=[(65, 1e6)], seed=3, logprobs_mode=m))[0]
        for m in ("raw", "processed")
    ]  # the bias is part of the processed distribution only
    assert forced[0].tokens == forced[1].tokens == [65, 65, 65]
    assert max(forced[0].logprobs) < -1 and forced[1].logprobs == [0.0, 0.0, 0.0]
    with pytest.raises(SamplingError, match="logprobs_mode"):
        SamplingConfig(logprobs_mode="tempered")
    with pytest.raises(SamplingError, match="num_speculative_tokens"):
        SamplingConfig(logprobs_mode="processed", num_speculative_tokens=2)


# --- the server's admin route ---------------------------------------------------------------------


def test_the_admin_route_swaps_in_a_folders_weights_behind_its_own_token(on_p1, p2, tmp_path):
    import dataclasses

    from fastapi.testclient import TestClient

    from jaxgen.hf.export import save_pretrained
    from jaxgen.serving.server import create_app

    engine, route = on_p1, "/v1/admin/update_weights"
    folder = str(save_pretrained(tmp_path / "p2", p2, CFG, Tokenizer.byte_level()))
    assert TestClient(create_app(engine, "m")).post(route, json={"path": folder}).status_code == 404  # off
    admin = dataclasses.replace(engine.serve, admin_token="admin-secret")
    client = TestClient(create_app(engine, "m", api_key="s3cret", serve=admin))
    assert client.post(route, json={"path": folder}).status_code == 401
    r = client.post(route, json={"path": folder}, headers={"Authorization": "Bearer s3cret"})  # the API key
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_admin_token"
    auth = {"Authorization": "Bearer admin-secret"}
    r = client.post(route, json={"path": str(tmp_path / "nothing")}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    prompts = _prompts()
    engine.generate(prompts, GREEDY)  # every program compiled
    compiled = engine.compilations
    r = client.post(route, json={"path": folder}, headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "updated"
    assert [c.tokens for c in engine.generate(prompts, GREEDY)] == _greedy(p2, prompts, 8)
    assert engine.compilations == compiled
