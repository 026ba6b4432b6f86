import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import decode_loop
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig, SamplingError, sample
from jaxgen.model.kvcache import KVCache
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.step import cross_entropy

CFG = ModelConfig(vocab_size=300, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=96)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
PROMPTS = ["def fib(n):", "import os\nimport s", "x", "class Foo(Bar):\n    def __init__(self"]


@pytest.fixture(scope="module")
def stacked():
    params = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda p: p * 8 if p.ndim >= 2 else p, params)  # peaked logits: decisive argmax


@pytest.fixture(scope="module")
def gen(stacked):
    return Generator(stacked, CFG, Tokenizer.byte_level(), max_batch=8, chunk_steps=5)


def rollout(gen, prompt, steps):
    """The definition of greedy generation: a full forward pass without a cache at every step."""
    ids = gen.tokenizer.encode(prompt)
    n, width = len(ids), CFG.max_seq_len  # one fixed width (padding at position -1): one compilation
    full = jax.jit(lambda p, t, pos: model.forward(p, t, pos, cfg=CFG)[0])
    for _ in range(steps):
        tokens = jnp.asarray([ids + [0] * (width - len(ids))])
        positions = jnp.asarray([list(range(len(ids))) + [-1] * (width - len(ids))])
        ids.append(int(jnp.argmax(full(gen.params, tokens, positions)[0, len(ids) - 1])))
    return ids[n:]


@pytest.mark.parametrize("sums", [False, True], ids=["products", "sums"])
def test_greedy_generate_equals_argmax_rollout_for_ragged_prompts(gen, sums, request):
    """Decoding with its attention products as matrix products (the suite's default) and as written-out sums
    (`kernels.cpu.products_as_sums`, what a user's CPU process runs) both give the rollout's tokens."""
    if sums:
        request.getfixturevalue("cpu_decode_sums")
    outs = gen.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == rollout(gen, prompt, 12)
        assert out.finish_reason == "length" and len(out.logprobs) == 12


def test_float32_weights_of_a_bfloat16_model_are_held_in_bfloat16(stacked):
    """A bfloat16 model given its float32 master weights (a run folder served on a GPU) holds them in
    bfloat16 once (`model.decode_params`), so the decode loop casts no weight at any step, and generates
    what a Generator given the bfloat16 weights generates."""
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    halves = jax.tree.map(lambda w: w.astype(jnp.bfloat16), stacked)
    held, given = (Generator(p, cfg, Tokenizer.byte_level(), max_batch=2, chunk_steps=4) for p in (stacked, halves))
    assert {w.dtype for w in jax.tree.leaves(stacked)} == {jnp.dtype(jnp.float32)}
    assert {w.dtype for w in jax.tree.leaves(held.params)} == {jnp.dtype(jnp.bfloat16)}
    few = dataclasses.replace(GREEDY, max_new_tokens=6)
    assert [o.tokens for o in held.generate(PROMPTS[:2], few)] == [o.tokens for o in given.generate(PROMPTS[:2], few)]


def test_batch_invariance_greedy_and_sampled(gen):
    sampled = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=11, ignore_eos=True)
    for sc in (GREEDY, sampled):
        alone = gen.generate([PROMPTS[2]], sc)[0]
        batched = gen.generate(PROMPTS, sc)[2]
        assert alone.tokens == batched.tokens
        np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-5)


def test_values_do_not_recompile(gen):
    gen.generate(PROMPTS, GREEDY)
    before = gen.compilations
    for t, seed in ((0.5, 1), (1.3, 2), (0.0, 3)):
        gen.generate(PROMPTS, dataclasses.replace(GREEDY, temperature=t, seed=seed, top_k=5, min_p=0.05))
    assert gen.compilations == before


def test_prompt_lengths_are_bucketed(gen):
    before = gen.compilations
    prompts = ["a" * n for n in range(1, 40, 3)]  # 13 distinct lengths
    for p in prompts:
        gen.generate([p], dataclasses.replace(GREEDY, max_new_tokens=4))
    assert gen.compilations - before <= 6  # prompt buckets 16, 32, 64 (x prefill and loop at most)


