"""The building blocks of the transformer: norms, rotary positions, masks, attention, MLP.

Shapes use the glossary in `jaxgen.sharding` (B, T, S, D, N, K, G, H, F).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.model.kvcache import from_storage

NEG_INF = jnp.finfo(jnp.float32).min  # finite, so a fully masked row (padding) gives no NaN


def dense(x, w, in_axes: int = 1):
    """x (..., *w.shape[:in_axes]) times w -> (..., *w.shape[in_axes:]), as one 2-D matrix product.

    Flattening first matters on XLA:CPU: the backward pass of a multi-axis einsum such as
    "btd,dnh->btnh" inside the layer scan turned into slow transposing copies (a SwiGLU layer's
    gradient took 1.45x as long as with 2-D products).
    """
    n_in = math.prod(w.shape[:in_axes])
    lead = x.shape[: x.ndim - in_axes]
    y = x.reshape(-1, n_in) @ w.reshape(n_in, -1)
    return y.reshape(*lead, *w.shape[in_axes:])


def norm(x_btd, p: dict, cfg: ModelConfig):
    """LayerNorm (scale and bias) or RMSNorm (scale only), computed in float32."""
    x = x_btd.astype(jnp.float32)
    if cfg.norm == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)
    scale = p["scale_d"].astype(jnp.float32)
    x = x * (1.0 + scale if cfg.norm_unit_offset else scale)
    if "bias_d" in p:
        x = x + p["bias_d"].astype(jnp.float32)
    return x.astype(x_btd.dtype)


def rope_frequencies(cfg: ModelConfig):
    """Inverse frequencies (H/2,) float32 of the rotary embedding, with the config's context scaling.

    linear divides every frequency by rope_factor. llama3 (Llama 3.1) leaves high frequencies alone,
    divides low ones (wavelength beyond original_max_len / low_freq_factor) by the factor, and blends
    linearly in between.
    """
    h = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "llama3":
        low, high, old_len = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(medium, blended, scaled)
    return inv_freq


def rope(x_btnh, positions_bt, inv_freq):
    """Rotary position embedding, rotate-half convention (as in Llama); inv_freq from `rope_frequencies`."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # (B, T, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


def attention_mask(q_slot_t, k_slot_s, q_pos_bt, k_pos_bs, q_seg_bt=None, k_seg_bs=None, window=None):
    """Boolean (B, T, S): may query t attend to key s?

    Causal by slot order, keys with position -1 (padding, empty cache slots) never attended,
    no attention across packed documents (segment ids), and an optional sliding window.
    """
    mask = (k_slot_s[None, :] <= q_slot_t[:, None])[None]  # (1, T, S)
    mask = mask & (k_pos_bs >= 0)[:, None, :]
    if q_seg_bt is not None:
        mask = mask & (q_seg_bt[:, :, None] == k_seg_bs[:, None, :])
    if window is not None:
        mask = mask & (q_pos_bt[:, :, None] - k_pos_bs[:, None, :] < window)
    return mask


def attention(q_btnh, k_bskh, v_bskh, mask_bts, num_kv_heads: int):
    """Grouped-query attention: N query heads share K kv heads (G = N / K per group)."""
    b, t, n, h = q_btnh.shape
    q = q_btnh.reshape(b, t, num_kv_heads, n // num_kv_heads, h)  # (B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=jnp.float32)
    logits = logits * (h**-0.5)
    logits = jnp.where(mask_bts[:, None, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out.reshape(b, t, n, h)


def mlp(x_btd, p: dict, cfg: ModelConfig):
    """GELU MLP (GPT-2), SwiGLU (Llama) or GeGLU (Gemma; tanh-approximated GELU gate)."""
    up = dense(x_btd, p["w_up_df"])
    if "b_up_f" in p:
        up = up + p["b_up_f"]
    if cfg.mlp in ("swiglu", "geglu"):
        gate = dense(x_btd, p["w_gate_df"])
        if "b_gate_f" in p:
            gate = gate + p["b_gate_f"]
        act = jax.nn.silu(gate) if cfg.mlp == "swiglu" else jax.nn.gelu(gate, approximate=True)
        hidden = act * up
    else:
        hidden = jax.nn.gelu(up, approximate=True)
    out = dense(hidden, p["w_down_fd"])
    if "b_down_d" in p:
        out = out + p["b_down_d"]
    return out


def cached_attention(q_btnh, k_all, v_all, layer, pos_bs, q_pos_bt, end, num_kv_heads, window, block):
    """Attention of the tokens at slots [end, end + T) over the cache's slots in use (online softmax).

    q_btnh: (B, T, N, H). k_all, v_all: (L, S, B, K, H) the cache, this call's keys and values already
    written; only the first ceil((end + T) / block) blocks of `layer` are read, so a step costs what the
    filled part of the cache costs, not its allocated length. pos_bs: (B, S) positions held (-1 empty).
    Returns (B, T, N, H) and the cache arrays, threaded through the loop's carry: as a loop-invariant
    operand XLA would copy them whole every step.
    """
    b, t, n, h = q_btnh.shape
    k = num_kv_heads
    q = q_btnh.reshape(b, t, k, n // k, h).astype(jnp.float32) * (h**-0.5)
    q_slot = end + jnp.arange(t)
    num_slots = k_all.shape[1]

    def cache_block(j, carry):
        stats, (k_all, v_all) = carry
        start = j * block
        # One index into (L * S, B, K, H): a block of this layer's slots, nothing hoisted out.
        row = (layer * num_slots + start, 0, 0, 0)
        kb = jax.lax.dynamic_slice(k_all.reshape(-1, b, k, h), row, (block, b, k, h)).swapaxes(0, 1)
        vb = jax.lax.dynamic_slice(v_all.reshape(-1, b, k, h), row, (block, b, k, h)).swapaxes(0, 1)
        pos = jax.lax.dynamic_slice(pos_bs, (0, start), (b, block))
        mask = attention_mask(q_slot, start + jnp.arange(block), q_pos_bt, pos, window=window)
        return _online_softmax_step(stats, q, kb, vb, mask), (k_all, v_all)

    init = (
        jnp.full((b, k, n // k, t), NEG_INF, jnp.float32),
        jnp.zeros((b, k, n // k, t), jnp.float32),
        jnp.zeros((b, k, n // k, t, h), jnp.float32),
    )
    blocks = (end + t + block - 1) // block
    (_, l, acc), kv = jax.lax.fori_loop(0, blocks, cache_block, (init, (k_all, v_all)))
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no key at all (padding) give 0
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype), kv


def _online_softmax_step(carry, q_btkgh, k_bskh, v_bskh, mask_bts):
    """One block of keys folded into the running max m, normaliser l and weighted sum acc."""
    m, l, acc = carry  # (B, K, G, T), (B, K, G, T), (B, K, G, T, H)
    mask = mask_bts[:, None, None]
    s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, from_storage(k_bskh).astype(jnp.float32))
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, from_storage(v_bskh).astype(jnp.float32))
    return m_new, l * corr + p.sum(-1), acc
