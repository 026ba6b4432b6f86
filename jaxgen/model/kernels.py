"""Fused attention kernels for whole sequences on accelerators, behind `attention.sequence_attention`.

    splash  the Pallas splash-attention kernel shipped in jax (TPU; runs on CPU in interpret mode)
    cudnn   cuDNN's fused flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16)

and for a decode step over the serving engine's paged cache (`model.decode_impl`):

    pallas  the GPU Pallas paged-attention kernel (`jax.experimental.pallas.ops.gpu.paged_attention`),
            reading the page pool in place (runs on CPU in interpret mode)

The TPU ragged paged-attention kernel is not wired: it reads keys and values interleaved in one
(pages, Z, 2K, H) pool, where the engine keeps two, and has no interpret mode to test it here.

Both mask by index, not by position: a key is visible when it is not after the query in the row, is in
the same packed segment and (local layers) within the window. That equals the position rule of
`attention.attention_mask` when positions grow by one along each segment of a row (true of every batch
jaxgen builds: packed training windows, left- or right-padded prompts). Padding (position -1) becomes a
segment of its own, so no real token sees it.

`choose(cfg)` says which implementation runs and, when the one asked for cannot, why (logged once).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig

log = logging.getLogger(__name__)

_WIDE = np.iinfo(np.int32).max  # a global layer's "window" (see transformer.layer_constants)


def choose(cfg: ModelConfig, backend: str | None = None) -> str:
    """The implementation that runs for `cfg.attention_impl` on `backend` (default: jax's):
    dense, blockwise, cudnn or splash. A fused kernel whose constraints do not hold falls back to
    blockwise, with the reason logged once."""
    backend = backend or jax.default_backend()
    impl = cfg.attention_impl
    if impl in ("dense", "blockwise"):
        return impl
    if impl == "auto":
        impl = {"tpu": "splash", "gpu": "cudnn"}.get(backend, "blockwise")
        if impl == "blockwise":
            return impl
    reason = splash_unfit(cfg, backend) if impl == "splash" else cudnn_unfit(cfg, backend)
    if reason:
        _warn_once(f"model.attention_impl={cfg.attention_impl}: {impl} cannot run ({reason}); using blockwise")
        return "blockwise"
    return impl


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def cudnn_unfit(cfg: ModelConfig, backend: str) -> str | None:
    """Why cuDNN's fused attention cannot run this config, or None."""
    if backend not in ("gpu", "cuda"):
        return f"it needs an NVIDIA GPU, the backend is {backend}"
    if cfg.dtype not in ("bfloat16", "float16"):
        return f"it needs model.dtype bfloat16, got {cfg.dtype}"
    if cfg.head_size > 128 or cfg.head_size % 8:
        return f"it needs a head size <= 128 and a multiple of 8, got {cfg.head_size}"
    if cfg.attn_softcap is not None:
        return "it has no attention-logit soft cap"
    return None


def splash_unfit(cfg: ModelConfig, backend: str) -> str | None:
    """Why the splash kernel cannot run this config here, or None (elsewhere than a TPU it runs in
    interpret mode: exact but slow, for tests)."""
    if backend != "tpu" and cfg.attention_impl == "auto":
        return f"it is a TPU kernel, the backend is {backend}"
    return None


def _by_window(fn, window, cfg: ModelConfig):
    """fn(static window or None) for this layer: the kernels' masks are static, while the scanned
    layer's window is a traced scalar; a mixed local/global pattern runs both under `lax.cond`."""
    if cfg.sliding_window is None:
        return fn(None)
    if not any(cfg.is_global(i) for i in range(cfg.num_layers)):
        return fn(cfg.sliding_window)
    return jax.lax.cond(window < _WIDE, lambda: fn(cfg.sliding_window), lambda: fn(None))


def _segments(positions_bt, segment_ids_bt):
    """Segment ids with padding (position -1) in a segment of its own, -1."""
    seg = jnp.zeros_like(positions_bt) if segment_ids_bt is None else segment_ids_bt
    return jnp.where(positions_bt < 0, -1, seg)


def fit_length(impl: str, t: int, cfg: ModelConfig) -> str:
    """`impl` for a sequence of `t` tokens, or blockwise (said once) where the kernel cannot take that
    length: splash tiles T by blocks that are multiples of 128; cuDNN needs an even T."""
    reason = None
    block = min(cfg.attention_block, t)
    if impl == "splash" and (t % block or block % 128):
        reason = f"splash needs T a multiple of a block that is a multiple of 128; T={t}, block={block}"
    if impl == "cudnn" and t % 2:
        reason = f"cuDNN needs an even T, got {t}"
    if reason:
        _warn_once(f"{reason}; using blockwise for this length")
        return "blockwise"
    return impl


def cudnn_mask(positions_bt, segment_ids_bt):
    """(B, 1, T, T) bool: same packed segment, padding apart. cuDNN takes it as a bias; it is built once
    per forward pass and shared by every layer (2 bytes x T^2 per sequence as a bias: 134 MB at 8192),
    still no per-head (T, T) scores."""
    seg = _segments(positions_bt, segment_ids_bt)
    return (seg[:, :, None] == seg[:, None, :])[:, None]


def cudnn_attention(q_btnh, k_btkh, v_btkh, mask, window, cfg: ModelConfig):
    """cuDNN flash attention, causal by index, segments and padding as `cudnn_mask`, the window as
    cuDNN's sliding window."""
    from jaxgen.model.attention import logit_scale

    def run(w):
        return jax.nn.dot_product_attention(
            q_btnh, k_btkh, v_btkh, mask=mask, scale=logit_scale(cfg), is_causal=True,
            local_window_size=None if w is None else (w - 1, 0), implementation="cudnn",
        )  # fmt: skip

    return _by_window(run, window, cfg)


def splash_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg: ModelConfig, *, interpret=None):
    """The Pallas splash kernel (one per query-head group, multi-query form), vmapped over the batch
    and the kv heads. T must be a multiple of the block size (min(512, T), and a multiple of 128 on
    TPU). interpret: None = on any backend but TPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from jaxgen.model.attention import logit_scale

    b, t, n, h = q_btnh.shape
    k = cfg.kv_heads
    g = n // k
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    block = min(cfg.attention_block, t)
    if t % block or block % 128:
        raise ValueError(f"splash attention needs T={t} to be a multiple of a block ({block}), itself of 128")
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    seg = _segments(positions_bt, segment_ids_bt)
    q = (q_btnh.astype(jnp.float32) * logit_scale(cfg)).astype(q_btnh.dtype)
    q = q.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, H)
    k_, v_ = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)  # (B, K, T, H)

    def run(w):
        one = splash.CausalMask((t, t)) if w is None else splash.LocalMask((t, t), (w - 1, 0), offset=0)
        kernel = splash.make_splash_mqa(
            splash.MultiHeadMask([one] * g), block_sizes=sizes, attn_logits_soft_cap=cfg.attn_softcap,
            head_shards=1, q_seq_shards=1, interpret=interpret,
        )  # fmt: skip

        def one_row(q_kgth, k_kth, v_kth, seg_t):
            ids = splash.SegmentIds(q=seg_t, kv=seg_t)
            return jax.vmap(lambda qg, kk, vv: kernel(qg, kk, vv, segment_ids=ids))(q_kgth, k_kth, v_kth)

        return jax.vmap(one_row)(q, k_, v_, seg)  # (B, K, G, T, H)

    out = _by_window(run, window, cfg)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def decode_kernel(cfg: ModelConfig, cache, num_queries: int, backend: str | None = None) -> bool:
    """Whether this cached attention call runs the GPU Pallas paged kernel: a decode step (one query per
    slot) over a `PagedCache`, with `model.decode_impl` pallas, or auto on a GPU; no sliding window."""
    from jaxgen.model.paged import PagedCache

    if not isinstance(cache, PagedCache) or num_queries != 1 or cfg.decode_impl == "xla":
        return False
    reason = paged_unfit(cfg, backend or jax.default_backend(), cache.page_size)
    if reason is None and cache.k_scale is not None:
        reason = "it reads no int8 pages (serve.cache_dtype=int8)"
    if reason and cfg.decode_impl == "pallas":
        _warn_once(f"model.decode_impl=pallas: the paged kernel cannot run ({reason}); using the XLA loop")
    return reason is None


def paged_unfit(cfg: ModelConfig, backend: str, page_size: int) -> str | None:
    """Why the GPU paged kernel cannot run decode for `cfg`, or None (off a GPU, decode_impl=pallas runs
    it in interpret mode: exact but slow, for tests). Triton loads power-of-two tiles only, and its dot
    products need at least 16 rows."""
    if cfg.decode_impl == "auto" and backend not in ("gpu", "cuda"):
        return f"it is a GPU kernel, the backend is {backend}"
    if cfg.sliding_window is not None:
        return "it has no sliding window"
    if cfg.head_size & (cfg.head_size - 1) or page_size & (page_size - 1) or page_size < 16:
        return f"it needs a power-of-two head size and page size >= 16, got {cfg.head_size} and {page_size}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:  # no partitioning rule: GSPMD would gather the whole pool
        return "it does not run on a mesh of several devices"
    return None


def paged_decode_attention(q_btnh, cache, kv, layer, q_pos_bt, cfg: ModelConfig, *, interpret=None):
    """Attention of one query per slot (B, 1, N, H) over its pages, by the GPU Pallas kernel. The pool
    (K, L, Q, Z, H) is read as (K, L * Q, Z, H), layer l's page p being row l * Q + p: a free reshape,
    no copy. A slot sees its keys up to its own position; an idle slot (position -1) gets zeros."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    from jaxgen.model.attention import logit_scale
    from jaxgen.model.kvcache import from_storage

    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda")
    k_all, v_all, *_ = kv  # float pages only (int8 pools take the XLA loop)
    kh, num_layers, num_pages, z, h = k_all.shape
    k_pool = from_storage(k_all).reshape(kh, num_layers * num_pages, z, h)
    v_pool = from_storage(v_all).reshape(kh, num_layers * num_pages, z, h)
    tables = cache.page_table + layer * num_pages  # (B, M)
    m = tables.shape[1]
    splits = next(s for s in (16, 8, 4, 2, 1) if m % s == 0)  # the kernel's k_splits must divide M
    per_block = next(c for c in (8, 4, 2, 1) if (m // splits) % c == 0)  # pages per tile, a power of two
    pos = q_pos_bt[:, 0]
    q = (q_btnh[:, 0].astype(jnp.float32) * logit_scale(cfg)).astype(k_pool.dtype)  # the kernel does not scale
    out = gpu_paged.paged_attention(
        q, k_pool, v_pool, tables, jnp.maximum(pos + 1, 0).astype(jnp.int32), block_h=16,
        pages_per_compute_block=per_block, k_splits=splits, interpret=interpret,
        attn_logits_soft_cap=cfg.attn_softcap,
    )  # fmt: skip
    out = jnp.where((pos >= 0)[:, None, None], out, 0.0)  # an idle slot saw no key
    return out[:, None].astype(q_btnh.dtype)