def test_seed_changes_samples_and_n_shares_the_prompt(gen):
    sc = SamplingConfig(temperature=1.0, max_new_tokens=16, ignore_eos=True, n=3, seed=5)
    outs = gen.generate([PROMPTS[0]], sc)
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(0, 0), (0, 1), (0, 2)]
    assert len({tuple(o.tokens) for o in outs}) == 3
    assert gen.generate([PROMPTS[0]], sc)[1].tokens == outs[1].tokens  # reproducible


def test_stop_conditions(gen):
    eos = gen.tokenizer.eos_id
    forced = SamplingConfig(temperature=0.0, max_new_tokens=10, logit_bias=((eos, 1e4),))
    out = gen.generate([PROMPTS[0]], forced)[0]
    assert out.tokens == [eos] and out.finish_reason == "stop" and out.text == ""
    full = gen.generate([PROMPTS[1]], GREEDY)[0]
    stop_tok = full.tokens[4]
    first = full.tokens.index(stop_tok)
    out = gen.generate([PROMPTS[1]], dataclasses.replace(GREEDY, stop_token_ids=(stop_tok,)))[0]
    assert out.tokens == full.tokens[: first + 1] and out.finish_reason == "stop"
    seq = tuple(full.tokens[5:7])  # a two-token stop sequence, checked inside the loop
    end = next(i + 2 for i in range(len(full.tokens) - 1) if tuple(full.tokens[i : i + 2]) == seq)
    out = gen.generate([PROMPTS[1]], dataclasses.replace(GREEDY, stop_token_sequences=(seq,)))[0]
    assert out.tokens == full.tokens[:end] and out.finish_reason == "stop"
    assert out.text == gen.tokenizer.decode(full.tokens[: end - 2])
    stop_text = gen.tokenizer.decode(full.tokens[6:8])
    out = gen.generate([PROMPTS[1]], dataclasses.replace(GREEDY, stop=(stop_text,)))[0]
    assert out.finish_reason == "stop" and stop_text not in out.text
    assert full.text.startswith(out.text) and len(out.text) == full.text.index(stop_text)


def test_cache_end_gives_length_never_silence(gen):
    prompt = "y" * (CFG.max_seq_len - 5)
    out = gen.generate([prompt], dataclasses.replace(GREEDY, max_new_tokens=50))[0]
    assert out.finish_reason == "length" and 1 <= len(out.tokens) <= 5


