"""The contiguous KV cache (`jaxgen.model.cache.Cache`) of the Generator and beam search: an immutable
pytree passed into `forward` and returned updated.

Layout (glossary in `jaxgen.sharding`; the S slots cut into N blocks of S / N, N = 1 in the flat layout):
    k:    L x N x (B, K, H, S / N)  keys, slots minor: a buffer of their own for every layer and block
    v:    L x N x (B, K, S / N, H)  values, head dim minor
    k_scale, v_scale: L x N x (B, K, S / N) float32, int8 caches only: one scale per token and kv head
    pos:  (B, S) int32     the token position held in each slot; -1 marks an empty slot
    end:  () int32         the next slot to write; all sequences of a batch write the same slot

Two layouts, chosen per backend in one place (`kernels.cache_layout`, `model.cache_layout`):

- blocks (XLA:CPU): N = `num_blocks(S)` blocks of BLOCK slots or more. All rows write the shared slot
  `end`, so a call touches only the block(s) holding slots [end, end + T), each under a `lax.cond` (a
  `dynamic_update_slice` for one token, a dropping scatter for more), in place when the cache is donated.
- flat (GPU, TPU): N = 1, one buffer per layer for keys and one for values, written without a cond (one
  `dynamic_update_slice` for one token, one dropping scatter for more: slots past S are dropped, never
  clamped onto earlier ones) and read by attention in one masked pass over all S slots. A step is then
  a few kernels per layer; with N blocks it carried 3N - 1 conds per layer, each a dependent launch on a
  GPU (bench/decode.py counts both, compiled for sm_90).

In the blocks layout, Each block being a buffer of its own, cached attention reads
the blocks in use in place, where blocks sliced out of one buffer per layer were copied by XLA:CPU before
every product. Keys are stored (H, slots) and values (slots, H), each block in its product's
(contracted, columns) order, which CPU decoding's written-out sums (`kernels.cpu`) read along contiguous
memory. Blocks are few (`MAX_BLOCKS`): each adds conds to every layer of the compiled step (measured:
docs/performance.md, "KV cache layout"). Layers and blocks are indexed statically: decoding runs the
layers as a Python loop. Ragged prompts leave empty slots (pos = -1) that attention masks out; each
row's own positions (for RoPE / learned embeddings) live in `pos`, so a padded sequence computes exactly
what it would alone.

On a mesh with a context axis of C devices (dividing S / N) each block's slots are split C ways (device r
holds slots [r S / (N C), (r + 1) S / (N C)) of every block; `pos` and `end` whole everywhere): each
device writes the slots it holds (`write` under `shard_map`), and decode steps read them with a partial
softmax per device (`context.split_cached_attention`), so a long sequence's cache takes 1/C per device.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgen.config import ModelConfig
from jaxgen.model import kernels
from jaxgen.model.context import AXIS as CONTEXT
from jaxgen.model.storage import dequantize_kv, quantize_kv, scale_buffer, storage_dtype, to_storage
from jaxgen.sharding import constrain, context_size, logical_spec

BLOCK = 64  # cache slots per block of cached attention (at most MAX_BLOCKS blocks: larger caches, larger blocks)
MAX_BLOCKS = 16
# A block's slots split over the mesh's context axis where it has one (device r: slots [r Sb / C, (r + 1)
# Sb / C) of every block, `context_parts`); slot positions and `end` stay whole on every device.
K_NAMES = ("batch", "kv_heads", "head_dim", "seq")  # each layer's and block's key buffer
V_NAMES = ("batch", "kv_heads", "seq", "head_dim")  # and value buffer
SCALE_NAMES = ("batch", "kv_heads", "seq")  # int8 scales of either
POS_NAMES = ("batch", "cache_seq")


@flax.struct.dataclass
class KVCache:
    k: tuple  # L x N x (B, K, H, S / N): one buffer per layer and block, slots minor
    v: tuple  # L x N x (B, K, S / N, H)
    pos: jax.Array  # (B, S) int32, -1 = empty
    end: jax.Array  # () int32
    k_scale: tuple | None = None  # L x N x (B, K, S / N) float32 for an int8 cache (`quantize_kv`), else None
    v_scale: tuple | None = None
    split: int = flax.struct.field(pytree_node=False, default=1)  # C inside `context_parts`' shard_map, else 1

    @classmethod
    def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty cache, laid out as `kernels.cache_layout(cfg)` says; `dtype` float32, bfloat16 (held as
        uint16 bits on CPU, see `storage_dtype`) or int8 (one float32 scale per token and kv head:
        `quantize_kv`)."""
        blocks = num_blocks(max_len, kernels.cache_layout(cfg))
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

    def room(self, positions_b):
        """(B,) the free slots, the same for every row (the cache is sized for the run)."""
        return jnp.broadcast_to(self.max_len - self.end, positions_b.shape)

    def memory_bytes(self) -> int:
        """Bytes held by the cache's arrays (keys, values and slot positions)."""
        return _nbytes(self)

    def constrain(self) -> KVCache:
        """Sharding constraints under the current mesh: batch over data, kv heads over tensor, slots over context."""
        each = lambda xs, names: jax.tree.map(lambda x: constrain(x, names), xs)
        scales = {}
        if self.k_scale is not None:
            scales = {"k_scale": each(self.k_scale, SCALE_NAMES), "v_scale": each(self.v_scale, SCALE_NAMES)}
        return self.replace(
            k=each(self.k, K_NAMES), v=each(self.v, V_NAMES), pos=constrain(self.pos, POS_NAMES), **scales
        )

    def forget_rejected(self, before: KVCache, keep_bt, positions_bt=None) -> KVCache:
        """After a speculative call of W + 1 tokens on `before`: it wrote slots [before.end, before.end +
        W + 1), shared by all rows, and those slots keep a position only where kept (`keep_bt` (B, W + 1);
        `positions_bt`, or else the position written), -1 elsewhere. The next call writes from just past
        the last slot any row kept: the slots after it held rejected tokens only and are written over, so
        attention reads no more slots than needed."""
        end, t = before.end, keep_bt.shape[1]
        if positions_bt is None:
            positions_bt = jax.lax.dynamic_slice(self.pos, (0, end), (self.pos.shape[0], t))
        used = jnp.max(jnp.where(keep_bt, jnp.arange(t)[None] + 1, 0))
        pos = jax.lax.dynamic_update_slice(self.pos, jnp.where(keep_bt, positions_bt, -1), (0, end))
        return self.replace(pos=pos, end=end + used)

    # --- what attention needs (see jaxgen.model.cache and jaxgen.model.attention) ---------------------

    @property
    def decode_kernel(self) -> None:
        """None: no fused decode kernel reads these blocks; attention's block loop does."""
        return None

    def decode_inputs(self, kv, layer) -> tuple:
        return ()

    def with_positions(self, positions_bt) -> KVCache:
        """The cache as a call of T tokens sees it: their positions recorded at slots [end, end + T)."""
        return self.replace(pos=jax.lax.dynamic_update_slice(self.pos, positions_bt.astype(jnp.int32), (0, self.end)))

    def arrays(self) -> tuple:
        """What the layers thread and write: keys, values and (int8) their scales, None otherwise."""
        return self.k, self.v, self.k_scale, self.v_scale

    @property
    def context_split(self) -> int:
        """C when the mesh has a context axis of C > 1 devices that divides a block's slots: each device
        then holds Sb / C slots of every block, writes its own (`write`) and attention reads them with a
        partial softmax per device (`context.split_cached_attention`); else 1 (blocks whole everywhere)."""
        c = context_size()
        return c if self.split == 1 and c > 1 and self.block_size % c == 0 else 1

    def context_parts(self, kv):
        """For `shard_map` over the mesh: (tables, their specs, the specs of `kv`), where tables are the
        slot positions and `end` (whole on every device) and `as_part(tables, kv, split)` rebuilds the
        cache of a device's part: blocks of Sb / C slots."""
        mesh = jax.sharding.get_abstract_mesh()
        spec = lambda names: lambda x: logical_spec(names, x.shape, mesh)
        k_all, v_all, k_scale, v_scale = kv
        kv_specs = (jax.tree.map(spec(K_NAMES), k_all), jax.tree.map(spec(V_NAMES), v_all))
        kv_specs += tuple(None if x is None else jax.tree.map(spec(SCALE_NAMES), x) for x in (k_scale, v_scale))
        return (self.pos, self.end), (spec(POS_NAMES)(self.pos), P()), kv_specs

    def as_part(self, tables, kv, split: int) -> KVCache:
        """Inside `shard_map` over context: the cache of this device's part (see `context_parts`)."""
        k_all, v_all, k_scale, v_scale = kv
        pos, end = tables
        return self.replace(k=k_all, v=v_all, k_scale=k_scale, v_scale=v_scale, pos=pos, end=end, split=split)

    def _part_start(self, held: int):
        """The first slot of this device's part of a block, counted from the block's start."""
        return 0 if self.split == 1 else jax.lax.axis_index(CONTEXT) * held

    def write(self, kv, layer, k_btkh, v_btkh, positions_bt):
        """This call's keys and values of `layer` (a Python int) at slots [end, end + T), written into
        the blocks holding those slots (`_write_blocks`); in place when donated. With blocks split over
        the context axis each device writes its own slots (under `shard_map`; the call's keys whole on
        every device)."""
        split = self.context_split
        if split > 1:
            return self._write_parts(kv, layer, k_btkh, v_btkh, positions_bt, split)
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

    def _write_parts(self, kv, layer, k_btkh, v_btkh, positions_bt, split: int):
        """`write` with blocks split over the context axis: each device writes the slots it holds."""
        i = _static_index(layer, "layer")
        mesh = jax.sharding.get_abstract_mesh()
        tables, table_specs, kv_specs = self.context_parts(kv)
        layer_of = lambda x: None if x is None else x[i]
        new_spec = logical_spec(("batch", None, "kv_heads", "head_dim"), k_btkh.shape, mesh)

        def local(tables, kv_i, k, v, positions):
            one = tuple(None if x is None else (x,) for x in kv_i)  # a one-layer cache of this device's part
            written = self.as_part(tables, one, split).write(one, 0, k, v, positions)
            return tuple(None if x is None else x[0] for x in written)

        kv_i, specs_i = tuple(map(layer_of, kv)), tuple(map(layer_of, kv_specs))
        new = jax.shard_map(
            local, mesh=mesh, in_specs=(table_specs, specs_i, new_spec, new_spec, P(new_spec[0], None)),
            out_specs=specs_i, check_vma=False,
        )(tables, kv_i, k_btkh, v_btkh, positions_bt)  # fmt: skip
        return tuple(x if x is None else _set(x, i, y) for x, y in zip(kv, new, strict=True))

    def _write_blocks(self, blocks: tuple, new, axis: int):
        """`blocks` (N buffers, slots along `axis`) with `new` (T slots along `axis`) written at slots
        [end, end + T): each block under a cond on whether it holds any of them, so a step touches one
        or two; a lone block (the flat layout) without one. (A device's part of split blocks: the slots of
        its part.)"""
        size, t = self.block_size, new.shape[axis]
        held = blocks[0].shape[axis]  # size, or Sb / C slots of a device's part
        out = []
        for j, block in enumerate(blocks):
            first = self.end - j * size - self._part_start(held)  # this call's first slot, counted from ours
            if len(blocks) == 1:  # the flat layout: a whole layer (slot `end` inside it but on the step
                # a full cache's finished rows run as padding, whose write clamps onto the last slot as
                # `with_positions` does its position: nobody reads it), or a device's part of one
                out.append(_write_at(block, new, first, axis, inside=self.split == 1))
                continue
            owns = (first < held) & (first + t > 0)
            write = functools.partial(_write_at, new=new, first=first, axis=axis, inside=True)
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
        size, held = self.block_size, kb.shape[-1]  # held: Sb / C slots of a device's part
        if self.split == 1:
            return kb, vb, self.pos[:, j * size : (j + 1) * size]
        return kb, vb, jax.lax.dynamic_slice_in_dim(self.pos, j * size + self._part_start(held), held, axis=1)

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


