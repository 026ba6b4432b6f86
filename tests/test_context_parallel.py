"""Context parallelism (jaxgen.model.context) on 8 CPU devices against one device: ring and all-gather
attention equal dense attention in values and gradients (causal, packed documents with padding, a
sliding window, GQA and MQA), and a whole train step with mesh.context=4 equals one device's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.model import attention, context
from jaxgen.model.kvcache import KVCache
from jaxgen.model.paged import PagedCache
from jaxgen.sharding import make_mesh
from jaxgen.training import step
from tests.test_train import random_batch

B, T, N, H = 2, 64, 4, 8
NO_WINDOW = np.iinfo(np.int32).max


def _inputs(kv_heads):
    """q, k, v and a batch of two rows: row 0 one causal sequence; row 1 three packed documents and four
    padding tokens at the end (position -1)."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(x, (B, T, kv_heads, H)) for x in ks[1:])
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    seg = np.zeros((B, T), np.int32)
    for start, doc in ((21, 1), (40, 2)):  # document boundaries inside a device's chunk and zig-zag half
        seg[1, start:] = doc
        pos[1, start:] = np.arange(T - start)
    pos[1, T - 4 :] = -1
    return q, k, v, jnp.asarray(pos), jnp.asarray(seg)


def _objective(out, pos):
    """A scalar whose gradient reaches every output (padding rows left out: dense gives them the mean)."""
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(jnp.where((pos >= 0)[:, :, None, None], out, 0.0) * weights)


def _attend(impl, cfg):
    """jitted (q, k, v, pos, seg, window) -> (output with padding rows zeroed, d/dq, d/dk, d/dv)."""

    def run(q, k, v, pos, seg, window):
        if impl == "dense":
            fn = lambda q, k, v: attention.dense_attention(
                q, k, v, attention.attention_mask(pos, pos, seg, seg, window), cfg
            )
        else:
            fn = lambda q, k, v: attention.sequence_attention(q, k, v, pos, seg, window, cfg, impl)
        out, grads = jax.value_and_grad(lambda *x: (_objective(fn(*x), pos), fn(*x)), (0, 1, 2), has_aux=True)(q, k, v)
        return (jnp.where((pos >= 0)[:, :, None, None], out[1], 0.0), *grads)

    return jax.jit(run)


CONTEXT4 = MeshConfig(data=1, context=4)  # a context-only mesh (4 of the 8 devices)
MIXED = MeshConfig(data=1, fsdp=2, context=2, tensor=2)  # rows over fsdp, heads over tensor where K divides


@pytest.mark.parametrize(
    "impl, mesh_cfg, kv_heads",
    [
        ("ring", CONTEXT4, 2),  # GQA
        ("allgather", CONTEXT4, 2),
        ("ring", MIXED, 2),  # heads split over tensor
        ("ring", MIXED, 1),  # MQA: one kv head, so every device computes all heads of its tokens
        ("allgather", MIXED, 1),
    ],
    ids=["ring-context4-gqa", "allgather-context4-gqa", "ring-mixed-gqa", "ring-mixed-mqa", "allgather-mixed-mqa"],
)
def test_context_parallel_attention_equals_dense(impl, mesh_cfg, kv_heads):
    cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=N, num_kv_heads=kv_heads, d_ff=64)
    cfg = dataclasses.replace(cfg, attention_block=8)
    q, k, v, pos, seg = _inputs(kv_heads)
    dense = _attend("dense", cfg)
    sharded = _attend(impl, cfg)
    mesh = make_mesh(mesh_cfg)
    for window in (NO_WINDOW, 6):  # one compiled program each: the window is traced, as in the layer scan
        want = dense(q, k, v, pos, seg, window)
        with jax.set_mesh(mesh):
            got = sharded(q, k, v, pos, seg, window)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"{name}, window={window}")