def test_bad_inputs_are_clear_errors(gen):
    with pytest.raises(SamplingError, match=r"temperature=-1\.0 is not allowed"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(SamplingError, match=r"top_p=0.0 is not allowed: a number in \(0, 1\]"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(SamplingError, match="unknown sampling field 'temp'"):
        SamplingConfig.from_dict({"temp": 1})
    with pytest.raises(SamplingError, match="prompt 0 has 200 tokens; the model's context is 96"):
        gen.generate(["z" * 200], GREEDY)


def test_streaming_yields_growing_prefixes(gen):
    updates = [u[0] for u in gen.stream([PROMPTS[0]], dataclasses.replace(GREEDY, max_new_tokens=12))]
    assert len(updates) == 3  # chunks of 5 steps
    lengths = [len(u.tokens) for u in updates]
    assert lengths == [5, 10, 12]
    assert [u.finish_reason for u in updates] == ["", "", "length"]
    assert updates[-1].tokens[:5] == updates[0].tokens


def test_top_logprobs(gen):
    out = gen.generate([PROMPTS[0]], dataclasses.replace(GREEDY, logprobs=3))[0]
    for tok, lp, alts in zip(out.tokens, out.logprobs, out.top_logprobs):
        assert len(alts) == 3 and max(alts, key=alts.get) == tok  # greedy picks the top one
        assert np.isclose(alts[tok], lp, atol=1e-5)


def test_score_equals_training_loss(gen):
    prompt, cont = "def add(a, b):", "\n    return a + b\n"
    (s,) = gen.score([prompt], [cont])
    ids = gen.tokenizer.encode(prompt + cont)
    n_prompt = len(gen.tokenizer.encode(prompt))
    tokens = jnp.asarray([ids])
    logits, _ = model.forward(gen.params, tokens[:, :-1], jnp.arange(len(ids) - 1)[None], cfg=CFG)
    mask = (jnp.arange(len(ids) - 1) >= n_prompt - 1)[None]
    total, count = cross_entropy(logits, tokens[:, 1:], mask)
    assert s["tokens"] == int(count) == len(gen.tokenizer.encode(cont))
    np.testing.assert_allclose(s["nll"], float(total / count), rtol=1e-5)
    batched = gen.score([PROMPTS[1], prompt], ["abc", cont])[1]
    np.testing.assert_allclose(batched["nll"], s["nll"], rtol=1e-5)


def test_score_shared_equals_score(gen):
    """Prompts run once with their continuations reading the KV cache (ragged prompts, shared by several
    continuations, continuations of one token and of many, more pairs than max_batch) equal `score`."""
    rng = np.random.default_rng(5)
    contexts = [rng.integers(0, 256, k).tolist() for k in (1, 9, 30)]
    prompts, conts = [], []
    for ctx in contexts:
        for k in (1, 2, 7, 20):
            prompts.append(ctx)
            conts.append(rng.integers(0, 256, k).tolist())
    small = Generator(gen.params, CFG, gen.tokenizer, max_batch=8)
    got, want = small.score_shared(prompts, conts), gen.score(prompts, conts)
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"] and g["greedy"] == w["greedy"]
        np.testing.assert_allclose(g["token_logprobs"], w["token_logprobs"], atol=1e-4)
    greedy = gen.generate([contexts[1]], SamplingConfig(max_new_tokens=3, temperature=0.0))[0].tokens
    assert small.score_shared([contexts[1]], [greedy])[0]["greedy"]


@pytest.mark.parametrize(
    "cache_dtype, cache_layout", [("float32", "blocks"), ("bfloat16", "blocks"), ("bfloat16", "flat")]
)
def testdecode_loop_updates_the_cache_in_place(gen, cache_dtype, cache_layout, cpu_decode_sums):
    """The compiled loop writes the cache with dynamic-update-slice and never copies a block or writes
    one back as floats (a block is read as floats by the products: that is the one conversion allowed),
    in either layout of the cache (`kernels.cache_layout`), as a user's CPU process compiles it (the
    products as sums)."""
    cfg = dataclasses.replace(CFG, cache_layout=cache_layout)
    gen = Generator(gen.params, cfg, gen.tokenizer, max_batch=8, chunk_steps=5, cache_dtype=cache_dtype)
    captured = {}
    real = gen._loop

    def spy(params, state, cfg):
        captured["state"] = jax.tree.map(lambda x: x, state)
        return real(params, state, cfg=cfg)

    gen._loop = spy
    try:
        gen.generate([PROMPTS[0]], dataclasses.replace(GREEDY, max_new_tokens=40))
    finally:
        gen._loop = real
    state = captured["state"]
    assert state.cache.num_blocks == (1 if cache_layout == "flat" else 2)
    hlo = jax.jit(decode_loop, static_argnames="cfg", donate_argnums=1).lower(gen.params, state, cfg=cfg)
    text = hlo.compile().as_text()
    dims = ",".join(map(str, state.cache.k[0][0].shape))  # each layer's and block's buffer
    shape = {"float32": "f32", "bfloat16": "u16"}[cache_dtype] + f"[{dims}]"
    writes = [line for line in text.splitlines() if f"= {shape}" in line and "dynamic-update-slice" in line]
    copies = [line for line in text.splitlines() if re.search(rf"= {re.escape(shape)}\S* copy\(", line)]
    # XLA:CPU's bfloat16 trap: a whole buffer upcast, updated as floats and converted back every step
    write_back = "|".join(
        rf"= {kind}\[{dims}\]\S* {op}\("
        for kind, op in [("bf16", "convert"), ("u16", "bitcast-convert"), ("(f32|bf16)", "dynamic-update-slice")]
    )
    converts = [line for line in text.splitlines() if cache_dtype == "bfloat16" and re.search(write_back, line)]
    assert len(writes) >= 2 and not copies and not converts


# --- sampling distributions ---------------------------------------------------------------------


def _exact(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    cum = 0.0
    for rank, i in enumerate(order):
        if (top_k and rank >= top_k) or (rank > 0 and cum >= top_p) or p[i] < min_p * p[order[0]]:
            continue
        keep[i] = True
        cum += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.0, top_k=3), dict(temperature=0.8, top_p=0.7),
     dict(temperature=1.0, min_p=0.2), dict(temperature=1.5, top_k=5, top_p=0.9)],
    ids=str,
)  # fmt: skip
def test_sampling_frequencies_match_the_renormalised_distribution(settings):
    logits = np.array([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0], np.float32)
    n = 20000
    sp = SamplingArrays.stack([SamplingConfig(seed=i, **settings) for i in range(n)], len(logits))
    zeros = jnp.zeros((n, len(logits)), jnp.int32)
    draws = jax.jit(sample)(jnp.broadcast_to(logits, (n, len(logits))), sp, 0, zeros > 0, zeros)
    observed = np.bincount(np.asarray(draws), minlength=len(logits))
    expected = _exact(logits.astype(np.float64), **settings) * n
    assert observed[expected == 0].sum() == 0  # truncated tokens are never drawn
    support = expected > 0
    chi2 = (((observed - expected)[support]) ** 2 / expected[support]).sum()
    df = support.sum() - 1
    # p = 0.001 critical value (Wilson-Hilferty approximation of the chi-square quantile)
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0
    assert chi2 <= critical + 1e-9, (chi2, critical, observed, expected)


