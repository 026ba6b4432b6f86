"""The KV cache: an immutable pytree passed into `forward` and returned updated.

Layout (glossary in `jaxgen.sharding`; the S slots cut into N blocks of S / N):
    k:    L x N x (B, K, H, S / N)  keys, slots minor: a buffer of their own for every layer and block
    v:    L x N x (B, K, S / N, H)  values, head dim minor
    k_scale, v_scale: L x N x (B, K, S / N) float32, int8 caches only: one scale per token and kv head
    pos:  (B, S) int32     the token position held in each slot; -1 marks an empty slot
    end:  () int32         the next slot to write; all sequences of a batch write the same slot

Writing every sequence at the shared slot `end` keeps the update to the block(s) holding slots
[end, end + T), each under a `lax.cond`: a `dynamic_update_slice` for one token (a decode step), a
scatter that drops what falls outside the block for more (prefill chunks, speculation windows); in
place when the cache is donated. (An unguarded dropping scatter into every block made XLA:CPU copy the
blocks every step at batch 1.) Batch and kv heads lead, the batch dimensions of both products of
attention; keys are stored (H, slots) and values (slots, H), each block in the (contracted, columns)
order of its product (queries times keys, probabilities times values), so that the decode step's
products written as sums (`attention._scores_as_sums`, `_values_as_sums`) run along contiguous memory.
For the matrix products the key order matters little at 64-slot blocks (`bench/attention_layout.py`:
38.4 ms with keys (slots, H), 39.8 with (H, slots), 20.2 as sums, llama-small shapes, batch 32, 12
layers x 2 blocks); in an earlier microbenchmark of the same loop with 80-slot blocks keys (slots, H)
took 85-107 ms against 30-32.
Cached attention reads only the blocks in use (`blocks_to_visit`), each under a `lax.cond`, and because
each block is a buffer of its own the products read it in place. Blocks cut out of one (B, K, S, H)
buffer per layer, as before, were `dynamic_slice`s that XLA:CPU copied before every product: a
gpt2-124m decode step at batch 32 (32-token prompts, 128 new tokens, 256 slots; process pairs, the old
layout first) took 156.6 / 141.5 ms with one buffer per layer (128-slot blocks) against 112.4 / 118.6 ms
with this layout (64-slot blocks; a prototype with 128-slot block buffers, writing every block
unguarded, measured 107-129 ms: finer blocks read fewer empty slots). The number of blocks is capped
(`MAX_BLOCKS`): each adds conds to every layer of the compiled step, and with 64 blocks of 64 slots
(that prototype) the cache-length benchmark (`bench/decode.py`, 256 and 4096 slots) took 188 s against
65 s, mostly compiling. (Beyond 16 x 64 slots blocks grow, and attention reads a longer block in 64-slot
parts, those in use only: `attention._fold_parts`.) Layers and blocks are indexed statically:
decoding runs the layers as a Python loop. Ragged prompts leave empty slots (pos = -1) that attention
masks out; each sequence's own positions (for RoPE / learned embeddings) live in `pos`, so a padded
sequence computes exactly what it would alone.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.sharding import constrain

BLOCK = 64  # cache slots per block of cached attention (at most MAX_BLOCKS blocks: larger caches, larger blocks)
MAX_BLOCKS = 16
K_NAMES = ("batch", "kv_heads", "head_dim", "cache_seq")  # each layer's and block's key buffer
V_NAMES = ("batch", "kv_heads", "cache_seq", "head_dim")  # and value buffer
SCALE_NAMES = ("batch", "kv_heads", "cache_seq")  # int8 scales of either
POS_NAMES = ("batch", "cache_seq")


@flax.struct.dataclass
class KVCache:
    k: tuple  # L x N x (B, K, H, S / N): one buffer per layer and block, slots minor
    v: tuple  # L x N x (B, K, S / N, H)
    pos: jax.Array  # (B, S) int32, -1 = empty
    end: jax.Array  # () int32
    k_scale: tuple | None = None  # L x N x (B, K, S / N) float32 for an int8 cache (`quantize_kv`), else None
    v_scale: tuple | None = None

    @classmethod
    def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty cache; `dtype` float32, bfloat16 (held as uint16 bits on CPU, see `storage_dtype`) or
        int8 (one float32 scale per token and kv head: `quantize_kv`)."""
        blocks = num_blocks(max_len)
        shape = (batch_size, cfg.kv_heads, max_len // blocks, cfg.head_size)  # values; keys (B, K, H, S / N)
        key_shape = (*shape[:2], shape[3], shape[2])
        dtype = storage_dtype(dtype)

        def per_layer(make):  # a buffer of its own for every layer and block: the loops donate them
            return tuple(tuple(make() for _ in range(blocks)) for _ in range(cfg.num_layers))

        scales = dtype == jnp.int8
        return cls(
            k=per_layer(lambda: jnp.zeros(key_shape, dtype)),
            v=per_layer(lambda: jnp.zeros(shape, dtype)),
            pos=jnp.full((batch_size, max_len), -1, jnp.int32),
            end=jnp.zeros((), jnp.int32),
            k_scale=per_layer(lambda: scale_buffer(shape, dtype)) if scales else None,
            v_scale=per_layer(lambda: scale_buffer(shape, dtype)) if scales else None,
        )

    @property
    def max_len(self) -> int:
        return self.pos.shape[1]

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
        """This call's keys and values of `layer` (a Python int) at slots [end, end + T), written into
        the blocks holding those slots (`_write_blocks`); in place when donated."""
        i = _static_index(layer, "layer")
        k_new, v_new = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)  # (B, K, T, H)
        k_all, v_all, k_scale, v_scale = kv
        if k_scale is not None:
            (k_new, k_s), (v_new, v_s) = quantize_kv(k_new), quantize_kv(v_new)
            k_scale = _set(k_scale, i, self._write_blocks(k_scale[i], k_s, 2))
            v_scale = _set(v_scale, i, self._write_blocks(v_scale[i], v_s, 2))
        k_new = to_storage(k_new, k_all[i][0].dtype).swapaxes(2, 3)  # (B, K, H, T), as keys are stored
        k_all = _set(k_all, i, self._write_blocks(k_all[i], k_new, 3))
        v_all = _set(v_all, i, self._write_blocks(v_all[i], to_storage(v_new, v_all[i][0].dtype), 2))
        return k_all, v_all, k_scale, v_scale

    def _write_blocks(self, blocks: tuple, new, axis: int):
        """`blocks` (N buffers, slots along `axis`) with `new` (T slots along `axis`) written at slots
        [end, end + T): each block under a cond on whether it holds any of them, so a step touches one
        or two."""
        size, t = self.block_size, new.shape[axis]
        slots = self.end + jnp.arange(t)  # this call's slots
        out = []
        for j, block in enumerate(blocks):
            first = self.end - j * size  # this call's first slot, counted from the block's start
            owns = (first < size) & (first + t > 0)
            if t == 1:
                write = lambda b, first=first: jax.lax.dynamic_update_slice_in_dim(b, new, first, axis)
            else:
                offset = slots - j * size
                offset = jnp.where(offset < 0, size, offset)  # before this block: out of range, dropped
                at = (slice(None),) * axis + (offset,)
                write = lambda b, at=at: b.at[at].set(new, mode="drop", unique_indices=True)
            out.append(jax.lax.cond(owns, write, lambda b: b, block))
        return tuple(out)

    @property
    def num_blocks(self) -> int:
        """N, the blocks of slots: each a buffer of its own, which attention reads in place."""
        return len(self.k[0])

    @property
    def block_size(self) -> int:
        return self.max_len // self.num_blocks

    def key_block(self, kv, layer, j):
        """Block j (a Python int) of `layer`, slots [j * block, (j + 1) * block): keys (B, K, H, block)
        and values (B, K, block, H) as stored, and their positions (B, block)."""
        i, j = _static_index(layer, "layer"), _static_index(j, "block")
        k_all, v_all, k_scale, v_scale = kv
        kb, vb = k_all[i][j], v_all[i][j]
        if k_scale is not None:
            kb, vb = dequantize_kv(kb, k_scale[i][j], axis=2), dequantize_kv(vb, v_scale[i][j])
        size = self.block_size
        return kb, vb, self.pos[:, j * size : (j + 1) * size]

    def filled(self, positions_bt):
        """() int32: the slots written so far, this call's included (slots [0, filled))."""
        return self.end + positions_bt.shape[1]

    def blocks_to_visit(self, positions_bt):
        """The blocks holding slots written so far, this call's included."""
        size = self.block_size
        return (self.filled(positions_bt) + size - 1) // size

    def advance(self, kv, num_tokens: int) -> KVCache:
        """After every layer wrote: the new keys and values, and `end` moved past this call's tokens."""
        return self.replace(k=kv[0], v=kv[1], k_scale=kv[2], v_scale=kv[3], end=self.end + num_tokens)

    def take_rows(self, rows) -> KVCache:
        """The cache of sequences `rows` (B',) of this one, in that order (samples of a prompt, beams)."""
        take = lambda x: None if x is None else jax.tree.map(lambda a: jnp.take(a, rows, axis=0), x)
        return self.replace(
            k=take(self.k), v=take(self.v), k_scale=take(self.k_scale), v_scale=take(self.v_scale),
            pos=jnp.take(self.pos, rows, axis=0),
        )  # fmt: skip