def test_zigzag_balances_causal_work():
    assert context.causal_work(64, 4, 8, zigzag=True) == [9, 9, 9, 9]  # every device the same pairs
    assert context.causal_work(64, 4, 8, zigzag=False) == [3, 7, 11, 15]  # contiguous: the last does 5x the first
    order = context.zigzag_order(16, 2)  # 4 chunks of 4: device 0 chunks 0 and 3, device 1 chunks 1 and 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    # the ppermutes inside the call move each device's tokens to that order and back
    mesh = make_mesh(MeshConfig(data=1, context=4))
    there_and_back = lambda x: (context.to_zigzag(4, x), context.from_zigzag(4, context.to_zigzag(4, x)))
    spec = jax.sharding.PartitionSpec(None, "context")
    moved = jax.shard_map(there_and_back, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=False)
    tokens = np.arange(32, dtype=np.int32)[None]
    zigzag, back = jax.jit(moved)(tokens)
    np.testing.assert_array_equal(zigzag[0], context.zigzag_order(32, 4))
    np.testing.assert_array_equal(back, tokens)


def test_bad_length_is_refused_before_compiling():
    cfg = dataclasses.replace(
        ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, d_ff=64), attention_block=8
    )
    x = jax.ShapeDtypeStruct((1, 36, 4, 8), jnp.float32)
    tok = jax.ShapeDtypeStruct((1, 36), jnp.int32)
    run = lambda q, k, v, p: attention.sequence_attention(q, k, v, p, None, None, cfg, "ring")
    rule = r"T=36 must be a multiple of 2 x mesh.context x block = 2 x 4 x 4 = 32"
    with jax.set_mesh(make_mesh(MeshConfig(data=1, context=4))), pytest.raises(ValueError, match=rule):
        jax.eval_shape(run, x, x, x, tok)


def test_choose_takes_ring_only_on_a_context_mesh():
    from jaxgen.model import kernels

    cfg = ModelConfig()
    assert kernels.choose(dataclasses.replace(cfg, attention_impl="ring"), "cpu") == "blockwise"  # no mesh
    with jax.set_mesh(make_mesh(CONTEXT4)):
        assert kernels.choose(cfg, "tpu") == "ring"  # auto on a context mesh
        assert kernels.choose(dataclasses.replace(cfg, attention_impl="allgather"), "cpu") == "allgather"
    with jax.set_mesh(make_mesh(MeshConfig(data=4))):
        assert kernels.choose(dataclasses.replace(cfg, attention_impl="allgather"), "cpu") == "blockwise"


def test_mesh_context_axis():
    assert MeshConfig(context=4).shape(8) == (2, 1, 4, 1)
    assert MeshConfig(context=4).axes() == ("data", "fsdp", "context", "tensor")
    assert make_mesh(MeshConfig()).axis_names == ("data", "fsdp", "tensor")  # context 1: the mesh as before
    with pytest.raises(ValueError, match=r"mesh\.context"):
        MeshConfig(context=0)


def _packed_batch(cfg):
    """random_batch with each row cut into two documents (positions restart, segment ids change)."""
    batch = random_batch(cfg, seed=3)
    t = cfg.data.seq_len
    batch["segment_ids"][:, 27:] = 2
    batch["positions"][:, 27:] = np.arange(t - 27)
    return batch


def _grads(cfg, mesh, params, batch):
    fn = jax.jit(lambda p, b: step._accumulate_grads(p, b, cfg)[:3])
    with jax.set_mesh(mesh):
        return fn(jax.device_put(params, model.param_shardings(cfg.model, mesh)), step.put_batch(batch, mesh))


@pytest.fixture(scope="module")
def one_device(tiny_cfg):
    """(params, packed batch, the loss total, token count and gradients on one device)."""
    one = make_mesh(tiny_cfg.mesh, jax.devices()[:1])
    # on the host: each mesh's train step donates the device copy it is given, never these
    params = jax.tree.map(np.asarray, jax.jit(lambda: model.init_params(tiny_cfg.model, jax.random.key(0)))())
    batch = _packed_batch(tiny_cfg)
    return params, batch, *_grads(tiny_cfg, one, params, batch)


