"""The paged KV cache of the serving engine: a pool of fixed-size pages and a page table per slot.

Layout (glossary in `jaxgen.sharding`; Q pages of size Z in the pool, M pages at most per slot):
    k, v:       (L, Q, Z, K, H)  keys and values of every layer, page, offset and kv head
    page_table: (B, M) int32     the pages of each decode slot (row b), in position order; 0 = none
    capacity:   (B,) int32       tokens the slot's pages can hold (pages allocated x Z)

A token at position p of slot b lives in page page_table[b, p // Z] at offset p % Z. Page 0 is never
handed out: padding and idle slots write there, and nothing reads it (keys are masked by position,
which attention derives from the page index, not from the page's contents). Pages are shared between
slots by reference (a common prompt prefix): only whole pages of a prompt are shared, and a slot never
writes into a shared page, because its own tokens go after the shared prefix, in pages of its own.

The pool and tables are device arrays updated by jitted functions; which pages are free, shared or
cached is host bookkeeping (`jaxgen.inference.pages.PagePool`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.model import layers
from jaxgen.model.kvcache import storage_dtype, to_storage

NULL_PAGE = 0


@flax.struct.dataclass
class PagedCache:
    k: jax.Array  # (L, Q, Z, K, H)
    v: jax.Array  # (L, Q, Z, K, H)
    page_table: jax.Array  # (B, M) int32
    capacity: jax.Array  # (B,) int32

    @classmethod
    def init(cls, cfg: ModelConfig, num_pages: int, page_size: int, slots: int, max_pages: int, dtype="float32"):
        shape = (cfg.num_layers, num_pages, page_size, cfg.kv_heads, cfg.head_size)
        dtype = storage_dtype(dtype)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            page_table=jnp.zeros((slots, max_pages), jnp.int32),
            capacity=jnp.zeros((slots,), jnp.int32),
        )

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def is_full(self, positions_b):
        """Per slot: is there no room for the token at `positions_b`?"""
        return positions_b >= self.capacity


def page_bytes(cfg: ModelConfig, page_size: int, dtype="float32") -> int:
    """Bytes of one page across all layers, keys and values."""
    return 2 * cfg.num_layers * page_size * cfg.kv_heads * cfg.head_size * jnp.dtype(storage_dtype(dtype)).itemsize


def write(cache: PagedCache, layer: int, k_btkh, v_btkh, positions_bt, kv):
    """Scatters this call's keys and values of `layer` into the slots' pages; padding goes to page 0."""
    k_all, v_all = kv
    z = cache.page_size
    valid = positions_bt >= 0
    rows = jnp.arange(positions_bt.shape[0])[:, None]
    page = jnp.where(valid, cache.page_table[rows, jnp.maximum(positions_bt, 0) // z], NULL_PAGE)
    offset = jnp.where(valid, positions_bt % z, 0)
    k_all = k_all.at[layer, page, offset].set(to_storage(k_btkh, k_all.dtype))
    v_all = v_all.at[layer, page, offset].set(to_storage(v_btkh, v_all.dtype))
    return k_all, v_all


def attention(q_btnh, kv, layer: int, page_table, q_pos_bt, num_kv_heads: int, window: int | None):
    """Attention of each slot's queries over its own pages, one page at a time (online softmax).

    Only the pages up to the furthest query position are visited, so a step costs what the longest
    live sequence holds, not the table's width. Returns (B, T, N, H) and the pool, threaded through the
    loop's carry (as a loop-invariant operand XLA would copy it).
    """
    b, t, n, h = q_btnh.shape
    k = num_kv_heads
    q = q_btnh.reshape(b, t, k, n // k, h).astype(jnp.float32) * (h**-0.5)
    k_all, v_all = kv
    num_pages, z = k_all.shape[1], k_all.shape[2]

    def page_step(j, carry):
        stats, (k_all, v_all) = carry
        rows = layer * num_pages + page_table[:, j]  # one index into (L * Q, Z, K, H)
        kb = jnp.take(k_all.reshape(-1, z, k, h), rows, axis=0)  # (B, Z, K, H)
        vb = jnp.take(v_all.reshape(-1, z, k, h), rows, axis=0)
        key_pos = j * z + jnp.arange(z)
        mask = (key_pos[None, None, :] <= q_pos_bt[:, :, None]) & (q_pos_bt[:, :, None] >= 0)
        if window is not None:
            mask = mask & (q_pos_bt[:, :, None] - key_pos[None, None, :] < window)
        return layers._online_softmax_step(stats, q, kb, vb, mask), (k_all, v_all)

    init = (
        jnp.full((b, k, n // k, t), layers.NEG_INF, jnp.float32),
        jnp.zeros((b, k, n // k, t), jnp.float32),
        jnp.zeros((b, k, n // k, t, h), jnp.float32),
    )
    pages = jnp.max(q_pos_bt) // z + 1
    (_, l, acc), kv = jax.lax.fori_loop(0, pages, page_step, (init, (k_all, v_all)))
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype), kv
