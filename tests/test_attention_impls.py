"""Every attention implementation equals the dense reference, forward and gradients; remat policies
change memory, not gradients."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ConfigError, ModelConfig
from jaxgen.model import attention, kernels
from jaxgen.model.blockwise import blockwise_attention

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
# mask kind -> (segments, padding, window, softcap)
MASKS = {
    "causal": (False, False, None, None),
    "padding": (False, True, None, None),
    "segments": (True, False, None, None),
    "window": (False, False, 7, None),
    "softcap": (False, False, None, 5.0),
    "all": (True, True, 9, 20.0),
}


def _inputs(t, kv_heads, mask_kind, dtype, seed=0):
    segs, pad, window, _ = MASKS[mask_kind]
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(2, t, 4, 16)), dtype)
    k = jnp.asarray(r.normal(size=(2, t, kv_heads, 16)), dtype)
    v = jnp.asarray(r.normal(size=(2, t, kv_heads, 16)), dtype)
    pos = np.tile(np.arange(t, dtype=np.int32), (2, 1))
    seg = None
    if segs:  # two packed documents per row, positions restarting at the second
        cut = t // 3
        seg = jnp.asarray(np.where(np.arange(t) < cut, 1, 2)[None].repeat(2, 0).astype(np.int32))
        pos[:, cut:] -= cut
    if pad:  # row 1 left-padded by 5
        pos[1, :5], pos[1, 5:] = -1, np.arange(t - 5)
    weights = jnp.asarray(r.normal(size=q.shape), jnp.float32)
    return q, k, v, jnp.asarray(pos), seg, window, weights


def _loss(fn, pos, weights):
    """A scalar of the output at real (non-padding) queries: a padded query's output is unspecified."""
    valid = (pos >= 0)[:, :, None, None]
    return lambda q, k, v: jnp.sum(jnp.where(valid, fn(q, k, v).astype(jnp.float32), 0.0) * weights)


def _dense(cfg, pos, seg, window):
    mask = attention.attention_mask(pos, pos, seg, seg, window)
    return lambda q, k, v: attention.dense_attention(q, k, v, mask, cfg)


def _compare(fn, cfg, q, k, v, pos, seg, window, weights, tol):
    ref, got = _loss(_dense(cfg, pos, seg, window), pos, weights), _loss(fn, pos, weights)
    value_and_grads = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v) for f in (ref, got))
    (ref_val, ref_grads), (val, grads) = value_and_grads
    np.testing.assert_allclose(val, ref_val, rtol=tol, atol=tol)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        assert err <= tol * scale, f"d{name}: max error {err} vs {tol} x {scale}"


# every mask kind with grouped queries, and every head layout with all masks at once
CASES = [("gqa", m) for m in MASKS if m != "all"] + [(h, "all") for h in HEADS]


@pytest.mark.parametrize(("heads", "mask_kind"), CASES)
def test_blockwise_equals_dense_float32(heads, mask_kind):
    q, k, v, pos, seg, window, w = _inputs(40, HEADS[heads], mask_kind, jnp.float32)
    cfg = ModelConfig(num_heads=4, num_kv_heads=HEADS[heads], d_model=64, attn_softcap=MASKS[mask_kind][3])
    # blocks of 16 x 8 over T = 40: a partial last query block, several key blocks skipped as unseen
    fn = lambda q, k, v: blockwise_attention(
        q, k, v, pos, pos, scale=attention.logit_scale(cfg), softcap=cfg.attn_softcap,
        q_seg_bt=seg, k_seg_bs=seg, window=window, block_q=16, block_k=8,
    )  # fmt: skip
    _compare(fn, cfg, q, k, v, pos, seg, window, w, tol=2e-5)