@pytest.mark.parametrize(
    "mesh_cfg", [MeshConfig(data=2, context=4), MeshConfig(data=1, fsdp=2, context=2, tensor=2)],
    ids=["data2-context4", "fsdp2-context2-tensor2"],
)  # fmt: skip
def test_train_step_with_context_equals_one_device(tiny_cfg, one_device, mesh_cfg):
    ring = dataclasses.replace(
        tiny_cfg, mesh=mesh_cfg, model=dataclasses.replace(tiny_cfg.model, attention_impl="ring", attention_block=8)
    )
    eight = make_mesh(ring.mesh)
    params, batch, total1, count1, grads1 = one_device
    total8, count8, grads8 = _grads(ring, eight, params, batch)
    assert float(count8) == float(count1)
    np.testing.assert_allclose(total8, total1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads8), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-6)
    # the jitted, donating train step itself on the context mesh: its loss and gradient norm
    params8 = jax.device_put(params, model.param_shardings(ring.model, eight))
    sharded_state = step.create_train_state(ring, eight, params=params8)
    _, metrics = step.make_train_step(ring, eight, sharded_state)(sharded_state, step.put_batch(batch, eight))
    np.testing.assert_allclose(float(metrics["loss"]), float(total1 / count1), rtol=1e-5)
    norm1 = np.sqrt(sum(np.sum(np.square(np.asarray(g) / float(count1))) for g in jax.tree.leaves(grads1)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm1, rtol=1e-5)


def _ring_temp_bytes(c: int) -> int:
    """Per-device temporaries of ring attention's forward and backward at T=4096 on `c` devices (XLA:CPU's
    buffer assignment of the compiled program; nothing is allocated)."""
    cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    cfg = dataclasses.replace(cfg, attention_impl="ring", attention_block=64)
    mesh = make_mesh(MeshConfig(data=1, context=c), jax.devices()[:c])
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
    x = jax.ShapeDtypeStruct((1, 4096, 2, 16), jnp.float32, sharding=tokens)
    pos = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=tokens)
    loss = lambda q, k, v, p: jnp.sum(attention.sequence_attention(q, k, v, p, None, None, cfg, "ring") ** 2)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)), out_shardings=(tokens,) * 3)
    with jax.set_mesh(mesh):
        return grads.lower(x, x, x, pos).compile().memory_analysis().temp_size_in_bytes


def test_ring_memory_per_device_falls_with_the_context_axis():
    """Twice the devices, about half the temporaries: no device holds a whole-sequence array."""
    four, eight = _ring_temp_bytes(4), _ring_temp_bytes(8)
    whole = 4096 * 2 * 16 * 4  # one (B, T, N, H) float32 array of the whole sequence
    assert eight < 0.6 * four
    assert eight < 2 * whole  # measured: 1.8x (q, k, v chunks, their gradients, the ring's in-flight chunks)


# a whole prompt's prefill (`forward(..., fresh=True)`) on a context mesh, then decode on that mesh
PROMPT_CFG = dataclasses.replace(
    ModelConfig(vocab_size=128, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64),
    attention_block=8, sliding_window=24,
)  # fmt: skip
PROMPT_T, PROMPT_LENGTHS = 64, np.array([64, 53])  # row 1 ragged: 11 padding tokens (position -1)


def _prompt():
    tokens = np.random.default_rng(0).integers(0, 128, (2, PROMPT_T)).astype(np.int32)
    positions = np.tile(np.arange(PROMPT_T, dtype=np.int32), (2, 1))
    positions[1, PROMPT_LENGTHS[1] :] = -1
    return tokens, positions


def _empty_cache(kind: str, cfg):
    """A contiguous cache of 128 slots (contiguous: two blocks, its CPU layout; flat: one block, its
    accelerator layout: `kernels.cache_layout`), or a pool of 8-token pages with 16 pages per row, handed
    out interleaved and in reverse (a row's pages are neither adjacent nor in order)."""
    if kind in ("contiguous", "flat"):
        layout = "blocks" if kind == "contiguous" else "flat"
        return KVCache.init(dataclasses.replace(cfg, cache_layout=layout), 2, 128)
    pool = PagedCache.init(cfg, num_pages=33, page_size=8, slots=2, max_pages=16)
    table = np.arange(1, 33, dtype=np.int32).reshape(16, 2).T[:, ::-1]
    return pool.replace(page_table=jnp.asarray(table.copy()), capacity=jnp.full((2,), 128, jnp.int32))