def constrain_cache(cache: KVCache) -> KVCache:
    """Sharding constraints on the cache under the current mesh: batch over data, kv heads over tensor."""
    each = lambda xs, names: jax.tree.map(lambda x: constrain(x, names), xs)
    scales = {}
    if cache.k_scale is not None:
        scales = {"k_scale": each(cache.k_scale, SCALE_NAMES), "v_scale": each(cache.v_scale, SCALE_NAMES)}
    return cache.replace(
        k=each(cache.k, K_NAMES), v=each(cache.v, V_NAMES), pos=constrain(cache.pos, POS_NAMES), **scales
    )


def num_blocks(max_len: int) -> int:
    """How many blocks a cache of `max_len` slots is cut into: blocks of BLOCK slots, at most
    MAX_BLOCKS of them, and at least two, so that a short sequence in a small cache reads half of it;
    blocks always tile the slots exactly. (Two was first the fix for XLA:CPU copying a single block that
    spanned a layer's whole buffer every step at batch 1; with a buffer per block a one-block cache
    compiled without copies at batch 1 and 2.)"""
    if max_len <= BLOCK:
        return 2 if max_len % 2 == 0 else 1
    blocks = min(max_len // BLOCK, MAX_BLOCKS)
    while max_len % blocks:
        blocks -= 1
    return blocks


def _static_index(index, what: str) -> int:
    try:
        return int(index)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"the contiguous KVCache holds a buffer per layer and block: its {what} index must be a Python "
            "int, not a traced value (decoding runs the layers as a Python loop: see transformer._run, and "
            "attention the blocks: see attention.cached_attention)"
        ) from None


def _set(buffers: tuple, i: int, x) -> tuple:
    """`buffers` with entry i replaced: the other layers' buffers pass through untouched."""
    return (*buffers[:i], x, *buffers[i + 1 :])


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


def storage_dtype(dtype) -> jnp.dtype:
    """How a cache dtype is stored. XLA:CPU upcasts bfloat16 arithmetic to float32 and then rewrites
    the whole bfloat16 buffer every step (docs/performance.md, "CPU facts"), so on CPU bfloat16 values are kept as
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
