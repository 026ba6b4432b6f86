"""The cache contract: everything the model (`transformer`, `attention`) and the decode core (`decode`,
`speculative`) may ask of a KV cache. Nothing outside the cache modules asks which cache it holds.

Two caches implement it: the contiguous `kvcache.KVCache` (a buffer per layer and block, all rows
writing one shared slot: Generator, beam search) and the paged `paged.PagedCache` (a page pool and a
page table per row: the serving engine). A cache is an immutable pytree, passed into `forward` and
returned updated; `kv` is its (keys, values, key scales, value scales) tuple (`arrays`), threaded through
the layer loop's carry and written layer by layer (as a loop-invariant operand XLA would copy it).

Adding a third cache type (say a sliding-window ring buffer) touches its own file: a
`flax.struct.dataclass` (the decorator registers it as a pytree) with every member below, storing keys
and values through `jaxgen.model.storage`, its sharding stated by its own `constrain`. The model and the
decode core take it as they are; attention reads it block by block. Should a fused decode kernel read it
in place, the cache names that kernel in `decode_kernel` and hands its inputs in `decode_inputs`; a new
kernel's one registration is its entry in `jaxgen.model.kernels.DECODE_KERNELS`. (List the type in
`tests/test_cache_contract.py`, which checks every member's presence and signature.)

Shapes (glossary in `jaxgen.sharding`): B rows, T this call's tokens, K kv heads, H head dim, W + 1 the
tokens of a speculative call; a block holds Sb slots.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from jaxgen.model.kernels import DecodeKernel


@runtime_checkable
class Cache(Protocol):
    """What a KV cache provides. `layer` and `j` may have to be Python ints (`num_blocks` an int: blocks
    are buffers of their own, indexed statically)."""

    @property
    def num_blocks(self) -> int | None:
        """N, the static number of blocks per layer (read by a Python loop, each block in place), or
        None: blocks are gathered by a traced index (a `fori_loop` up to `blocks_to_visit`)."""
        ...

    @property
    def decode_kernel(self) -> DecodeKernel | None:
        """The fused decode kernel that reads this cache in place, and the facts it checks; or None:
        attention's XLA block loop reads it (`jaxgen.model.kernels.decode_kernel` decides per call)."""
        ...

    def with_positions(self, positions_bt: jax.Array) -> Cache:
        """The cache as a call of T tokens at `positions_bt` (B, T) int32 (-1 = padding) sees it."""
        ...

    def arrays(self) -> tuple:
        """kv: what the layers thread and write (keys, values, and for int8 their scales, else None)."""
        ...

    def write(self, kv: tuple, layer, k_btkh: jax.Array, v_btkh: jax.Array, positions_bt: jax.Array) -> tuple:
        """kv with this call's keys and values (B, T, K, H) of `layer` stored."""
        ...

    def blocks_to_visit(self, positions_bt: jax.Array) -> jax.Array:
        """() int32, >= 1: the leading blocks that hold any key these queries may see."""
        ...

    def key_block(self, kv: tuple, layer, j) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Block j of `layer`: keys (B, K, H, Sb) and values (B, K, Sb, H) as stored (int8 dequantized;
        `storage.from_storage` gives floats) and each slot's position (B, Sb) int32, -1 = empty."""
        ...

    def filled(self, positions_bt: jax.Array) -> jax.Array:
        """() int32: slots [0, filled) of a row may hold keys, this call's included."""
        ...

    def advance(self, kv: tuple, num_tokens: int) -> Cache:
        """After every layer wrote: the cache holding `kv`, past this call's `num_tokens` (T) tokens."""
        ...

    def is_full(self, positions_b: jax.Array) -> jax.Array:
        """(B,) bool: is there no room for the token at `positions_b` (B,)?"""
        ...

    def room(self, positions_b: jax.Array) -> jax.Array:
        """(B,) int32: tokens each row can still take from `positions_b` (B,) on."""
        ...

    def forget_rejected(self, before: Cache, keep_bt: jax.Array, positions_bt: jax.Array | None = None) -> Cache:
        """After a speculative call of W + 1 tokens made on `before`: of this call's keys, those not kept
        (`keep_bt` (B, W + 1) bool false) are never read again. `positions_bt` (B, W + 1): the positions
        the kept ones hold, or None: those this call wrote."""
        ...

    def decode_inputs(self, kv: tuple, layer) -> tuple:
        """What `decode_kernel`'s kernel reads of `layer`: float views of `kv`, no copy (() without one)."""
        ...

    def constrain(self) -> Cache:
        """The cache with sharding constraints under the current mesh."""
        ...

    # On a mesh with a context axis: a cache whose blocks' slots are split over it (each device its share
    # of every block's slots) is read by a partial softmax per device (`context.split_cached_attention`).

    @property
    def context_split(self) -> int:
        """C > 1 when every block's slots are split over the mesh's context axis of C devices; else 1."""
        ...

    def context_parts(self, kv: tuple) -> tuple:
        """For `shard_map` over the mesh: (tables, their specs, the specs of `kv`); the tables are what
        every device holds whole (slot positions, page tables)."""
        ...

    def as_part(self, tables: tuple, kv: tuple, split: int) -> Cache:
        """Inside that `shard_map`: the cache of this device's part (blocks of Sb / C slots)."""
        ...