def _prefill(kind: str, cfg, fresh: bool):
    """jitted params -> (the next-token logits (B, V) after each row's prompt, the filled cache)."""
    tokens, positions = _prompt()

    def run(params):
        cache = _empty_cache(kind, cfg).constrain()
        x, cache = model.hidden_states(params, tokens, positions, cache, cfg=cfg, fresh=fresh)
        last = model.lm_head(params, x[jnp.arange(2), PROMPT_LENGTHS - 1][:, None], cfg)[:, 0]
        return last, cache.constrain()

    return jax.jit(run)


@jax.jit
def _greedy_step(params, logits, positions, cache):
    """One greedy decode step: the token of `logits` (B, V) fed at `positions` (B,)."""
    token = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    step_logits, cache = model.forward(params, token, positions[:, None], cache, cfg=PROMPT_CFG)
    return token[:, 0], step_logits[:, 0], cache


def _prefill_and_decode(kind: str, cfg, fresh: bool, params, steps: int = 4):
    logits, cache = _prefill(kind, cfg, fresh)(params)
    prefilled, positions, tokens = cache, jnp.asarray(PROMPT_LENGTHS), []
    for _ in range(steps):
        token, logits, cache = _greedy_step(params, logits, positions, cache)
        tokens.append(token)
        positions = positions + 1
    return prefilled, np.stack(tokens, 1), logits, cache


@pytest.mark.parametrize("kind, impl", [("contiguous", "ring"), ("flat", "ring"), ("paged", "allgather")])
def test_context_parallel_prefill_writes_the_cache_of_one_device_and_decode_continues(kind, impl):
    """A ragged two-row prompt with a sliding window: prefilled with `fresh=True` on a context=4 mesh (its
    attention ring or allgather over the split prompt) it leaves the same cache as one device's cached
    forward (attention over the cache's blocks), and four greedy decode steps on that mesh give the same
    tokens, logits and cache. Both caches come out split over `context` (each block's slots, each page's
    offsets), and decode reads them by a partial softmax per device, combined once per layer."""
    params = model.init_params(PROMPT_CFG, jax.random.key(0))
    want = _prefill_and_decode(kind, PROMPT_CFG, False, params)
    mesh = make_mesh(CONTEXT4)
    cfg = dataclasses.replace(PROMPT_CFG, attention_impl=impl)
    with jax.set_mesh(mesh):
        got = _prefill_and_decode(kind, cfg, True, jax.device_put(params, model.param_shardings(cfg, mesh)))
    (cache1, tokens1, logits1, end1), (cache4, tokens4, logits4, end4) = want, got
    for cache in (cache4, end4):  # split over context: keys (B, K, H, S / N) along slots, (K, L, Q, Z, H) offsets
        sharding = jax.tree.leaves(cache.k)[0].sharding
        assert (*sharding.spec, None, None, None, None)[3] == "context", sharding
    np.testing.assert_array_equal(tokens4, tokens1)
    np.testing.assert_allclose(logits4, logits1, atol=1e-5, rtol=1e-5)
    for what, a, b in (("prefilled", cache4, cache1), ("decoded", end4, end1)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=f"{kind} cache, {what}")


def _prefill_temp_bytes(fresh: bool) -> tuple[int, int]:
    """Per-device temporaries and outputs of a one-row prefill of T=4096 tokens into the contiguous cache
    on a context=8 mesh (XLA:CPU's buffer assignment of the compiled program; nothing is allocated)."""
    cfg = ModelConfig(vocab_size=32, d_model=128, num_layers=1, num_heads=8, num_kv_heads=1, d_ff=64)
    cfg = dataclasses.replace(cfg, attention_impl="ring", attention_block=64)
    mesh = make_mesh(MeshConfig(data=1, context=8))
    shardings = model.param_shardings(cfg, mesh)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
    tok = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=tokens)

    def run(params, tokens, positions):
        cache = KVCache.init(cfg, 1, 4096).constrain()
        x, cache = model.hidden_states(params, tokens, positions, cache, cfg=cfg, fresh=fresh)
        return x[:, -1], cache.constrain()

    with jax.set_mesh(mesh):
        memory = jax.jit(run).lower(params, tok, tok).compile().memory_analysis()
    return memory.temp_size_in_bytes, memory.output_size_in_bytes


