"""The KV cache: an immutable pytree passed into `forward` and returned updated.

Layout (glossary in `jaxgen.sharding`):
    k, v: L x (B, K, S, H)  keys and values: one buffer per layer, by sequence, kv head and slot
    k_scale, v_scale: L x (B, K, S) float32, int8 caches only: one scale per token and kv head
    pos:  (B, S) int32     the token position held in each slot; -1 marks an empty slot
    end:  () int32         the next slot to write; all sequences of a batch write the same slot

Writing every sequence at the shared slot `end` keeps the update a `dynamic_update_slice` at one
scalar offset, which XLA performs in place when the cache is donated. Batch and kv heads lead and the
slots come just before the head dim, so a block of slots is already in the (batch dims, rows, contracted)
order of the two products of attention: XLA:CPU reads it as it is. With slots before the batch, as
before, every block was transposed twice per product (at batch 32, 12 layers of one 128-slot block of
gpt2-124m keys: 100.8 ms against 31.8 ms batch-first, the attention products alone). One buffer per
layer rather than one (L, ...) array: a gpt2-124m decode step at batch 32 (32-token prompts, 64 new
tokens, 128 slots) took 136.6 / 128.7 ms stacked and 128.2 / 111.5 ms per layer (process pairs; at
256 slots within noise). Layers index it statically: decoding runs them as a
Python loop. Cached attention reads only the blocks in use. Ragged prompts leave empty slots
(pos = -1) that attention masks out; each sequence's own positions (for RoPE / learned embeddings)
live in `pos`, so a padded sequence computes exactly what it would alone.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.sharding import constrain

BLOCK = 128  # cache slots per block of cached attention
KV_NAMES = ("batch", "kv_heads", "cache_seq", "head_dim")  # each layer's buffer
POS_NAMES = ("batch", "cache_seq")


@flax.struct.dataclass
class KVCache:
    k: tuple  # L x (B, K, S, H): one buffer per layer
    v: tuple  # L x (B, K, S, H)
    pos: jax.Array  # (B, S) int32, -1 = empty
    end: jax.Array  # () int32
    k_scale: tuple | None = None  # L x (B, K, S) float32 for an int8 cache (see `quantize_kv`), else None
    v_scale: tuple | None = None

    @classmethod
    def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty cache; `dtype` float32, bfloat16 (held as uint16 bits on CPU, see `storage_dtype`) or
        int8 (one float32 scale per token and kv head: `quantize_kv`)."""
        shape = (batch_size, cfg.kv_heads, max_len, cfg.head_size)
        dtype = storage_dtype(dtype)

        def per_layer(make):  # a buffer of its own for every layer: the loops donate them
            return tuple(make() for _ in range(cfg.num_layers))

        scales = dtype == jnp.int8
        return cls(
            k=per_layer(lambda: jnp.zeros(shape, dtype)),
            v=per_layer(lambda: jnp.zeros(shape, dtype)),
            pos=jnp.full((batch_size, max_len), -1, jnp.int32),
            end=jnp.zeros((), jnp.int32),
            k_scale=per_layer(lambda: scale_buffer(shape, dtype)) if scales else None,
            v_scale=per_layer(lambda: scale_buffer(shape, dtype)) if scales else None,
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def is_full(self, positions_b):
        """Per row: is there no slot left for the next token? (All rows write the same slot.)"""
        return jnp.broadcast_to(self.end >= self.max_len, positions_b.shape)

    def memory_bytes(self) -> int:
        """Bytes held by the cache's arrays (keys, values and slot positions)."""
        return _nbytes(self)

    # --- what attention needs (see jaxgen.model.attention) ------------------------------------------

    def with_positions(self, positions_bt) -> KVCache:
        """The cache as a call of T tokens sees it: their positions recorded at slots [end, end + T)."""
        return self.replace(pos=jax.lax.dynamic_update_slice(self.pos, positions_bt.astype(jnp.int32), (0, self.end)))

    def arrays(self) -> tuple:
        """What the layers thread and write: keys, values and (int8) their scales, None otherwise."""
        return self.k, self.v, self.k_scale, self.v_scale

    def write(self, kv, layer, k_btkh, v_btkh, positions_bt):
        """This call's keys and values of `layer` (a Python int) at slots [end, end + T): a
        dynamic_update_slice of that layer's buffers at scalar offsets, in place when donated."""
        i = _layer_index(layer)
        start = (0, 0, self.end, 0)
        k_new, v_new = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)  # (B, K, T, H)
        k_all, v_all, k_scale, v_scale = kv
        if k_scale is not None:
            (k_new, k_s), (v_new, v_s) = quantize_kv(k_new), quantize_kv(v_new)
            k_scale = _set(k_scale, i, jax.lax.dynamic_update_slice(k_scale[i], k_s, start[:-1]))
            v_scale = _set(v_scale, i, jax.lax.dynamic_update_slice(v_scale[i], v_s, start[:-1]))
        k_all = _set(k_all, i, jax.lax.dynamic_update_slice(k_all[i], to_storage(k_new, k_all[i].dtype), start))
        v_all = _set(v_all, i, jax.lax.dynamic_update_slice(v_all[i], to_storage(v_new, v_all[i].dtype), start))
        return k_all, v_all, k_scale, v_scale

    @property
    def block_size(self) -> int:
        # max_len is a power of two: blocks tile it. At least two blocks: with one block spanning a whole
        # layer's buffer, XLA:CPU copied that buffer every decode step at batch 1 (not at batch >= 2)
        if self.max_len <= BLOCK:
            return self.max_len // 2 if self.max_len % 2 == 0 else self.max_len
        return BLOCK

    def key_block(self, kv, layer, j):
        """Slots [j * block, (j + 1) * block) of `layer`: keys, values (B, K, block, H), positions (B, block)."""
        i = _layer_index(layer)
        k_all, v_all, k_scale, v_scale = kv
        b, k = k_all[i].shape[:2]
        size = self.block_size

        def take(x):
            return jax.lax.dynamic_slice(x[i], (0, 0, j * size, 0)[: x[i].ndim], (b, k, size, *x[i].shape[3:]))

        kb, vb = take(k_all), take(v_all)
        if k_scale is not None:
            kb, vb = dequantize_kv(kb, take(k_scale)), dequantize_kv(vb, take(v_scale))
        return kb, vb, jax.lax.dynamic_slice(self.pos, (0, j * size), (b, size))

    def blocks_to_visit(self, positions_bt):
        """The blocks holding slots written so far, this call's included."""
        size = self.block_size
        return (self.end + positions_bt.shape[1] + size - 1) // size

    def advance(self, kv, num_tokens: int) -> KVCache:
        """After every layer wrote: the new keys and values, and `end` moved past this call's tokens."""
        return self.replace(k=kv[0], v=kv[1], k_scale=kv[2], v_scale=kv[3], end=self.end + num_tokens)

    def take_rows(self, rows) -> KVCache:
        """The cache of sequences `rows` (B',) of this one, in that order (samples of a prompt, beams)."""
        take = lambda x: None if x is None else tuple(jnp.take(a, rows, axis=0) for a in x)
        return self.replace(
            k=take(self.k), v=take(self.v), k_scale=take(self.k_scale), v_scale=take(self.v_scale),
            pos=jnp.take(self.pos, rows, axis=0),
        )  # fmt: skip