# --- beam search --------------------------------------------------------------------------------


def test_beam_width_one_equals_greedy(gen):
    from jaxgen.inference.beam import beam_search

    greedy = gen.generate(PROMPTS, dataclasses.replace(GREEDY, ignore_eos=False))
    beams = beam_search(gen, PROMPTS, width=1, max_new_tokens=12, length_penalty=0.0)
    for g, hyps in zip(greedy, beams):
        assert g.finish_reason == "length"  # no end-of-sequence token in the way
        assert hyps[0].tokens == g.tokens
        np.testing.assert_allclose(hyps[0].logprob, sum(g.logprobs), rtol=1e-4)


def test_beam_search_finds_the_best_sequence_greedy_misses():
    """Vocabulary of 6: with width 36 >= V^2, beam search over 3 tokens is exhaustive, so it must
    return the highest-scoring continuation (checked against all 216 by `score`)."""
    import itertools

    from jaxgen.inference.beam import beam_search

    cfg = ModelConfig(vocab_size=6, num_layers=1, d_model=16, num_heads=2, d_ff=32, max_seq_len=32)
    tok = Tokenizer.byte_level()  # its end-of-text id (256) lies outside this vocabulary: never produced
    all_seqs = [list(s) for s in itertools.product(range(6), repeat=3)]
    for seed in range(20):
        params = jax.tree.map(lambda p: p * 30, model.init_params(cfg, jax.random.key(seed)))
        g = Generator(params, cfg, tok, max_batch=256)
        prompt = [1, 2, 3]
        scores = [s["logprob"] for s in g.score([prompt] * len(all_seqs), all_seqs)]
        best = all_seqs[int(np.argmax(scores))]
        greedy = g.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=3))[0].tokens
        if greedy == best:
            continue  # look for a model where greedy is not optimal
        hyps = beam_search(g, [prompt], width=36, max_new_tokens=3, length_penalty=0.0)[0]
        assert hyps[0].tokens == best
        np.testing.assert_allclose(hyps[0].logprob, max(scores), rtol=1e-4)
        assert hyps[0].logprob > scores[all_seqs.index(greedy)]
        return
    pytest.fail("no model among 20 seeds where greedy misses the best sequence")