def test_context_parallel_prefill_holds_no_whole_sequence_attention_array():
    """With `fresh=True` no device holds an array of the whole prompt's queries, let alone scores: its
    temporaries stay under one (B, T, N, H) query array plus two copies of the cache (the keys and values
    gathered into the cache's layout, and their transposes). The cached forward on the same mesh (GSPMD
    gathers the whole prompt's queries for each block of the cache) holds more. (The weights, split over
    context too, are gathered for compute: their whole bytes are allowed.)"""
    whole_queries = 4096 * 8 * 16 * 4  # (B, T, N, H) float32
    fresh, cache_bytes = _prefill_temp_bytes(fresh=True)
    plain, _ = _prefill_temp_bytes(fresh=False)
    # + the weights, split over fsdp x context (sharding.RULES["embed"]) and gathered for compute
    weights = 4 * model.count_params(ModelConfig(vocab_size=32, d_model=128, num_layers=1, num_heads=8,
                                                 num_kv_heads=1, d_ff=64))  # fmt: skip
    bound = whole_queries + 2 * cache_bytes + weights
    assert fresh < bound, (fresh, bound)  # measured (weights over context): 2.31 MiB against 2.42 MiB
    assert plain > bound, (plain, bound)  # measured: 4.25 MiB (before the weights' split: 8.1 MiB at context=4)


def test_bad_prefill_is_refused_before_compiling():
    tokens = jax.ShapeDtypeStruct((2, 72), jnp.int32)
    cache = jax.eval_shape(lambda: KVCache.init(PROMPT_CFG, 2, 128))
    params = jax.eval_shape(lambda: model.init_params(PROMPT_CFG, jax.random.key(0)))
    prefill = lambda p, t, c, **kw: model.forward(p, t, t, c, cfg=PROMPT_CFG, fresh=True, **kw)
    rule = r"prompt length \(padded\) T=72 must be a multiple of 2 x mesh.context x block = 2 x 4 x 8 = 64"
    with jax.set_mesh(make_mesh(CONTEXT4)), pytest.raises(ValueError, match=rule):
        jax.eval_shape(prefill, params, tokens, cache)
    with pytest.raises(ValueError, match="needs the cache it fills"):
        jax.eval_shape(prefill, params, tokens, None)
    with pytest.raises(ValueError, match="segment_ids"):
        jax.eval_shape(functools.partial(prefill, segment_ids=tokens), params, tokens, cache)


def test_the_generator_on_a_context_mesh_prefills_context_parallel_and_equals_one_device():
    """jaxgen's Generator on a context=4 mesh (its prefill a fresh one: ring attention, the cache split over
    `context`) writes the same tokens as on one device, for ragged prompts, greedy."""
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    cfg = ModelConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)
    params = model.init_params(cfg, jax.random.key(1))
    prompts, greedy = ["a longer prompt than the other", "short"], SamplingConfig(temperature=0, max_new_tokens=6)
    one = Generator(params, cfg, Tokenizer.byte_level(), max_batch=2).generate(prompts, greedy)
    mesh = make_mesh(CONTEXT4)
    spread = jax.device_put(params, model.param_shardings(cfg, mesh))
    got = Generator(spread, cfg, Tokenizer.byte_level(), max_batch=2, mesh=mesh).generate(prompts, greedy)
    assert [c.tokens for c in got] == [c.tokens for c in one]
    np.testing.assert_allclose([c.logprobs for c in got], [c.logprobs for c in one], atol=1e-4)