def _write_at(block, new, first, axis: int, inside: bool):
    """`block` with `new`'s T slots (along `axis`) written at slots [first, first + T) of it (`first`
    traced); slots outside the block are dropped. One token known to lie `inside` the block: a
    `dynamic_update_slice`; else a dropping scatter, which never clamps a slot onto another (T > 1 near
    the end; a device's part of split slots, which holds slot `first` or not)."""
    if new.shape[axis] == 1 and inside:
        return jax.lax.dynamic_update_slice_in_dim(block, new, first, axis)
    offset = first + jnp.arange(new.shape[axis])
    offset = jnp.where(offset < 0, block.shape[axis], offset)  # before this block: out of range, dropped
    return block.at[(slice(None),) * axis + (offset,)].set(new, mode="drop", unique_indices=True)


def num_blocks(max_len: int, layout: str = "blocks") -> int:
    """How many blocks a cache of `max_len` slots is cut into: one in the flat layout; in the blocks
    layout, blocks of BLOCK slots, at most MAX_BLOCKS of them, and at least two, so that a short sequence
    in a small cache reads half of it; blocks always tile the slots exactly. (Two was first the fix for
    XLA:CPU copying a single block that spanned a layer's whole buffer every step at batch 1; with a
    buffer per block a one-block cache compiled without copies at batch 1 and 2.)"""
    if layout == "flat":
        return 1
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


def cache_memory_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> int:
    """What `KVCache.init(cfg, batch_size, max_len, dtype)` would hold, without allocating it."""
    return _nbytes(jax.eval_shape(lambda: KVCache.init(cfg, batch_size, max_len, dtype)))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
