import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.model import attention, kernels
from jaxgen.model.kvcache import KVCache, cache_memory_bytes

LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}
STYLES = {
    "llama": dict(position="rope", norm="rmsnorm", mlp="swiglu"),
    "gpt2": dict(position="learned", norm="layernorm", mlp="gelu", use_bias=True, tie_embeddings=True),
}


def small(style="llama", kv=2, **kw):
    return ModelConfig(
        vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=kv, d_ff=64, max_seq_len=64,
        **(STYLES[style] | kw),
    )  # fmt: skip


def random_params(cfg, seed=0):
    # Non-zero biases and norm scales, so that every parameter matters in the comparisons.
    params = model.init_params(cfg, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def test_causal_mask_matches_hand_written():
    pos = jnp.array([[0, 1, 2, 3]])
    mask = attention.attention_mask(pos, pos)
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(mask[0], expected)


def test_padding_and_packed_document_masks_match_hand_written():
    # Row 0: two packed documents (3 + 2 tokens). Row 1: 3 tokens then 2 of padding (position -1).
    pos = jnp.array([[0, 1, 2, 0, 1], [0, 1, 2, -1, -1]])
    seg = jnp.array([[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]])
    mask = attention.attention_mask(pos, pos, seg, seg)
    packed = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], bool)
    padded = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(mask[0], packed)
    np.testing.assert_array_equal(mask[1], padded)


def test_sliding_window_mask_matches_hand_written():
    pos = jnp.arange(5)[None]
    mask = attention.attention_mask(pos, pos, window=2)
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(mask[0], expected)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_then_decode_equals_full_forward(style, layout):
    """Prefill 8 tokens, decode 16 one at a time: the logits of one full pass, within 1e-5."""
    cfg = small(style, LAYOUTS[layout])
    params = random_params(cfg)
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    full, _ = model.forward(params, tokens, positions, cfg=cfg)
    logits, cache = prefill_then_decode(params, cfg, tokens, positions, KVCache.init(cfg, batch_size=2, max_len=32), 8)
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=1e-5)
    assert int(cache.end) == 24


@pytest.mark.parametrize("cache_layout", ["blocks", "flat"])
def test_cache_layouts_decode_ragged_windowed_rows_as_the_full_forward(cache_layout):
    """Either layout of the contiguous cache (`kernels.cache_layout`), with a sliding window on every
    other layer and a ragged batch (row 1 ends at 15 tokens: padding, position -1, from there): a
    prefill of 6 tokens, a call of 5, then one token at a time up to the cache's last slot give the full
    forward's logits at every real position."""
    cfg = small(sliding_window=4, global_every=2, cache_layout=cache_layout)
    params = random_params(cfg)
    tokens = jax.random.randint(jax.random.key(8), (2, 32), 0, cfg.vocab_size)
    positions = jnp.stack([jnp.arange(32), jnp.where(jnp.arange(32) < 15, jnp.arange(32), -1)])
    full, _ = model.forward(params, tokens, positions, cfg=cfg)
    cache = KVCache.init(cfg, batch_size=2, max_len=32)
    assert cache.num_blocks == (1 if cache_layout == "flat" else 2)
    first, cache = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c, cfg=cfg))(
        params, tokens[:, :6], positions[:, :6], cache
    )
    rest, cache = prefill_then_decode(params, cfg, tokens[:, 6:], positions[:, 6:], cache, 5)
    logits = jnp.concatenate([first, rest], axis=1)
    assert int(cache.end) == 32
    np.testing.assert_allclose(logits[0], full[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[1, :15], full[1, :15], atol=1e-5, rtol=1e-5)


def prefill_then_decode(params, cfg, tokens_bt, positions_bt, cache, prefill: int):
    """Logits (B, T, V) of `prefill` tokens in one cached call, then the rest one at a time; and the cache."""
    step = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c, cfg=cfg))
    logits, cache = step(params, tokens_bt[:, :prefill], positions_bt[:, :prefill], cache)
    out = [logits]
    for t in range(prefill, tokens_bt.shape[1]):
        logits, cache = step(params, tokens_bt[:, t : t + 1], positions_bt[:, t : t + 1], cache)
        out.append(logits)
    return jnp.concatenate(out, axis=1), cache


def test_long_cache_blocks_read_in_parts_equal_the_full_forward():
    """A 2048-slot cache has 16 blocks of 128 slots, which cached attention folds in parts of 64, only
    those holding written slots (`kernels.cpu.fold_parts`): a prefill of 150 tokens (parts 0-2) and
    decode steps across the part boundaries at 192 and 256 give the full forward's logits."""
    cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=2048)
    params = model.init_params(cfg, jax.random.key(0))
    cache = KVCache.init(cfg, 2, 2048)
    assert cache.block_size == 2 * kernels.cpu.PART
    tokens = jax.random.randint(jax.random.key(1), (2, 260), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(260), (2, 260))
    full, _ = jax.jit(lambda p, t, q: model.forward(p, t, q, cfg=cfg))(params, tokens, positions)
    logits, _ = prefill_then_decode(params, cfg, tokens, positions, cache, 150)
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", STYLES)
def test_padded_sequence_equals_unpadded(style):
    """A short sequence padded (position -1) inside a batch computes what it computes alone."""
    cfg = small(style)
    params = random_params(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)
    alone, _ = model.forward(params, tokens[1:, :6], jnp.arange(6)[None], cfg=cfg)
    positions = jnp.stack([jnp.arange(10), jnp.where(jnp.arange(10) < 6, jnp.arange(10), -1)])
    batched, _ = model.forward(params, tokens, positions, cfg=cfg)
    np.testing.assert_allclose(batched[1, :6], alone[0], atol=1e-5, rtol=1e-5)


def test_packed_documents_do_not_see_each_other():
    cfg = small()
    params = random_params(cfg)
    a = jax.random.randint(jax.random.key(4), (1, 5), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(5), (1, 7), 0, cfg.vocab_size)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    segments = jnp.array([[1] * 5 + [2] * 7])
    logits, _ = model.forward(params, packed, positions, cfg=cfg, segment_ids=segments)
    alone_b, _ = model.forward(params, b, jnp.arange(7)[None], cfg=cfg)
    np.testing.assert_allclose(logits[:, 5:], alone_b, atol=1e-5, rtol=1e-5)


def test_bfloat16_compute_stays_close_to_float32():
    cfg = small()
    params = random_params(cfg)
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    f32, _ = model.forward(params, tokens, pos, cfg=cfg)
    bf16, _ = model.forward(params, tokens, pos, cfg=small(dtype="bfloat16"))
    assert bf16.dtype == jnp.float32
    assert float(jnp.abs(bf16 - f32).max()) < 0.1 * float(jnp.abs(f32).max())
    assert not np.allclose(bf16, f32, atol=1e-6)  # it really computed in bfloat16


def test_cache_memory_report():
    cfg = small(kv=2)
    cache = KVCache.init(cfg, batch_size=3, max_len=40)
    expected = 2 * cfg.num_layers * 3 * 40 * 2 * cfg.head_size * 4 + 3 * 40 * 4 + 4
    assert cache.memory_bytes() == expected == cache_memory_bytes(cfg, 3, 40)