@pytest.mark.parametrize("mask_kind", ["causal", "all"])
def test_blockwise_equals_dense_bfloat16(mask_kind):
    # bfloat16 inputs: both paths accumulate in float32 but round probabilities (dense) or nothing
    # (blockwise) to bfloat16 before the value product; 8 bits of mantissa give ~0.4% per element,
    # so 3% of the largest gradient bounds the difference of sums over 40 keys.
    q, k, v, pos, seg, window, w = _inputs(40, 2, mask_kind, jnp.bfloat16)
    cfg = ModelConfig(num_heads=4, num_kv_heads=2, d_model=64, attn_softcap=MASKS[mask_kind][3], dtype="bfloat16")
    fn = lambda q, k, v: blockwise_attention(
        q, k, v, pos, pos, scale=attention.logit_scale(cfg), softcap=cfg.attn_softcap,
        q_seg_bt=seg, k_seg_bs=seg, window=window, block_q=16, block_k=8,
    )  # fmt: skip
    _compare(fn, cfg, q, k, v, pos, seg, window, w, tol=3e-2)


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_splash_kernel_in_interpret_mode_equals_dense(heads):
    # The Pallas TPU kernel run by the interpreter: a mixed local/global pattern picks one of two
    # static masks per layer (both branches checked), with segments, padding and a soft cap. Grouped
    # queries run under a data x tensor mesh: the kernel inside shard_map, rows and kv heads split.
    from contextlib import nullcontext

    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4]) if heads == "gqa" else None
    with jax.set_mesh(mesh) if mesh is not None else nullcontext():
        _splash_equals_dense(heads)


def _splash_equals_dense(heads):
    t = 256
    q, k, v, pos, seg, _, w = _inputs(t, HEADS[heads], "all", jnp.float32)
    cfg = ModelConfig(
        num_heads=4, num_kv_heads=HEADS[heads], d_model=64, max_seq_len=t, sliding_window=50, global_every=2,
        attn_softcap=20.0, attention_impl="splash", attention_block=128,
    )  # fmt: skip
    for window in (jnp.int32(50), jnp.int32(np.iinfo(np.int32).max)):
        fn = lambda q, k, v, window=window: kernels.splash_attention(
            q, k, v, pos, seg, window, cfg, scale=attention.logit_scale(cfg)
        )
        _compare(fn, cfg, q, k, v, pos, seg, window, w, tol=2e-5)


def test_choose_picks_per_backend_and_says_why_it_falls_back(caplog, monkeypatch):
    from jaxgen.model.kernels import cudnn

    monkeypatch.setattr(cudnn, "_cudnn_installed", lambda: True)  # as on a GPU machine (this one has no cuDNN)
    cfg = ModelConfig()
    assert kernels.choose(cfg, "cpu") == "blockwise"
    assert kernels.choose(cfg, "tpu") == "splash"
    assert kernels.choose(dataclasses.replace(cfg, dtype="bfloat16"), "gpu") == "cudnn"
    assert kernels.choose(dataclasses.replace(cfg, attention_impl="dense"), "tpu") == "dense"
    with caplog.at_level(logging.WARNING):
        assert kernels.choose(cfg, "gpu") == "blockwise"  # float32: cuDNN's flash kernel needs bf16/fp16
        assert kernels.choose(dataclasses.replace(cfg, attention_impl="cudnn"), "cpu") == "blockwise"
    assert "needs model.dtype bfloat16, got float32" in caplog.text
    assert "needs an NVIDIA GPU, the backend is cpu" in caplog.text
    assert "head size" in kernels.cudnn_unfit(ModelConfig(d_model=1024, num_heads=4, dtype="bfloat16"), "gpu")
    assert "soft cap" in kernels.cudnn_unfit(ModelConfig(dtype="bfloat16", attn_softcap=50.0), "gpu")
    assert kernels.fit_length("splash", 256, dataclasses.replace(cfg, attention_block=128)) == "splash"
    assert kernels.fit_length("splash", 48, cfg) == "blockwise"  # a 48-token block is not a multiple of 128
    assert kernels.fit_length("cudnn", 47, cfg) == "blockwise"
    with pytest.raises(ConfigError, match=r"model\.attention_impl='flash' is not allowed"):
        ModelConfig(attention_impl="flash")
    with pytest.raises(ConfigError, match=r"model\.remat='some' is not allowed"):
        ModelConfig(remat="some")


def _model_grads(cfg, params, batch):
    def loss(p):
        logits, _ = model.forward(p, batch["tokens"], batch["positions"], cfg=cfg, segment_ids=batch["segments"])
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (batch["positions"] >= 0))

    return jax.jit(jax.value_and_grad(loss))(params)


