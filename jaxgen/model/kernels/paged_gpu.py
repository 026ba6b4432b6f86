"""The GPU Pallas paged-attention kernel (`jax.experimental.pallas.ops.gpu.paged_attention`) for a decode
step over the serving engine's page pool, read in place (off a GPU it runs in interpret mode: exact but
slow, for tests).

On a TPU the TPU's own kernel runs instead (`paged_tpu`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig


class Pages(NamedTuple):
    """What the kernel reads of one layer, as a paged cache hands it (`Cache.decode_inputs`): float
    views of its pools, no copy."""

    k: jax.Array  # (K, P, Z, H): every page of the pool, layer l's page p at row l * Q + p
    v: jax.Array  # (K, P, Z, H)
    tables: jax.Array  # (B, M) int32: each slot's pages of this layer, rows of k and v


def unfit(cfg: ModelConfig, backend: str, page_size: int, quantized: bool = False, bfloat16: bool = False):
    """Why the kernel cannot run decode for `cfg` over pages of `page_size` (int8 if `quantized`; float32
    or bfloat16 it reads alike), or None (off a GPU, decode_impl=pallas runs it in interpret mode). Triton
    loads power-of-two tiles only, and its dot products need at least 16 rows."""
    if cfg.decode_impl == "auto" and backend not in ("gpu", "cuda"):
        return f"it is a GPU kernel, the backend is {backend}"
    if cfg.sliding_window is not None:
        return "it has no sliding window"
    if cfg.head_size & (cfg.head_size - 1) or page_size & (page_size - 1) or page_size < 16:
        return f"it needs a power-of-two head size and page size >= 16, got {cfg.head_size} and {page_size}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:  # no partitioning rule: GSPMD would gather the whole pool
        return "it does not run on a mesh of several devices"
    if quantized:
        return "it reads no int8 pages (serve.cache_dtype=int8)"
    return None


def attention(q_btnh, pages: Pages, q_pos_bt, *, scale: float, softcap: float | None, interpret=None):
    """Attention of one query per slot (B, 1, N, H) over its pages: (B, 1, N, H). A slot sees its keys up
    to its own position; an idle slot (position -1) gets zeros. `scale` multiplies q . k."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda")
    m = pages.tables.shape[1]
    splits = next(s for s in (16, 8, 4, 2, 1) if m % s == 0)  # the kernel's k_splits must divide M
    per_block = next(c for c in (8, 4, 2, 1) if (m // splits) % c == 0)  # pages per tile, a power of two
    pos = q_pos_bt[:, 0]
    q = (q_btnh[:, 0].astype(jnp.float32) * scale).astype(pages.k.dtype)  # the kernel does not scale
    out = gpu_paged.paged_attention(
        q, pages.k, pages.v, pages.tables, jnp.maximum(pos + 1, 0).astype(jnp.int32), block_h=16,
        pages_per_compute_block=per_block, k_splits=splits, interpret=interpret, attn_logits_soft_cap=softcap,
    )  # fmt: skip
    out = jnp.where((pos >= 0)[:, None, None], out, 0.0)  # an idle slot saw no key
    return out[:, None].astype(q_btnh.dtype)
