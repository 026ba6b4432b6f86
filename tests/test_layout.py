"""Decoding's output-major weights (jaxgen.model.layout) compute what the trained layout computes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.model import layout
from jaxgen.model.kvcache import KVCache


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny(request, tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.model, tie_embeddings=request.param == "tied")
    return cfg, model.init_params(cfg, jax.random.key(3))


def test_every_float_product_weight_is_out_major_from_8_rows(tiny):
    cfg, params = tiny
    decoded = model.decode_params(params, rows=layout.OUT_MAJOR_ROWS)
    weights = {k: v for k, v in decoded["layers"][0].items() if k.startswith("w_")}
    weights |= {k: v for k, v in decoded["layers"][0].get("mlp", {}).items() if k.startswith("w_")}
    assert weights and all(layout.is_out_major(w) for w in weights.values())
    if not cfg.tie_embeddings:
        assert decoded["head_dv"].w.shape == (cfg.vocab_size, cfg.d_model)  # (O, I)
    below = model.decode_params(params, rows=layout.OUT_MAJOR_ROWS - 1)
    assert not any(layout.is_out_major(w) for w in jax.tree.leaves(below, is_leaf=layout.is_out_major))


def test_logits_and_cache_equal_the_trained_layout(tiny):
    cfg, params = tiny
    decoded = model.decode_params(params, rows=8)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    whole, _ = model.forward(params, tokens, positions, cfg=cfg)
    np.testing.assert_allclose(model.forward(decoded, tokens, positions, cfg=cfg)[0], whole, atol=2e-5, rtol=2e-5)
    cache = KVCache.init(cfg, 2, 16)
    logits_a, cache_a = model.forward(params, tokens, positions, cache, cfg=cfg)
    logits_b, cache_b = model.forward(decoded, tokens, positions, cache, cfg=cfg)
    np.testing.assert_allclose(logits_b, logits_a, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(cache_b.k, cache_a.k, atol=2e-5, rtol=2e-5)


def test_train_layout_undoes_decode_layout_exactly(tiny):
    _, params = tiny
    back = layout.train_layout(model.decode_params(params, rows=32))
    expected = model.unstack_layers(params)
    assert jax.tree.structure(back) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
