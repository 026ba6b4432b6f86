"""Blockwise (flash-style) attention for whole sequences: no (T, S) score matrix is ever stored.

The queries are cut into blocks of `block_q` rows and the keys into blocks of `block_k`; each query
block runs an online softmax over the key blocks (as `attention.cached_attention` does over a cache),
and a key block that no query of the block may see (causal future, outside a sliding window, another
packed document, padding) is skipped by `lax.cond` without computing it. The forward pass keeps only
the output and the log-sum-exp per query (B, T, N) for the backward pass, which recomputes each block's
scores: a custom VJP (the FlashAttention-2 backward), so memory is O(T x block), not O(T x S).

The mask is `attention.attention_mask`'s rule by position: a key at position -1 is padding, a query at
-1 gets a zero output and no gradient. Shapes use the glossary in `jaxgen.sharding`; bq, bk are the
block sizes and I, J the numbers of query and key blocks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = jnp.finfo(jnp.float32).min
_NO_WINDOW = jnp.iinfo(jnp.int32).max


class _Static(NamedTuple):
    scale: float  # what q . k is multiplied by
    softcap: float | None  # cap * tanh(x / cap) on the scaled logits (Gemma 2)
    block_q: int
    block_k: int


def blockwise_attention(
    q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *, scale, softcap=None, q_seg_bt=None, k_seg_bs=None,
    window=None, block_q: int = 512, block_k: int = 512,
):  # fmt: skip
    """Grouped-query attention (N query heads over K kv heads) with the mask by position, equal to
    `attention.dense_attention` with `attention_mask(q_pos, k_pos, q_seg, k_seg, window)`.

    q (B, T, N, H), k and v (B, S, K, H); positions (B, T) / (B, S) int32, -1 = padding; segments
    (B, T) / (B, S) or None; window: None, an int or a traced int32 scalar. Returns (B, T, N, H) in q's
    dtype. Blocks larger than the sequence shrink to it; T and S are padded up to whole blocks."""
    b, t, n, h = q_btnh.shape
    s, kv_heads = k_bskh.shape[1], k_bskh.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    if q_seg_bt is None:
        q_seg_bt, k_seg_bs = jnp.zeros_like(q_pos_bt), jnp.zeros_like(k_pos_bs)
    window = jnp.asarray(_NO_WINDOW if window is None else window, jnp.int32)
    q = _pad(q_btnh.reshape(b, t, kv_heads, n // kv_heads, h), bq, 0)
    k, v = _pad(k_bskh, bk, 0), _pad(v_bskh, bk, 0)
    q_pos, q_seg = _pad(q_pos_bt, bq, -1), _pad(q_seg_bt, bq, 0)
    k_pos, k_seg = _pad(k_pos_bs, bk, -1), _pad(k_seg_bs, bk, 0)
    static = _Static(float(scale), softcap, bq, bk)
    out = _attention(static, q, k, v, q_pos, k_pos, q_seg, k_seg, window)  # (B, T', K, G, H)
    return out[:, :t].reshape(b, t, n, h)


def _pad(x, block: int, value):
    """x with its axis 1 padded up to a multiple of `block`."""
    extra = -x.shape[1] % block
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, block: int):
    """(B, T, ...) -> (T / block, B, block, ...): block i is x_blocks[i]."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def _unblock(x):
    """The inverse of `_blocks`."""
    i, b, block = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, i * block, *x.shape[3:])


def _mask(q_pos, k_pos, q_seg, k_seg, window):
    """(B, bq, bk): the rule of `attention.attention_mask` for one pair of blocks."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    return (kp >= 0) & (kp <= qp) & (q_seg[:, :, None] == k_seg[:, None, :]) & (qp - kp < window)


def _scores(static: _Static, q_bqkgh, k_bskh):
    """Scaled, capped logits (B, K, G, bq, bk) float32 of one pair of blocks."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_bqkgh, k_bskh, preferred_element_type=jnp.float32) * static.scale
    return s if static.softcap is None else static.softcap * jnp.tanh(s / static.softcap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, q_pos, k_pos, q_seg, k_seg, window):
    return _forward(static, q, k, v, q_pos, k_pos, q_seg, k_seg, window)[0]


