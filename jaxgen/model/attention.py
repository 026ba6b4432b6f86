"""Attention: one mask rule, a dense path for whole sequences, and one blockwise path over any cache.

The seam. A cache (`jaxgen.model.cache.Cache`: contiguous `KVCache`, paged `PagedCache`) says only how
its keys live: `write` stores a call's keys, `key_block` hands block j of a layer with its positions,
`blocks_to_visit` says how many blocks any query can see. `cached_attention` runs the one online-softmax
step over those blocks with the one mask rule, so the model never asks which cache it holds. A cache
whose blocks are buffers of their own (`num_blocks` an int) is read by a Python loop of `lax.cond`s with
static j, so each product reads its block in place (a lone block, the contiguous cache's flat layout on
accelerators: one masked pass, no cond, no loop); one whose blocks are gathered (None) by a
`fori_loop` over a traced j. A decode step over a cache that names a fused decode kernel may run that
kernel instead (`kernels.decode_kernel`); on CPU a decode step's products run as `kernels.cpu` says.

Whole sequences (training, scoring: `cache=None`) go through `sequence_attention`, one of
`model.attention_impl`: blockwise (jaxgen.model.blockwise, the portable default), cuDNN or splash
(jaxgen.model.kernels), ring or allgather (jaxgen.model.context: tokens split over the mesh's context
axis), or `dense_attention`, the reference. Each has the same arguments and the same
mask rule; a new kernel plugs in here, not in the model.

The mask rule (`attention_mask`) is by position: a query at position p sees the keys at positions
0..p of its own row (and, with a sliding window w, only those after p - w), never a key at position -1
(padding, an empty slot) and never one of another packed document (segment ids). Within a row,
positions grow with the order tokens were written, so this is causal attention.

Deterministic mode (`model.deterministic`): both paths run `tiled_attention`, one fold over key blocks
aligned to positions, per tile of queries, so a query's numbers are the same in training and decoding.

`kv` is the cache's (keys, values) pair threaded through the layer loop's carry: as a loop-invariant
operand XLA would copy the whole cache every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgen.model import blockwise, context, kernels, layers
from jaxgen.model.kernels import cpu
from jaxgen.model.storage import from_storage
from jaxgen.sharding import constrain, context_size

NEG_INF = jnp.finfo(jnp.float32).min  # finite, so a fully masked row (padding) gives no NaN
SPLIT_QUERIES_FROM = 64  # queries per device from which a call over a context-split cache splits its queries


def attention_mask(q_pos_bt, k_pos_bs, q_seg_bt=None, k_seg_bs=None, window: int | None = None):
    """Boolean (B, T, S): may the query at position q_pos attend to the key at position k_pos?"""
    q, k = q_pos_bt[:, :, None], k_pos_bs[:, None, :]
    mask = (k >= 0) & (k <= q)  # window may be a traced per-layer scalar (see transformer.layer_constants)
    if q_seg_bt is not None:
        mask = mask & (q_seg_bt[:, :, None] == k_seg_bs[:, None, :])
    if window is not None:
        mask = mask & (q - k < window)
    return mask


def logit_scale(cfg) -> float:
    """What q . k is multiplied by: 1 / sqrt(head_dim), or 1 / sqrt(query_scale) (Gemma 2/3)."""
    return (cfg.query_scale or cfg.head_size) ** -0.5


def dense_attention(q_btnh, k_bskh, v_bskh, mask_bts, cfg):
    """Grouped-query attention over the whole (T, S) score matrix: N query heads share K kv heads
    (G = N / K per group). The reference (`model.attention_impl=dense`): simple, and its backward
    keeps the (B, K, G, T, S) probabilities, which is what the other implementations avoid."""
    b, t, n, h = q_btnh.shape
    q = q_btnh.reshape(b, t, cfg.kv_heads, n // cfg.kv_heads, h)  # (B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=jnp.float32)
    logits = layers.softcap(logits * logit_scale(cfg), cfg.attn_softcap)
    logits = jnp.where(mask_bts[:, None, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out.reshape(b, t, n, h)


def sequence_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg, impl: str):
    """Attention of a whole sequence over itself (training, scoring) by `impl` (see
    `kernels.choose`): blockwise, cudnn or splash; each equals `dense_attention` under
    `attention_mask(positions, positions, segment_ids, segment_ids, window)`. (B, T, N, H).
    Deterministic mode (`model.deterministic`): `tiled_attention` whatever `impl` says."""
    if cfg.deterministic:
        return _tiled_sequence(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg)
    if impl == "cudnn":
        mask = kernels.cudnn_mask(positions_bt, segment_ids_bt)
        return kernels.cudnn_attention(q_btnh, k_btkh, v_btkh, mask, window, cfg, scale=logit_scale(cfg))
    if impl in ("ring", "allgather"):  # tokens split over the mesh's context axis (jaxgen.model.context)
        return context.context_attention(
            q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg, impl, scale=logit_scale(cfg)
        )
    if impl == "splash":
        return kernels.splash_attention(
            q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg, scale=logit_scale(cfg)
        )
    return blockwise.blockwise_attention(
        q_btnh, k_btkh, v_btkh, positions_bt, positions_bt, scale=logit_scale(cfg), softcap=cfg.attn_softcap,
        q_seg_bt=segment_ids_bt, k_seg_bs=segment_ids_bt, window=window,
        block_q=cfg.attention_block, block_k=cfg.attention_block,
    )  # fmt: skip


def check_prompt(cache, segment_ids_bt, t: int, cfg) -> None:
    """Raises ValueError, before anything compiles, unless a whole prompt's prefill (`forward(...,
    fresh=True)`) of T = `t` tokens (padding included) can run: a cache to fill, one sequence per row, and
    on a context mesh a T the context axis splits into zig-zag halves of whole blocks."""
    if cache is None:
        raise ValueError("fresh=True: a whole prompt's prefill needs the cache it fills, got cache=None")
    if segment_ids_bt is not None:
        raise ValueError("fresh=True: a cache holds one sequence per row, got segment_ids (packed documents)")
    impl = kernels.fit_length(kernels.choose(cfg), t, cfg)
    if impl in ("ring", "allgather"):
        context.check_fit(impl, t, context_size(), cfg.attention_block, what="prompt length (padded)")


def store_prompt(cache, kv, layer, k_btkh, v_btkh, positions_bt):
    """kv with a whole prompt's keys and values (B, T, K, H) of `layer` written by `cache.write`.

    On a context mesh the prompt's tokens are split over `context` in order (device r: tokens [r T / C,
    (r + 1) T / C)), while the caches split every block's slots (every page's offsets) over it, the layout
    decode reads: the keys, values and positions are gathered once here, one (B, T, K, H) all-gather each
    per layer, after attention ran on the split tokens, and each device keeps the slots it holds
    (`cache.write`). (Without a context axis the constraints change nothing.)"""
    gathered = ("batch", None, "kv_heads", "head_dim")
    k, v = constrain(k_btkh, gathered), constrain(v_btkh, gathered)
    return cache.write(kv, layer, k, v, constrain(positions_bt, ("batch", None)))


def cached_attention(q_btnh, cache, kv, layer, q_pos_bt, window, cfg):
    """Attention of the queries (B, T, N, H) at positions q_pos_bt over `cache`'s keys of `layer`, one
    block at a time with an online softmax: only `cache.blocks_to_visit` blocks are read, so a step
    costs what the filled part of the cache costs, not its allocated length. `window`: this layer's
    sliding window (an int, a traced scalar, or None). Returns (B, T, N, H) and `kv` (this call's keys
    already written by `cache.write`).

    A cache whose blocks' slots are split over the mesh's context axis (`context_split` = C > 1: both
    caches on a context mesh) is read, for a call of fewer than C x
    SPLIT_QUERIES_FROM queries (decode steps, speculative calls), by every device over its own slots with
    all the queries, the partial softmaxes combined once (`context.split_cached_attention`); a longer call
    (a prompt's chunk) keeps its queries split over context as its activations are, and GSPMD gathers each
    block it reads (measured at T=4096, C=4: 257 MiB of temporaries per device the first way, where XLA
    kept every block's (T, Sb / C) scores alive, against 8.1 MiB the second)."""
    if cfg.deterministic:  # the fold training runs too, tile by tile (see tiled_attention)
        return _tiled_cached(q_btnh, cache, kv, layer, q_pos_bt, window, cfg), kv
    b, t, n, h = q_btnh.shape
    k = cfg.kv_heads
    q = q_btnh.reshape(b, t, k, n // k, h).astype(jnp.float32) * logit_scale(cfg)
    split = cache.context_split
    if split > 1 and t < split * SPLIT_QUERIES_FROM:  # few queries (decode): each device its keys
        fold = functools.partial(_fold_cache, window=window, cfg=cfg)
        _, l, acc = context.split_cached_attention(fold, q, cache, kv, layer, q_pos_bt)
        return _normalise(l, acc, q_btnh), kv
    kernel = kernels.decode_kernel(cfg, cache, t)
    if kernel:  # a decode step the cache's fused kernel reads in place (pages: the GPU Pallas kernel)
        inputs = cache.decode_inputs(kv, layer)
        scale, softcap = logit_scale(cfg), cfg.attn_softcap
        return kernels.decode_attention(kernel, q_btnh, inputs, q_pos_bt, scale=scale, softcap=softcap), kv
    (_, l, acc), kv = _fold_cache(q, cache, kv, layer, q_pos_bt, window=window, cfg=cfg)
    return _normalise(l, acc, q_btnh), kv


def _normalise(l, acc, q_btnh):
    """(B, T, N, H) from the normaliser (B, K, G, T) and weighted sum (B, K, G, T, H)."""
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no key at all (padding) give 0
    return out.transpose(0, 3, 1, 2, 4).reshape(q_btnh.shape).astype(q_btnh.dtype)


def _fold_cache(q, cache, kv, layer, q_pos_bt, *, window, cfg):
    """The online softmax's (running max, normaliser, weighted sum), (B, K, G, T[, H]) float32, of the
    scaled queries q (B, T, K, G, H) over the blocks of `cache` in use; and kv (a traced-block loop
    carries it)."""
    b, t, k, g, h = q.shape

    def fold_block(stats, k_bkhs, v_bksh, k_pos_bs):
        mask = attention_mask(q_pos_bt, k_pos_bs, window=window)
        return _online_softmax_step(stats, q, k_bkhs, v_bksh, mask, cfg.attn_softcap)

    def fold(j, stats, kv):
        block = cache.key_block(kv, layer, j)
        if cache.num_blocks == 1:  # a lone block (the flat layout, `kernels.cache_layout`): one masked pass
            return fold_block(stats, *block)
        filled = cache.filled(q_pos_bt) - j * block[0].shape[-1]  # from the block's first slot
        return cpu.fold_parts(fold_block, stats, block, filled)

    stats = (
        jnp.full((b, k, g, t), NEG_INF, jnp.float32),  # running max
        jnp.zeros((b, k, g, t), jnp.float32),  # running normaliser
        jnp.zeros((b, k, g, t, h), jnp.float32),  # running weighted sum of values
    )
    if cache.num_blocks is None:  # gathered blocks (pages): the cache's own loop, kv in its carry
        return cache.fold(fold_block, stats, kv, layer, q_pos_bt)
    visit = cache.blocks_to_visit(q_pos_bt)
    for j in range(cache.num_blocks):  # blocks_to_visit >= 1: block 0 needs no cond
        fold_j = functools.partial(fold, j, kv=kv)
        stats = fold_j(stats) if j == 0 else jax.lax.cond(j < visit, fold_j, _same, stats)
    return stats, kv


def _same(stats):
    return stats


def _online_softmax_step(carry, q_btkgh, k_bkhs, v_bksh, mask_bts, softcap):
    """One block of keys folded into the running max m, normaliser l and weighted sum acc. Batch and kv
    heads lead, the batch dimensions of both products, and keys come (H, S), values (S, H): each
    operand already in its product's (contracted, columns) order (see `kvcache` for why)."""
    m, l, acc = carry  # (B, K, G, T), (B, K, G, T), (B, K, G, T, H)
    mask = mask_bts[:, None, None]
    k_bkhs, v_bksh = from_storage(k_bkhs).astype(jnp.float32), from_storage(v_bksh).astype(jnp.float32)
    as_sums = cpu.products_as_sums(q_btkgh)  # CPU decode steps (see kernels.cpu)
    s = cpu.scores_as_sums(q_btkgh, k_bkhs) if as_sums else jnp.einsum("btkgh,bkhs->bkgts", q_btkgh, k_bkhs)
    s = layers.softcap(s, softcap)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = cpu.values_as_sums(p, v_bksh) if as_sums else jnp.einsum("bkgts,bksh->bkgth", p, v_bksh)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


# --- deterministic mode (model.deterministic) ------------------------------------------------------


def tiled_attention(q_btnh, key_block, num_blocks, q_pos_bt, window, cfg):
    """Attention computed for each query by the same float operations wherever it runs: training's
    forward, a prefill chunk of any length, a decode step, any batch. (B, T, N, H) -> (B, T, N, H).

    The key blocks j = 0 .. num_blocks - 1 of `model.attention_block` keys, aligned to positions (block j:
    positions [j block, (j + 1) block)), are folded in order by the online softmax of `_tile_step`; for
    each block, the queries (every row's, flattened) go by tiles of `layers.TILE` (`layers.map_tiles`, as
    `layers.per_tile` cuts them), each tile its rows' keys. Blocks past every query, and for a tile those
    past its furthest query, are skipped (`lax.cond`). A block no query of a tile may see leaves its (max,
    normaliser, sum) bitwise as they were (scores at NEG_INF: the max stays, exp(0) = 1 scales, zeros add),
    so how many blocks a tile folds (what else shares it) changes nothing. `key_block(j)`: block j of
    every row: keys (B, K, H, block), values (B, K, block, H), positions (B, block); `num_blocks`: an int
    or a traced () int32."""
    b, t, n, h = q_btnh.shape
    k, g, tile, block = cfg.kv_heads, n // cfg.kv_heads, layers.TILE, cfg.attention_block
    tiles = layers.num_tiles(b * t)  # as layers.per_tile cuts them
    pad = tiles * tile - b * t
    q = q_btnh.reshape(b * t, k, g, h).astype(jnp.float32) * logit_scale(cfg)
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(tiles, tile, k, g, h)
    pos = jnp.pad(q_pos_bt.reshape(-1), (0, pad), constant_values=-1).reshape(tiles, tile)  # padding: sees nothing
    rows = jnp.pad(jnp.repeat(jnp.arange(b, dtype=jnp.int32), t), (0, pad)).reshape(tiles, tile)
    barrier = jax.lax.optimization_barrier  # each tile's math apart from what gathers its keys

    def fold_block(j, stats):
        keys, values, k_pos = key_block(j)

        def one_tile(xs):
            q_t, pos_t, rows_t, stats_t = barrier(xs)

            def fold(stats_t):
                k_t, v_t, kp_t = barrier((keys[rows_t], values[rows_t], k_pos[rows_t]))
                mask = attention_mask(pos_t[:, None], kp_t, window=window)[:, 0]  # (R, block)
                return _tile_step(stats_t, q_t, k_t, v_t, mask, cfg.attn_softcap)

            return barrier(jax.lax.cond(j <= jnp.max(pos_t) // block, fold, _same, stats_t))

        return layers.map_tiles(one_tile, (q, pos, rows, stats))

    stats = (
        jnp.full((tiles, tile, k, g), NEG_INF, jnp.float32),  # running max
        jnp.zeros((tiles, tile, k, g), jnp.float32),  # running normaliser
        jnp.zeros((tiles, tile, k, g, h), jnp.float32),  # running weighted sum of values
    )
    furthest = jnp.max(q_pos_bt) // block
    step = lambda j, stats: jax.lax.cond(j <= furthest, functools.partial(fold_block, j), _same, stats)
    _, l, acc = jax.lax.fori_loop(0, num_blocks, step, stats)  # (never differentiated: see _tiled_sequence)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no key at all (padding) give 0
    return out.reshape(tiles * tile, n, h)[: b * t].reshape(b, t, n, h).astype(q_btnh.dtype)


def _tile_step(carry, q_rkgh, k_rkhs, v_rksh, mask_rs, softcap):
    """`_online_softmax_step` for a tile of R queries, each with its own block of keys: products batched
    over (query, kv head), so a query's numbers do not depend on the others'."""
    m, l, acc = carry  # (R, K, G), (R, K, G), (R, K, G, H)
    mask = mask_rs[:, None, None]
    k_rkhs, v_rksh = from_storage(k_rkhs).astype(jnp.float32), from_storage(v_rksh).astype(jnp.float32)
    s = layers.softcap(jnp.einsum("rkgh,rkhs->rkgs", q_rkgh, k_rkhs), softcap)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("rkgs,rksh->rkgh", p, v_rksh)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def _tiled_sequence(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg):
    """`tiled_attention` of whole sequences over themselves (training, scoring): key block j is columns
    [j block, (j + 1) block) of each row, the engine's page blocks when a row's positions are 0, 1, ...
    (its columns; padding at the end). Other positions give correct attention, not the engine's bits. The
    gradient is blockwise attention's (`layers.tiled_values`)."""
    if segment_ids_bt is not None:
        raise ValueError("model.deterministic: packed documents (segment_ids) are not supported")
    block, s = cfg.attention_block, k_btkh.shape[1]
    pad = -s % block

    def tiled(q_btnh, k_btkh, v_btkh, positions_bt, window):
        k = jnp.pad(k_btkh, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v_btkh, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_pos = jnp.pad(positions_bt, ((0, 0), (0, pad)), constant_values=-1)

        def key_block(j):
            cols = lambda x: jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=1)
            return cols(k).transpose(0, 2, 3, 1), cols(v).transpose(0, 2, 1, 3), cols(k_pos)

        return tiled_attention(q_btnh, key_block, (s + pad) // block, positions_bt, window, cfg)

    def plain(q_btnh, k_btkh, v_btkh, positions_bt, window):  # the gradient (see layers.tiled_values)
        return blockwise.blockwise_attention(
            q_btnh, k_btkh, v_btkh, positions_bt, positions_bt, scale=logit_scale(cfg), softcap=cfg.attn_softcap,
            window=window, block_q=block, block_k=block,
        )  # fmt: skip

    window = None if window is None else jnp.asarray(window, jnp.int32)
    return layers.tiled_values(tiled, plain)(q_btnh, k_btkh, v_btkh, positions_bt, window)


def _tiled_cached(q_btnh, cache, kv, layer, q_pos_bt, window, cfg):
    """`tiled_attention` over a cache whose blocks are gathered by a traced index and hold positions
    [j Sb, (j + 1) Sb) (the engine's paged cache: a block is a page): key block j is part j % (Sb / block)
    of cache block j // (Sb / block); Sb must be a multiple of attention_block (the engine checks first)."""
    if cache.num_blocks is not None or cache.context_split > 1:
        raise ValueError("model.deterministic: cached attention over the engine's paged cache only (one device)")
    block = cfg.attention_block
    size = cache.key_block(kv, layer, 0)[2].shape[-1]  # Sb (traced once more; XLA drops the unused gather)
    if size % block:
        raise ValueError(f"model.deterministic: page_size={size} must be a multiple of model.attention_block={block}")
    parts = size // block

    def key_block(j):
        keys, values, k_pos = cache.key_block(kv, layer, j // parts)  # (B, K, H, Sb), (B, K, Sb, H), (B, Sb)
        part = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, (j % parts) * block, block, axis)
        return part(keys, 3), part(values, 2), part(k_pos, 1)

    visit = cache.blocks_to_visit(q_pos_bt) * parts  # traced: a while loop (nothing differentiates a cache)
    return tiled_attention(q_btnh, key_block, visit, q_pos_bt, window, cfg)
