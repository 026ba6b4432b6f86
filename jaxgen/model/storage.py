"""How a cache stores keys and values, shared by every cache type: bfloat16 as its uint16 bits on CPU,
int8 with one float32 scale per token and kv head.

Why uint16 on CPU: XLA:CPU computes bfloat16 arithmetic in float32 and then rewrites the whole bfloat16
buffer on every step instead of updating it in place; a uint16 buffer holding the same bits is updated
in place, and reading it back is a free bitcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def storage_dtype(dtype) -> jnp.dtype:
    """How a cache dtype is stored: bfloat16 as uint16 bits on CPU (see above); accelerators store
    bfloat16 as it is, and every other dtype is stored as it is."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.uint16)
    return dtype


def to_storage(x: jax.Array, stored: jnp.dtype) -> jax.Array:
    """`x` as a buffer of dtype `stored` holds it."""
    if stored == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(stored)


def from_storage(x: jax.Array) -> jax.Array:
    """A stored buffer as the float values it holds (uint16 bits back to bfloat16; others unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def scale_buffer(shape, dtype):
    """An int8 cache's float32 scales, one per token and kv head (`shape` a values buffer's, less its
    trailing H); None otherwise."""
    return jnp.zeros(shape[:-1], jnp.float32) if dtype == jnp.int8 else None


def quantize_kv(x):
    """Symmetric int8 of keys or values (..., H) with one float32 scale per token and head (...,): the
    absmax over H / 127. Per token, because a token's keys are written once and never rescaled."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def dequantize_kv(q, scale, axis: int = -1):
    """int8 keys or values times their scales, which lack q's H axis (`axis`: -1, or 2 for keys stored
    (B, K, H, S))."""
    return q.astype(jnp.float32) * jnp.expand_dims(scale, axis)