def _forward(static: _Static, q, k, v, q_pos, k_pos, q_seg, k_seg, window):
    """Output (B, T, K, G, H) and log-sum-exp (B, K, G, T) float32 (0 for a query that sees nothing).

    The loops are `while_loop`s on purpose: inside a differentiated layer scan, JAX partially evaluates
    this forward and would move the parts that depend only on positions (the masks, broadcast to the
    score shape) into a loop of their own, stacking them for every (query block, key block) pair: the
    whole (T, S) matrix again. A while loop cannot be split that way."""
    kb, vb = _blocks(k, static.block_k), _blocks(v, static.block_k)
    kpb, ksb = _blocks(k_pos, static.block_k), _blocks(k_seg, static.block_k)
    qb, qpb, qsb = _blocks(q, static.block_q), _blocks(q_pos, static.block_q), _blocks(q_seg, static.block_q)
    num_q, b, bq, kh, g, h = qb.shape

    def query_block(i, outs):
        out_all, lse_all = outs
        qi, qpi, qsi = qb[i], qpb[i], qsb[i]  # (B, bq, K, G, H), (B, bq), (B, bq)

        def key_block(j, carry):
            mask = _mask(qpi, kpb[j], qsi, ksb[j], window)

            def fold(carry):
                m, l, acc = carry
                s = jnp.where(mask[:, None, None], _scores(static, qi, kb[j]), NEG_INF)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            return jax.lax.cond(mask.any(), fold, lambda c: c, carry)

        init = (
            jnp.full((b, kh, g, bq), NEG_INF, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, h), jnp.float32),
        )
        m, l, acc = _while_range(kb.shape[0], key_block, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        out_all = out_all.at[i].set(out.transpose(0, 3, 1, 2, 4).astype(q.dtype))
        return out_all, lse_all.at[i].set(lse)

    outs = (jnp.zeros(qb.shape, q.dtype), jnp.zeros((num_q, b, kh, g, bq), jnp.float32))
    out, lse = _while_range(num_q, query_block, outs)  # (I, B, bq, K, G, H), (I, B, K, G, bq)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, -1)  # (B, K, G, T)
    return _unblock(out), lse


def _while_range(n: int, body, init):
    """body(i, carry) for i in range(n) as a `while_loop` (see `_forward` for why not a scan)."""

    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < n, step, (jnp.int32(0), init))[1]


def _attention_fwd(static, q, k, v, q_pos, k_pos, q_seg, k_seg, window):
    out, lse = _forward(static, q, k, v, q_pos, k_pos, q_seg, k_seg, window)
    return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, window, out, lse)


def _attention_bwd(static: _Static, res, d_out):
    """Recomputes each visited block's probabilities from the saved log-sum-exp: one scan over key
    blocks (producing dk, dv of the block), an inner loop over query blocks adding into dq."""
    q, k, v, q_pos, k_pos, q_seg, k_seg, window, out, lse = res
    bq = static.block_q
    # delta = rowsum(dO * O): the softmax's correction term, (B, K, G, T)
    delta = jnp.einsum("btkgh,btkgh->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qb, dob = _blocks(q, bq), _blocks(d_out, bq)
    qpb, qsb = _blocks(q_pos, bq), _blocks(q_seg, bq)
    lseb = jnp.moveaxis(lse.reshape(*lse.shape[:3], -1, bq), 3, 0)  # (I, B, K, G, bq)
    deltab = jnp.moveaxis(delta.reshape(*delta.shape[:3], -1, bq), 3, 0)

    def key_block(dq, xs):
        kj, vj, kpj, ksj = xs  # (B, bk, K, H), (B, bk, K, H), (B, bk), (B, bk)

        def query_block(i, carry):
            mask = _mask(qpb[i], kpj, qsb[i], ksj, window)

            def grads(carry):
                dk, dv, dq = carry
                qi, doi = qb[i], dob[i].astype(jnp.float32)
                c = _scores(static, qi, kj)
                p = jnp.where(mask[:, None, None], jnp.exp(c - lseb[i][..., None]), 0.0)  # (B, K, G, bq, bk)
                dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, doi)
                dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj.astype(jnp.float32))
                ds = p * (dp - deltab[i][..., None])
                if static.softcap is not None:  # d/dx cap * tanh(x / cap) = 1 - tanh^2
                    ds = ds * (1.0 - jnp.square(c / static.softcap))
                ds = ds * static.scale
                dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qi.astype(jnp.float32))
                dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, kj.astype(jnp.float32))
                return dk, dv, dq.at[i].add(dq_i)

            return jax.lax.cond(mask.any(), grads, lambda c: c, carry)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(0, qb.shape[0], query_block, (zeros, zeros, dq))
        return dq, (dk, dv)

    bk = static.block_k
    xs = (_blocks(k, bk), _blocks(v, bk), _blocks(k_pos, bk), _blocks(k_seg, bk))
    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), xs)
    return (
        _unblock(dq).astype(q.dtype), _unblock(dk).astype(k.dtype), _unblock(dv).astype(v.dtype),
        None, None, None, None, None,
    )  # fmt: skip


_attention.defvjp(_attention_fwd, _attention_bwd)
