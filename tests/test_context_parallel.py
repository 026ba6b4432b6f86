"""Context parallelism (jaxgen.model.context) on 8 CPU devices against one device: ring and all-gather
attention equal dense attention in values and gradients (causal, packed documents with padding, a
sliding window, GQA and MQA), and a whole train step with mesh.context=4 equals one device's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.model import attention, context
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


def test_train_step_with_context_four_equals_one_device(tiny_cfg):
    ring = dataclasses.replace(
        tiny_cfg,
        mesh=MeshConfig(data=2, context=4),
        model=dataclasses.replace(tiny_cfg.model, attention_impl="ring", attention_block=8),
    )
    one, eight = make_mesh(tiny_cfg.mesh, jax.devices()[:1]), make_mesh(ring.mesh)
    params = jax.jit(lambda: model.init_params(tiny_cfg.model, jax.random.key(0)))()
    batch = _packed_batch(tiny_cfg)
    (total1, count1, grads1), (total8, count8, grads8) = (
        _grads(tiny_cfg, one, params, batch),
        _grads(ring, eight, params, batch),
    )
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


def test_prefill_and_decode_on_a_context_mesh_equal_one_device():
    """A cached forward on a context=4 mesh (the prompt's activations split over `context`; cached
    attention is not context-parallel: GSPMD gathers what the cache writes need) writes the same cache as
    one device, and the next greedy decode step gives the same logits."""
    from jaxgen.model.kvcache import KVCache

    cfg = ModelConfig(vocab_size=128, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32)
    positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))

    def prefill_then_decode(params):
        logits, cache = model.forward(params, tokens, positions, KVCache.init(cfg, 2, 32), cfg=cfg)
        greedy = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
        step_logits, cache = model.forward(params, greedy, positions[:, -1:] + 1, cache, cfg=cfg)
        return logits, step_logits, cache

    want = jax.jit(prefill_then_decode)(params)
    mesh = make_mesh(CONTEXT4)
    with jax.set_mesh(mesh):
        got = jax.jit(prefill_then_decode)(jax.device_put(params, model.param_shardings(cfg, mesh)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
