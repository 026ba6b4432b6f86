"""The TPU Pallas paged-attention kernel (`jax.experimental.pallas.ops.tpu.paged_attention`) for a decode
step over the serving engine's page pool, read in place. `kernels.paged_kernel` picks it on a TPU only; called
elsewhere (the tests) it runs in Pallas's TPU interpret mode: exact but slow.

Why this kernel and not the ragged paged-attention one jax also ships: it reads keys and values as two
(K, P, Z, H) pools, the engine's own layout (which the GPU kernel reads too), where the ragged kernel wants
them interleaved in one (pages, Z, 2K, H) pool; a prefill chunk keeps attention's XLA loop. It rounds keys
and values to bfloat16 as it loads them, so it takes bfloat16 pools only (`serve.cache_dtype=bfloat16`, what
serving on a TPU holds); over such a pool it equals the XLA loop to float32 rounding.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgen.config import ModelConfig
from jaxgen.model.kernels.paged_gpu import Pages
from jaxgen.sharding import logical_spec, per_device


def unfit(cfg: ModelConfig, backend: str, page_size: int, quantized: bool = False, bfloat16: bool = False):
    """Why the kernel cannot run decode for `cfg` over pages of `page_size` (int8 if `quantized`, bfloat16
    if `bfloat16`) on `backend`, or None (`kernels.paged_kernel` names it on a TPU only)."""
    if cfg.decode_impl == "auto" and backend != "tpu":
        return f"it is a TPU kernel, the backend is {backend}"
    if cfg.sliding_window is not None:
        return "it has no sliding window"
    if quantized or not bfloat16:
        return "it reads keys and values as bfloat16: the pool must be bfloat16 (serve.cache_dtype=bfloat16)"
    if page_size % 8:
        return f"it needs pages of a multiple of 8 tokens, got {page_size}"
    if backend == "tpu" and cfg.head_size % 128:  # Mosaic's blocks: the last dimension a multiple of 128
        return f"Mosaic lowers it for a head size that is a multiple of 128, got {cfg.head_size}"
    return None


def attention(q_btnh, pages: Pages, q_pos_bt, *, scale: float, softcap: float | None):
    """Attention of one query per slot (B, 1, N, H) over its pages: (B, 1, N, H). A slot sees its keys up
    to its own position; an idle slot (position -1) gets zeros. `scale` multiplies q . k. Under a mesh each
    device runs the kernel on its slots (the batch axes) and kv heads (the tensor axis, where it divides them)
    inside `shard_map`: the compiler does not partition a Mosaic kernel."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    b, _, n, h = q_btnh.shape
    k, m = pages.k.shape[0], pages.tables.shape[1]
    per_block = next(c for c in (8, 4, 2, 1) if m % c == 0)  # pages a step of the kernel loads
    pos = q_pos_bt[:, 0]
    q = q_btnh[:, 0].astype(jnp.float32).reshape(b, k, n // k, h) * scale  # the kernel does not scale

    def local(q_bkgh, k_pool, v_pool, lengths, tables):
        rows, heads, g, _ = q_bkgh.shape
        out = paged_attention(q_bkgh.reshape(rows, heads * g, h), k_pool, v_pool, lengths, tables,
                              attn_logits_soft_cap=softcap, pages_per_compute_block=per_block)  # fmt: skip
        return out.reshape(rows, heads, g, h)

    lengths = jnp.maximum(pos + 1, 0).astype(jnp.int32)
    interpret = pltpu.force_tpu_interpret_mode() if jax.default_backend() != "tpu" else contextlib.nullcontext()
    with interpret:  # (the kernel's pallas_call is traced in here: the mode applies to it)
        out = _per_device(local, q, pages.k, pages.v, lengths, pages.tables)
    out = jnp.where((pos >= 0)[:, None, None, None], out, 0.0).reshape(b, n, h)  # an idle slot saw no key
    return out[:, None].astype(q_btnh.dtype)


def _per_device(local, q_bkgh, k_pool, v_pool, lengths_b, tables_bm):
    """`local` on each device's slots and kv heads under the current mesh (`sharding.per_device`)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = logical_spec(("batch",), q_bkgh.shape[:1], mesh)[0]
    heads = logical_spec(("kv_heads",), k_pool.shape[:1], mesh)[0]  # as the pool is split (else every head each)
    q_spec, pool_spec = P(batch, heads, None, None), P(heads, None, None, None)
    in_specs = (q_spec, pool_spec, pool_spec, P(batch), P(batch, None))
    return per_device(local, in_specs, q_spec, q_bkgh, k_pool, v_pool, lengths_b, tables_bm)