def test_model_gradients_equal_across_attention_impls_and_remat_policies():
    cfg = ModelConfig(
        vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=48,
        sliding_window=6, global_every=2, attention_block=8,
    )  # fmt: skip
    params = model.init_params(cfg, jax.random.key(0))
    _, _, _, pos, seg, _, _ = _inputs(36, 2, "all", jnp.float32)
    batch = {"tokens": jax.random.randint(jax.random.key(1), pos.shape, 0, 61), "positions": pos, "segments": seg}
    ref_loss, ref_grads = _model_grads(dataclasses.replace(cfg, attention_impl="dense"), params, batch)
    variants = [("blockwise", "none"), ("blockwise", "full"), ("dense", "dots"), ("blockwise", "dots_no_batch")]
    for impl, remat in variants:
        loss, grads = _model_grads(dataclasses.replace(cfg, attention_impl=impl, remat=remat), params, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"{impl}, remat={remat}")


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_pallas_paged_decode_kernel_in_interpret_mode_equals_the_xla_loop(softcap):
    # A decode step over the engine's page pool: slots of different lengths, one sharing another's
    # first page (a cached prefix), one idle (position -1); grouped queries.
    from jaxgen.model.paged import PagedCache

    cfg = ModelConfig(num_heads=4, num_kv_heads=2, d_model=64, num_layers=2, attn_softcap=softcap)
    cache = PagedCache.init(cfg, num_pages=12, page_size=16, slots=4, max_pages=4)
    r = np.random.default_rng(1)
    kv = (*(jnp.asarray(r.normal(size=cache.k.shape), jnp.float32) for _ in range(2)), None, None)  # no scales
    table = jnp.asarray([[1, 2, 3, 0], [1, 4, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]], jnp.int32)
    cache = cache.replace(page_table=table, capacity=jnp.asarray([48, 32, 64, 0], jnp.int32))
    q = jnp.asarray(r.normal(size=(4, 1, 4, 16)), jnp.float32)
    pos = jnp.asarray([[40], [17], [63], [-1]], jnp.int32)
    for layer in (0, 1):
        want, _ = attention.cached_attention(
            q, cache, kv, layer, pos, None, dataclasses.replace(cfg, decode_impl="xla")
        )
        got, _ = attention.cached_attention(
            q, cache, kv, layer, pos, None, dataclasses.replace(cfg, decode_impl="pallas")
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert kernels.decode_kernel(dataclasses.replace(cfg, decode_impl="pallas"), cache, 1)
    assert not kernels.decode_kernel(cfg, cache, 1, backend="cpu")  # auto: the kernel on GPU only
    assert kernels.decode_kernel(cfg, cache, 1, backend="gpu")
    assert not kernels.decode_kernel(cfg, cache, 2, backend="gpu")  # prefill chunks take the XLA loop
    windowed = dataclasses.replace(cfg, sliding_window=16, decode_impl="pallas")
    assert not kernels.decode_kernel(windowed, cache, 1)
    assert "power-of-two head size" in kernels.paged_unfit(ModelConfig(d_model=96, num_heads=1), "gpu", 16)
    assert "page size >= 16" in kernels.paged_unfit(cfg, "gpu", 8)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_tpu_paged_decode_kernel_in_interpret_mode_equals_the_xla_loop(softcap):
    # The TPU kernel over a bfloat16 pool (it loads keys and values as bfloat16): slots of different lengths,
    # a shared first page, an idle slot; grouped queries. A float32 pool is refused with the reason.
    from jaxgen.model.kernels import paged_tpu
    from jaxgen.model.paged import PagedCache
    from jaxgen.targets.devices import traced_for

    cfg = ModelConfig(num_heads=4, num_kv_heads=2, d_model=64, num_layers=2, attn_softcap=softcap)
    cache = PagedCache.init(cfg, num_pages=12, page_size=16, slots=4, max_pages=4, dtype="bfloat16")
    r = np.random.default_rng(1)
    kv = (*(jnp.asarray(r.normal(size=cache.k.shape), jnp.bfloat16).view(cache.k.dtype) for _ in range(2)), None, None)
    table = jnp.asarray([[1, 2, 3, 0], [1, 4, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]], jnp.int32)
    cache = cache.replace(page_table=table, capacity=jnp.asarray([48, 32, 64, 0], jnp.int32))
    q = jnp.asarray(r.normal(size=(4, 1, 4, 16)), jnp.float32)
    pos = jnp.asarray([[40], [17], [63], [-1]], jnp.int32)
    for layer in (0, 1):
        xla = dataclasses.replace(cfg, decode_impl="xla")
        want, _ = attention.cached_attention(q, cache, kv, layer, pos, None, xla)
        got = paged_tpu.attention(q, cache.decode_inputs(kv, layer), pos, scale=attention.logit_scale(cfg),
                                  softcap=softcap)  # fmt: skip
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    # on a TPU (auto) the paged cache's kernel is this one, over bfloat16 pages and heads Mosaic lowers
    wide = ModelConfig(num_heads=1, num_kv_heads=1, d_model=128, num_layers=2)
    assert not kernels.decode_kernel(cfg, cache, 1, backend="tpu")  # heads of 16
    for dtype, runs in (("bfloat16", "paged_tpu"), ("float32", None)):
        with traced_for("tpu"):  # (bfloat16 pages as a TPU stores them)
            pages = PagedCache.init(wide, num_pages=12, page_size=16, slots=4, max_pages=4, dtype=dtype)
        assert kernels.decode_kernel(wide, pages, 1, backend="tpu") == runs
        assert kernels.decode_kernel(wide, pages, 1, backend="cpu") is None
    assert "must be bfloat16" in paged_tpu.unfit(wide, "tpu", 16, bfloat16=False)
    assert "multiple of 128, got 16" in paged_tpu.unfit(cfg, "tpu", 16, bfloat16=True)


def test_engine_decodes_the_same_tokens_with_the_pallas_paged_kernel(monkeypatch):
    from jaxgen.config import ServeConfig
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    cfg = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128)
    params = jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, model.init_params(cfg, jax.random.key(0)))
    serve = ServeConfig(slots=4, page_size=16, num_pages=32, chunk_steps=4, prefill_chunk=32)
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 20]
    sampling = [SamplingConfig(max_new_tokens=n, temperature=0.0) for n in (12, 7, 10)]
    outs = {
        impl: Engine(params, dataclasses.replace(cfg, decode_impl=impl), Tokenizer.byte_level(), serve).generate(
            prompts, sampling
        )
        for impl in ("xla", "pallas")
    }
    for a, b in zip(outs["xla"], outs["pallas"], strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    # the TPU kernel (in interpret mode) over a bfloat16 pool, on a data x tensor mesh (each device its slots
    # and kv heads, under shard_map): the paged cache's kernel, as on a TPU
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, tensor=2))
    params = jax.device_put(params, model.param_shardings(cfg, mesh))
    bf16 = dataclasses.replace(serve, cache_dtype="bfloat16")
    xla, pallas = (dataclasses.replace(cfg, decode_impl=impl) for impl in ("xla", "pallas"))
    want = Engine(params, xla, Tokenizer.byte_level(), bf16, mesh=mesh).generate(prompts, sampling)
    monkeypatch.setattr(kernels, "paged_kernel", lambda backend=None: "paged_tpu")
    engine = Engine(params, pallas, Tokenizer.byte_level(), bf16, mesh=mesh)
    assert kernels.decode_kernel(pallas, engine.runner.state.cache, 1) == "paged_tpu"
    got = engine.generate(prompts, sampling)
    for a, b in zip(want, got, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.parametrize("slots", [16, 80, 256])  # one chunk; 2 chunks of 40; 4 chunks of 64
def test_decode_products_as_sums_equal_the_matrix_products(slots, cpu_decode_sums, monkeypatch):
    # A decode step's two products written out as sums (what CPU decoding runs for grouped queries)
    # against the einsums over the same (H, slots) keys and (slots, H) values.
    r = np.random.default_rng(slots)
    b, k, g, h = 3, 2, 3, 16
    q = jnp.asarray(r.normal(size=(b, 1, k, g, h)), jnp.float32)
    keys = jnp.asarray(r.normal(size=(b, k, h, slots)), jnp.float32)
    values = jnp.asarray(r.normal(size=(b, k, slots, h)), jnp.float32)
    p = jax.nn.softmax(jnp.einsum("btkgh,bkhs->bkgts", q, keys), axis=-1)
    assert kernels.cpu.products_as_sums(q) == (jax.default_backend() == "cpu")  # CPU decoding's path
    np.testing.assert_allclose(
        kernels.cpu.scores_as_sums(q, keys), jnp.einsum("btkgh,bkhs->bkgts", q, keys), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        kernels.cpu.values_as_sums(p, values), jnp.einsum("bkgts,bksh->bkgth", p, values), rtol=1e-5, atol=1e-5
    )
    assert not kernels.cpu.products_as_sums(q[:, :, :, :1])  # one query per kv head: the matrix products
    monkeypatch.setenv("JAXGEN_CPU_DECODE_SUMS", "0")
    assert not kernels.cpu.products_as_sums(q)  # asked for the matrix products
    monkeypatch.setenv("JAXGEN_CPU_DECODE_SUMS", "no")
    with pytest.raises(ValueError, match=r"JAXGEN_CPU_DECODE_SUMS='no' is not allowed: 0 .* or 1"):
        kernels.cpu.products_as_sums(q)