def test_beam_search_keeps_the_best_finished_hypotheses(gen):
    """Every token ends a hypothesis: the result is the `width` most likely first tokens, in order."""
    from jaxgen.inference.beam import beam_search

    first = gen.score([PROMPTS[0]] * CFG.vocab_size, [[t] for t in range(CFG.vocab_size)])
    expected = np.argsort([-s["logprob"] for s in first])[:3].tolist()
    for early in (True, False):
        hyps = beam_search(gen, [PROMPTS[0]], width=3, max_new_tokens=10, length_penalty=1.0,
                           early_stopping=early, stop_token_ids=tuple(range(CFG.vocab_size)))[0]  # fmt: skip
        assert [h.tokens for h in hyps] == [[t] for t in expected]
        np.testing.assert_allclose([h.logprob for h in hyps], [first[t]["logprob"] for t in expected], rtol=1e-4)
    with pytest.raises(SamplingError, match="width=0 is not allowed"):
        beam_search(gen, PROMPTS, width=0)


@pytest.mark.parametrize("cache_layout", ["blocks", "flat"])
@pytest.mark.parametrize("end, tokens", [(60, 9), (64, 1), (63, 1), (0, 200), (250, 9)])
def test_cache_writes_land_in_the_right_blocks(end, tokens, cache_layout):
    """A write of T tokens at slot `end` lands at slots [end, end + T) whichever blocks they straddle,
    and nowhere else (slots past the cache's end are dropped, never clamped onto earlier ones): the
    blocks, laid side by side, equal one buffer written with a plain slice. The flat layout: one block."""
    cache = KVCache.init(dataclasses.replace(CFG, cache_layout=cache_layout), 2, 256)
    assert (cache.num_blocks, cache.block_size) == ((1, 256) if cache_layout == "flat" else (4, 64))
    cache = cache.replace(end=jnp.int32(end))
    r = np.random.default_rng(end)
    k_new, v_new = (r.normal(size=(2, tokens, CFG.kv_heads, CFG.head_size)).astype(np.float32) for _ in range(2))
    k_all, v_all, _, _ = jax.jit(cache.write, static_argnums=1)(cache.arrays(), 1, k_new, v_new, None)
    keys = lambda blocks: np.concatenate(blocks, axis=3).swapaxes(2, 3)  # stored (B, K, H, S / N)
    values = lambda blocks: np.concatenate(blocks, axis=2)  # stored (B, K, S / N, H)
    for got, new, joined in [(k_all, k_new, keys), (v_all, v_new, values)]:
        want = np.zeros((2, CFG.kv_heads, 256, CFG.head_size), np.float32)
        want[:, :, end : end + tokens] = new.transpose(0, 2, 1, 3)[:, :, : 256 - end]
        np.testing.assert_array_equal(joined(got[1]), want)
        assert not np.any(joined(got[0]))  # the other layer untouched


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_flat_cache_layout_generates_what_the_blocks_layout_does(gen, cache_dtype):
    """The contiguous cache's two layouts (`kernels.cache_layout`: blocks on CPU, flat on accelerators)
    store the same values and attend over the same slots: ragged prompts, greedy and sampled (n=2: the
    prompt's cache rows taken twice) and penalised, give the same tokens and log-probabilities. (A
    bfloat16 cache: `testdecode_loop_updates_the_cache_in_place`.)"""
    make = lambda cfg: Generator(gen.params, cfg, gen.tokenizer, max_batch=8, chunk_steps=5, cache_dtype=cache_dtype)
    configs = [
        GREEDY,
        SamplingConfig(temperature=0.9, top_k=40, seed=5, max_new_tokens=12, n=2, ignore_eos=True),
        SamplingConfig(temperature=0.7, seed=3, max_new_tokens=20, frequency_penalty=0.3, ignore_eos=True),
        GREEDY,
    ]
    blocks = gen if cache_dtype == "float32" else make(CFG)  # CFG: auto, blocks on CPU
    want = blocks.generate(PROMPTS, configs)
    got = make(dataclasses.replace(CFG, cache_layout="flat")).generate(PROMPTS, configs)
    assert len(got) == len(want) == 5
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def test_bfloat16_cache_is_uint16_on_cpu_close_and_in_place(gen):
    params = model.init_params(CFG, jax.random.key(0))  # unscaled: the peaked test model amplifies rounding
    bf = Generator(params, CFG, gen.tokenizer, max_batch=8, chunk_steps=5, cache_dtype="bfloat16")
    cache = KVCache.init(CFG, 2, 32, "bfloat16")
    assert all(k.dtype == jnp.uint16 for k in jax.tree.leaves(cache.k))  # bfloat16 bits: XLA:CPU updates these in place
    tokens = jax.random.randint(jax.random.key(7), (2, 20), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    full, _ = model.forward(params, tokens, positions, cfg=CFG)
    step = jax.jit(lambda c, t, p: model.forward(params, t, p, c, cfg=CFG))
    logits, cache = step(cache, tokens[:, :8], positions[:, :8])
    outs = [logits]
    for t in range(8, 20):
        logits, cache = step(cache, tokens[:, t : t + 1], positions[:, t : t + 1])
        outs.append(logits)
    err = float(jnp.abs(jnp.concatenate(outs, 1) - full).max())
    assert 0 < err < 0.01 * float(jnp.abs(full).max())  # bfloat16 rounding, nothing worse
    out = bf.generate(PROMPTS[:2], dataclasses.replace(GREEDY, max_new_tokens=6))
    assert all(len(o.tokens) == 6 for o in out)
    with pytest.raises(SamplingError, match="cache_dtype='float16' is not allowed"):
        Generator(gen.params, CFG, gen.tokenizer, cache_dtype="float16")


def test_sharded_generation_equals_one_device(gen, stacked):
    """Params sharded over a (data 2, fsdp 1, tensor 2) mesh of 4 CPU devices: the same greedy tokens."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    params = jax.device_put(stacked, model.param_shardings(CFG, mesh))
    assert len(params["layers"]["w_q_dnh"].sharding.device_set) == 4
    sharded = Generator(params, CFG, gen.tokenizer, max_batch=8, chunk_steps=5, mesh=mesh)
    want = gen.generate(PROMPTS, GREEDY)
    got = sharded.generate(PROMPTS, GREEDY)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    np.testing.assert_allclose([o.logprobs for o in got], [o.logprobs for o in want], atol=1e-4)


def test_score_refuses_ids_outside_the_vocabulary(gen):
    """An out-of-vocabulary id used to index past the embedding and return NaN."""
    with pytest.raises(SamplingError, match=r"pair 0 has token ids outside \[0, 300\): \[300\]"):
        gen.score([[1, 2]], [[300]])
    with pytest.raises(SamplingError, match=r"pair 0 has token ids outside"):
        gen.score([[-1, 2]], [[3]])


def test_a_loaded_models_second_batch_compiles_nothing(tiny_run):
    """Params placed on a mesh (`load_model`): the grammar table the loop hands back carries the mesh's sharding,
    and the next batch's fresh table is placed alike, so the second batch (plain and speculative) traces nothing."""
    from jaxgen.inference.loading import load_model

    cfg, tok, params = load_model(tiny_run)
    gen = Generator(params, cfg, tok, max_batch=2, chunk_steps=8, spec_gate=False)
    settings = [
        SamplingConfig(max_new_tokens=8, temperature=0.0),
        SamplingConfig(max_new_tokens=8, num_speculative_tokens=2),
    ]
    for s in settings:
        gen.generate(["hello"], s)
    before = gen.compilations
    for s in settings:
        gen.generate(["world"], s)
    assert gen.compilations == before
