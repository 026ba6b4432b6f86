"""The paged KV cache (`jaxgen.model.cache.Cache`) of the serving engine: a pool of fixed-size pages and
a page table per slot.

Layout (glossary in `jaxgen.sharding`; Q pages of size Z in the pool, M pages at most per slot):
    k, v:       (K, L, Q, Z, H)  keys and values of every kv head, layer, page and offset
    k_scale, v_scale: (K, L, Q, Z) float32, int8 pools only: one scale per token and kv head
    page_table: (B, M) int32     the pages of each decode slot (row b), in position order; 0 = none
    capacity:   (B,) int32       tokens the slot's pages can hold (pages allocated x Z)

A token at position p of slot b lives in page page_table[b, p // Z] at offset p % Z. Page 0 is never
handed out: padding and idle slots write there, and nothing reads it (keys are masked by position,
which attention derives from the page index, not from the page's contents). Pages are shared between
slots by reference (a common prompt prefix): only whole pages of a prompt are shared, and a slot never
writes into a shared page, because its own tokens go after the shared prefix, in pages of its own.

The pool and tables are device arrays updated by jitted functions; which pages are free, shared or
cached is host bookkeeping (`jaxgen.inference.pages.PagePool`). Kv heads lead so that the pool seen as
(K, L * Q, Z, H), a free reshape, is what the GPU and TPU Pallas paged-attention kernels read in place,
layer l's page p being page l * Q + p (`decode_inputs`, `kernels.paged_kernel`); a tensor-parallel shard
of the kv heads is then one contiguous run of memory.

On a mesh with a context axis of C devices (dividing Z) each page's offsets are split C ways (device r
holds offsets [r Z / C, (r + 1) Z / C) of every page; tables whole everywhere): writes keep each device's
offsets, and decode steps read them with a partial softmax per device (`context.split_cached_attention`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.model.context import AXIS
from jaxgen.model.kernels import DecodeKernel, cpu, paged_gpu
from jaxgen.model.storage import dequantize_kv, from_storage, quantize_kv, scale_buffer, storage_dtype, to_storage
from jaxgen.sharding import constrain, context_size, logical_spec

NULL_PAGE = 0
# A page pool is shared by all slots: not over batch. Each page's offsets (its tokens) split over the mesh's
# context axis, where it has one: every device holds Z / C tokens of every page (`context_parts`).
PAGE_NAMES = ("kv_heads", "layers", None, "seq", "head_dim")
TABLE_NAMES = ("batch", None)  # page tables and capacities: rows with the queries' rows (inside shard_map)


@flax.struct.dataclass
class PagedCache:
    k: jax.Array  # (K, L, Q, Z, H)
    v: jax.Array  # (K, L, Q, Z, H)
    page_table: jax.Array  # (B, M) int32
    capacity: jax.Array  # (B,) int32
    k_scale: jax.Array | None = None  # (K, L, Q, Z) float32 for an int8 pool (`kvcache.quantize_kv`), else None
    v_scale: jax.Array | None = None
    split: int = flax.struct.field(pytree_node=False, default=1)  # C inside `context_parts`' shard_map, else 1

    @classmethod
    def init(cls, cfg: ModelConfig, num_pages: int, page_size: int, slots: int, max_pages: int, dtype="float32"):
        shape = (cfg.kv_heads, cfg.num_layers, num_pages, page_size, cfg.head_size)
        dtype = storage_dtype(dtype)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            page_table=jnp.zeros((slots, max_pages), jnp.int32),
            capacity=jnp.zeros((slots,), jnp.int32),
            k_scale=scale_buffer(shape, dtype),
            v_scale=scale_buffer(shape, dtype),  # its own buffer: the two are donated
        )

    @property
    def page_size(self) -> int:
        return self.k.shape[3] * self.split

    @property
    def context_split(self) -> int:
        """C when the mesh has a context axis of C > 1 devices that divides the page size: each device then
        holds Z / C offsets of every page, and attention reads them with a partial softmax per device
        (`context.split_cached_attention`); else 1 (pages whole on every device)."""
        c = context_size()
        return c if self.split == 1 and c > 1 and self.k.shape[3] % c == 0 else 1

    def context_parts(self, kv):
        """What `shard_map` over the mesh takes for a device's part of the pool: (tables, their specs, the
        specs of `kv`) and `as_part(tables, kv)` rebuilds the cache view of a device's part: pools (K, L, Q,
        Z / C, H) (Z / C offsets of every page: device r offsets [r Z / C, (r + 1) Z / C)), tables whole."""
        mesh = jax.sharding.get_abstract_mesh()
        spec = lambda x, names: None if x is None else logical_spec(names, x.shape, mesh)
        tables = (self.page_table, self.capacity)
        table_specs = (spec(self.page_table, TABLE_NAMES), spec(self.capacity, TABLE_NAMES[:1]))
        k_all, v_all, k_scale, v_scale = kv
        kv_specs = (spec(k_all, PAGE_NAMES), spec(v_all, PAGE_NAMES))
        kv_specs += (spec(k_scale, PAGE_NAMES[:-1]), spec(v_scale, PAGE_NAMES[:-1]))
        return tables, table_specs, kv_specs

    def as_part(self, tables, kv, split: int) -> PagedCache:
        """Inside `shard_map` over context: the cache of this device's part (see `context_parts`), `split`
        its `context_split`."""
        k_all, v_all, k_scale, v_scale = kv
        return self.replace(
            k=k_all, v=v_all, k_scale=k_scale, v_scale=v_scale, page_table=tables[0], capacity=tables[1],
            split=split,
        )  # fmt: skip

    def constrain(self) -> PagedCache:
        """Sharding constraints under the current mesh: kv heads over tensor, each device a slice of every page."""
        scales = {}
        if self.k_scale is not None:
            names = PAGE_NAMES[:-1]
            scales = {"k_scale": constrain(self.k_scale, names), "v_scale": constrain(self.v_scale, names)}
        return self.replace(k=constrain(self.k, PAGE_NAMES), v=constrain(self.v, PAGE_NAMES), **scales)

    def is_full(self, positions_b):
        """Per slot: is there no room for the token at `positions_b`?"""
        return positions_b >= self.capacity

    def room(self, positions_b):
        """(B,) tokens each slot's pages can still take from `positions_b` on (the engine reserves a draft
        window's pages before a speculative step)."""
        return self.capacity - positions_b

    def forget_rejected(self, before: PagedCache, keep_bt, positions_bt=None) -> PagedCache:
        """Nothing to undo: keys are addressed by position, and a rejected draft's key sits past its row's
        last kept token, where no query of the row looks until a later call writes that position again."""
        return self

    # --- what attention needs (see jaxgen.model.cache and attention); a block is one page -------------

    def with_positions(self, positions_bt) -> PagedCache:
        return self  # a key's position is where it sits: page index x page size + offset

    def write(self, kv, layer, k_btkh, v_btkh, positions_bt):
        """Scatters this call's keys and values of `layer` into the slots' pages; padding goes to page 0."""
        k_all, v_all, k_scale, v_scale = kv
        z = self.page_size
        valid = positions_bt >= 0
        rows = jnp.arange(positions_bt.shape[0])[:, None]
        page = jnp.where(valid, self.page_table[rows, jnp.maximum(positions_bt, 0) // z], NULL_PAGE)
        offset = jnp.where(valid, positions_bt % z, 0)
        if k_scale is not None:
            (k_btkh, k_s), (v_btkh, v_s) = quantize_kv(k_btkh), quantize_kv(v_btkh)
            k_scale = k_scale.at[:, layer, page, offset].set(k_s.transpose(2, 0, 1))
            v_scale = v_scale.at[:, layer, page, offset].set(v_s.transpose(2, 0, 1))
        k_all = k_all.at[:, layer, page, offset].set(to_storage(k_btkh, k_all.dtype).transpose(2, 0, 1, 3))
        v_all = v_all.at[:, layer, page, offset].set(to_storage(v_btkh, v_all.dtype).transpose(2, 0, 1, 3))
        return k_all, v_all, k_scale, v_scale

    def arrays(self) -> tuple:
        """What the layers thread and write: keys, values and (int8) their scales, None otherwise."""
        return self.k, self.v, self.k_scale, self.v_scale

    def key_block(self, kv, layer, j):
        """Each slot's page j of `layer`: keys (B, K, H, Z), values (B, K, Z, H) (the order
        `attention` takes; the gather copies the pages anyway) and positions (B, Z). A position past what
        the slot wrote is never seen (a query sees positions up to its own)."""
        return self.key_pages(kv, layer, j, 1)

    def key_pages(self, kv, layer, j, count: int):
        """Pages [j count, (j + 1) count) of each slot's table, of `layer`, as one block of count x Z slots
        (`key_block`'s shapes). Pages past the table are page 0, whose positions (past the slot's capacity)
        no query sees. Each (kv head, layer, page) of the pool is one row of Z x H values, gathered whole:
        XLA:CPU copies such rows several times faster than it gathers the same values element by element
        (the pool indexed as (K, L, Q, ...) with a (B, count) table)."""
        k_all, v_all, k_scale, v_scale = kv
        kh, num_layers, num_pages, held = k_all.shape[:4]  # held: Z, or Z / C of a device's part (`as_part`)
        b, z = self.page_table.shape[0], self.page_size
        index = j * count + jnp.arange(count)
        pages = jnp.take(self.page_table, index, axis=1, mode="fill", fill_value=NULL_PAGE)  # (B, count)
        rows = (jnp.arange(kh)[None, :, None] * num_layers + layer) * num_pages + pages[:, None]  # (B, K, count)

        def gather(pool):  # (K, L, Q, held[, H]) -> (B, K, count held[, H])
            flat = pool.reshape(kh * num_layers * num_pages, -1)
            return flat.at[rows].get(mode="promise_in_bounds").reshape(b, kh, count * held, *pool.shape[4:])

        kb, vb = gather(k_all), gather(v_all)
        if k_scale is not None:
            kb, vb = dequantize_kv(kb, gather(k_scale)), dequantize_kv(vb, gather(v_scale))
        first = index[:, None] * z + (0 if self.split == 1 else jax.lax.axis_index(AXIS) * held)
        pos = jnp.broadcast_to((first + jnp.arange(held)).reshape(-1), (b, count * held))
        return kb.swapaxes(2, 3), vb, pos  # keys (B, K, H, count held), values (B, K, count held, H)

    def fold(self, fold_block, stats, kv, layer, positions_bt):
        """`fold_block(stats, keys, values, positions)` over the pages any query at `positions_bt` (B, T)
        may see, `kernels.cpu.pages_per_block` pages a step (`key_pages`). Returns (stats, kv): kv rides in
        the loop's carry (as a loop-invariant operand XLA would copy the pool)."""
        count = cpu.pages_per_block(self.page_size)
        visit = -(-self.blocks_to_visit(positions_bt) // count)

        def body(j, carry):
            stats, kv = carry
            return fold_block(stats, *self.key_pages(kv, layer, j, count)), kv

        return jax.lax.fori_loop(0, visit, body, (stats, kv))

    @property
    def num_blocks(self) -> None:
        """None: pages are gathered by a traced index (see attention.cached_attention)."""
        return None

    def filled(self, positions_bt):
        """() int32: positions [0, filled) may hold keys in some slot, this call's included."""
        return jnp.max(positions_bt) + 1

    def blocks_to_visit(self, positions_bt):
        """The pages up to the furthest query position: a step costs what the longest live sequence holds."""
        return jnp.max(positions_bt) // self.page_size + 1

    def advance(self, kv, num_tokens: int) -> PagedCache:
        return self.replace(k=kv[0], v=kv[1], k_scale=kv[2], v_scale=kv[3])

    @property
    def decode_kernel(self) -> DecodeKernel:
        """The backend's Pallas paged kernel (`kernels.paged_kernel`), which reads the pools in place."""
        bfloat16 = self.k.dtype in (jnp.bfloat16, jnp.uint16)  # (uint16: bfloat16's bits, `storage`)
        facts = {"page_size": self.page_size, "quantized": self.k_scale is not None, "bfloat16": bfloat16}
        return DecodeKernel("paged", facts)

    def decode_inputs(self, kv, layer) -> paged_gpu.Pages:
        """The pools of float pages seen as (K, L * Q, Z, H), a free reshape, and each slot's pages of
        `layer` as rows of them (layer l's page p is row l * Q + p)."""
        k_all, v_all, *_ = kv  # float pages only (int8 pools take the XLA loop)
        kh, num_layers, num_pages, z, h = k_all.shape
        k_pool = from_storage(k_all).reshape(kh, num_layers * num_pages, z, h)
        v_pool = from_storage(v_all).reshape(kh, num_layers * num_pages, z, h)
        return paged_gpu.Pages(k_pool, v_pool, self.page_table + layer * num_pages)


def page_bytes(cfg: ModelConfig, page_size: int, dtype="float32") -> int:
    """Bytes of one page across all layers, keys and values (and their scales for int8)."""
    stored = jnp.dtype(storage_dtype(dtype))
    per_head = cfg.head_size * stored.itemsize + (4 if stored == jnp.int8 else 0)  # + a float32 scale
    return 2 * cfg.num_layers * page_size * cfg.kv_heads * per_head
