"""The KV cache: an immutable pytree passed into `forward` and returned updated.

Layout (glossary in `jaxgen.sharding`):
    k, v: (L, S, B, K, H)  keys and values for every layer, slot, sequence and kv head
    pos:  (B, S) int32     the token position held in each slot; -1 marks an empty slot
    end:  () int32         the next slot to write; all sequences of a batch write the same slot

Writing every sequence at the shared slot `end` keeps the update a `dynamic_update_slice` at one
scalar offset, which XLA performs in place when the cache is donated (see NOTES-jax-cpu.md). Slots
come before the batch so that one layer's block of slots is one contiguous run of memory, addressed
by a single index (layer * S + slot): cached attention reads only the blocks in use. Ragged
prompts leave empty slots (pos = -1) that attention masks out; each sequence's own positions (for
RoPE / learned embeddings) live in `pos`, so a padded sequence computes exactly what it would alone.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig

KV_NAMES = ("layers", "cache_seq", "batch", "kv_heads", "head_dim")
POS_NAMES = ("batch", "cache_seq")


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # (L, S, B, K, H)
    v: jax.Array  # (L, S, B, K, H)
    pos: jax.Array  # (B, S) int32, -1 = empty
    end: jax.Array  # () int32

    @classmethod
    def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (cfg.num_layers, max_len, batch_size, cfg.kv_heads, cfg.head_size)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            pos=jnp.full((batch_size, max_len), -1, jnp.int32),
            end=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def memory_bytes(self) -> int:
        """Bytes held by the cache's arrays (keys, values and slot positions)."""
        return _nbytes(self)


def cache_memory_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> int:
    """What `KVCache.init(cfg, batch_size, max_len, dtype)` would hold, without allocating it."""
    return _nbytes(jax.eval_shape(lambda: KVCache.init(cfg, batch_size, max_len, dtype)))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