def constrain_cache(cache: KVCache) -> KVCache:
    """Sharding constraints on the cache under the current mesh: batch over data, kv heads over tensor."""
    each = lambda xs, names: tuple(constrain(x, names) for x in xs)
    scales = {}
    if cache.k_scale is not None:
        names = KV_NAMES[:-1]
        scales = {"k_scale": each(cache.k_scale, names), "v_scale": each(cache.v_scale, names)}
    return cache.replace(
        k=each(cache.k, KV_NAMES), v=each(cache.v, KV_NAMES), pos=constrain(cache.pos, POS_NAMES), **scales
    )


def _layer_index(layer) -> int:
    try:
        return int(layer)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            "the contiguous KVCache holds one buffer per layer: its layer index must be a Python int, "
            "not a traced value (decoding runs the layers as a Python loop: see transformer._run)"
        ) from None


def _set(buffers: tuple, i: int, x) -> tuple:
    """`buffers` with entry i replaced: the other layers' buffers pass through untouched."""
    return (*buffers[:i], x, *buffers[i + 1 :])


def scale_buffer(shape, dtype):
    """An int8 cache's float32 scales, one per token and kv head (no trailing H); None otherwise."""
    return jnp.zeros(shape[:-1], jnp.float32) if dtype == jnp.int8 else None


def quantize_kv(x):
    """Symmetric int8 of keys or values (..., H) with one float32 scale per token and head (...,): the
    absmax over H / 127. Per token, because a token's keys are written once and never rescaled."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def dequantize_kv(q, scale):
    return q.astype(jnp.float32) * scale[..., None]


def storage_dtype(dtype) -> jnp.dtype:
    """How a cache dtype is stored. XLA:CPU upcasts bfloat16 arithmetic to float32 and then rewrites
    the whole bfloat16 buffer every step (NOTES-jax-cpu.md), so on CPU bfloat16 values are kept as
    their uint16 bits, which it updates in place. Accelerators store bfloat16 as it is."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.uint16)
    return dtype


def to_storage(x: jax.Array, stored: jnp.dtype) -> jax.Array:
    if stored == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(stored)


def from_storage(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def cache_memory_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> int:
    """What `KVCache.init(cfg, batch_size, max_len, dtype)` would hold, without allocating it."""
    return _nbytes(jax.eval_shape(lambda: KVCache.init(cfg, batch_size, max_len, dtype)))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
