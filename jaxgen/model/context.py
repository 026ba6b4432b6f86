"""Context parallelism: attention of whole sequences whose tokens are split over the mesh's `context` axis.

With `mesh.context` = C > 1 the activations' token axis T is sharded C ways (the `seq` rule of
`jaxgen.sharding`), and attention, the one layer that mixes tokens, runs here under `shard_map`
(`model.attention_impl` ring or allgather, see `kernels.choose`); each device holds T / C queries:

    allgather  keys and values (and their positions, segments) gathered along `context`; the local
               queries attend to all of them with `blockwise` attention (its VJP; the gather's transpose
               sums dk, dv back to their owners). Simple; holds the whole sequence's keys per device.
    ring       each device keeps its queries and passes its key/value chunk around the ring with
               `ppermute`, C steps, folding each chunk into one online softmax (running max, normaliser,
               weighted sum, as `blockwise` does over key blocks); the next chunk's transfer is issued
               before the current chunk's compute, so the two may overlap. A custom VJP recomputes: the
               backward passes the chunks around again with their dk, dv accumulators (which arrive home
               after C steps) and reuses `blockwise`'s backward per chunk with the global log-sum-exp,
               so no device ever holds more than two chunks of keys or any (T, S) array.

Causal load balance (both): zig-zag. The sequence is cut into 2C chunks and device r holds chunks r and
2C - 1 - r, so under the causal mask every device has the same number of visible (query block, key
block) pairs (`causal_work` counts them). The activations stay contiguous (device r: chunks 2r, 2r + 1);
inside the call two `ppermute`s move each device's halves to their zig-zag owners and two move the output
back (`to_zigzag`, `from_zigzag`), T / C tokens per device each way. Since the mask is by position
(`attention.attention_mask`: positions and segment ids travel with their tokens), attention is unchanged
by the reorder, and packed documents, sliding windows and GQA/MQA need nothing more. Reordering the batch
once at the model's input instead would save those transfers in every layer: not done.

A whole prompt's prefill (`transformer.forward(..., fresh=True)`) attends the same way; the caches it
fills are split over `context` along their slots (pages' offsets), and cached attention over such a cache
with few queries (decode) runs `split_cached_attention`: each device its own slots, the partial softmaxes
combined once.

Shapes: the glossary in `jaxgen.sharding`; C the context size, Tc = T / C the tokens per device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxgen.model.blockwise import (
    NEG_INF,
    _attention,
    _attention_bwd,
    _blocks,
    _mask,
    _scores,
    _Static,
    _unblock,
    _while_range,
)
from jaxgen.sharding import logical_spec

_NO_WINDOW = jnp.iinfo(jnp.int32).max
AXIS = "context"


def check_fit(impl: str, t: int, context: int, block: int, what: str = "sequence length") -> int:
    """The block size both loops use for T = `t` tokens over `context` devices; raises ValueError when T
    is not a multiple of 2 x context x block (zig-zag halves of whole blocks; the block shrinks to the
    half when that is smaller)."""
    half = t // (2 * context)
    bq = min(block, max(half, 1))
    if t % (2 * context * bq):
        raise ValueError(
            f"model.attention_impl={impl}: the {what} T={t} must be a multiple of 2 x mesh.context x "
            f"block = 2 x {context} x {bq} = {2 * context * bq} (zig-zag halves of whole blocks; block = "
            f"min(model.attention_block, T / (2 x context)))"
        )
    return bq


def context_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg, impl: str, *, scale):
    """Attention of the whole sequence over itself by `impl` (ring or allgather) under the current mesh,
    whose `context` axis splits T; equal to `attention.dense_attention` under
    `attention_mask(positions, positions, segment_ids, segment_ids, window)`. q (B, T, N, H), k and v
    (B, T, K, H), positions and segment ids (B, T) (segments None: one document per row), window None,
    an int or a traced int32 scalar. Returns (B, T, N, H)."""
    mesh = jax.sharding.get_abstract_mesh()
    c = mesh.shape[AXIS]
    b, t, n, _ = q_btnh.shape
    kv_heads = k_btkh.shape[2]
    block = check_fit(impl, t, c, cfg.attention_block)
    seg = jnp.zeros_like(positions_bt) if segment_ids_bt is None else segment_ids_bt
    window = jnp.asarray(_NO_WINDOW if window is None else window, jnp.int32)
    batch = logical_spec(("batch",), (b,), mesh)[0]
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if n % tensor == 0 and kv_heads % tensor == 0 else None  # else every device all heads
    x_spec, tok_spec = P(batch, AXIS, heads, None), P(batch, AXIS)
    static = _Static(float(scale), cfg.attn_softcap, block, block)
    local = functools.partial(_balanced, _ring if impl == "ring" else _allgather, static, c)
    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(x_spec,) * 3 + (tok_spec,) * 2 + (P(),), out_specs=x_spec, check_vma=False
    )
    return sharded(q_btnh, k_btkh, v_btkh, positions_bt, seg, window)


def zigzag_order(t: int, context: int) -> np.ndarray:
    """(T,) the token order whose c-th T / C run device c holds: chunks c and 2C - 1 - c of 2C."""
    chunks = np.arange(t).reshape(2 * context, t // (2 * context))
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * context - 1 - c]]) for c in range(context)])


def causal_work(t: int, context: int, block: int, zigzag: bool = True) -> list[int]:
    """Per device, the (query block, key block) pairs of one causal sequence that have a visible key (the
    pairs the loops compute; the others are skipped): the load balance of the assignment."""
    order = zigzag_order(t, context) if zigzag else np.arange(t)
    blocks = order.reshape(context, -1, block)  # (C, Tc / block, block) positions
    first, last = blocks.min(-1), blocks.max(-1)
    all_first = first.reshape(-1)
    return [int((all_first[None, :] <= last[c][:, None]).sum()) for c in range(context)]


def _balanced(attend, static: _Static, c: int, q, k, v, pos, seg, window):
    """`attend` over the zig-zag order: each device's contiguous T / C tokens (B, Tc, ...) exchanged for
    its two zig-zag chunks and the output sent back, T / C tokens moved per device each way."""
    q, k, v, pos, seg = (to_zigzag(c, x) for x in (q, k, v, pos, seg))
    return from_zigzag(c, attend(static, c, q, k, v, pos, seg, window))


def _zigzag_perms(c: int):
    """ppermute pairs moving each device's first half (chunk 2s of 2C, even) and second half (chunk 2s + 1,
    odd) to the device that holds that chunk in zig-zag order: chunk i < C to device i, else to 2C - 1 - i.
    Device r holds chunks r and 2C - 1 - r, one even and one odd, so each is a permutation."""
    dest = lambda i: i if i < c else 2 * c - 1 - i
    return [(s, dest(2 * s)) for s in range(c)], [(s, dest(2 * s + 1)) for s in range(c)]


def to_zigzag(c: int, x):
    """Inside `shard_map` over `context`: this device's contiguous tokens (B, Tc, ...) -> its zig-zag
    chunks r and 2C - 1 - r (B, Tc, ...)."""
    even, odd = _zigzag_perms(c)
    half = x.shape[1] // 2
    e, o = jax.lax.ppermute(x[:, :half], AXIS, even), jax.lax.ppermute(x[:, half:], AXIS, odd)
    r_even = jax.lax.axis_index(AXIS) % 2 == 0  # device r's first chunk, r, is even when r is
    return jnp.concatenate([jnp.where(r_even, e, o), jnp.where(r_even, o, e)], axis=1)


def from_zigzag(c: int, x):
    """The inverse of `to_zigzag`."""
    even, odd = _zigzag_perms(c)
    half = x.shape[1] // 2
    first, second = x[:, :half], x[:, half:]
    r_even = jax.lax.axis_index(AXIS) % 2 == 0
    back = lambda pairs: [(d, s) for s, d in pairs]
    e = jax.lax.ppermute(jnp.where(r_even, first, second), AXIS, back(even))
    o = jax.lax.ppermute(jnp.where(r_even, second, first), AXIS, back(odd))
    return jnp.concatenate([e, o], axis=1)


def _to_groups(q_btnh, kv_heads: int):
    b, t, n, h = q_btnh.shape
    return q_btnh.reshape(b, t, kv_heads, n // kv_heads, h)  # (B, Tc, K, G, H)


def _allgather(static: _Static, c: int, q, k, v, pos, seg, window):
    """One device's queries (B, Tc, N, H) over every device's keys, gathered: (B, Tc, N, H)."""
    gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
    out = _attention(
        static, _to_groups(q, k.shape[2]), gather(k), gather(v), pos, gather(pos), seg, gather(seg), window
    )
    return out.reshape(q.shape)


def _ring(static: _Static, c: int, q, k, v, pos, seg, window):
    """One device's queries (B, Tc, N, H) over the key/value chunks passed around the ring: (B, Tc, N, H)."""
    out = _ring_attention(static, c, _to_groups(q, k.shape[2]), k, v, pos, seg, window)
    return out.reshape(q.shape)


def _pass_on(c: int, xs):
    """xs sent one step around the ring: device i's to device i + 1."""
    perm = [(i, (i + 1) % c) for i in range(c)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_attention(static, c, q, k, v, pos, seg, window):
    return _ring_forward(static, c, q, k, v, pos, seg, window)[0]


def _ring_forward(static: _Static, c: int, q, k, v, pos, seg, window):
    """Output (B, Tc, K, G, H) and the log-sum-exp (B, K, G, Tc) over all C chunks (0 where nothing is seen)."""
    b, t, kh, g, h = q.shape
    row = (t // static.block_q, b, kh, g, static.block_q)  # (I, B, K, G, bq)
    stats = (jnp.full(row, NEG_INF, jnp.float32), jnp.zeros(row, jnp.float32), jnp.zeros((*row, h), jnp.float32))

    def step(_, carry):
        stats, chunk = carry
        upcoming = _pass_on(c, chunk)  # issued before this chunk's compute: the two may overlap
        return _fold(static, stats, q, pos, seg, window, *chunk), upcoming

    stats, _ = jax.lax.fori_loop(0, c, step, (stats, (k, v, pos, seg)))
    m, l, acc = stats
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)  # (I, B, K, G, bq, H)
    out = _unblock(out.transpose(0, 1, 4, 2, 3, 5).astype(q.dtype))  # (B, Tc, K, G, H)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out, jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, -1)


def _fold(static: _Static, stats, q, q_pos, q_seg, window, k, v, k_pos, k_seg):
    """The running (max, normaliser, weighted sum) per query block, (I, B, K, G, bq[, H]), with one chunk
    of keys folded in, block by block; a pair of blocks with no visible key is skipped (`blockwise`)."""
    qb, qpb, qsb = _blocks(q, static.block_q), _blocks(q_pos, static.block_q), _blocks(q_seg, static.block_q)
    kb, vb = _blocks(k, static.block_k), _blocks(v, static.block_k)
    kpb, ksb = _blocks(k_pos, static.block_k), _blocks(k_seg, static.block_k)

    def query_block(i, stats):
        def key_block(j, carry):
            mask = _mask(qpb[i], kpb[j], qsb[i], ksb[j], window)[:, None, None]  # (B, 1, 1, bq, bk)

            def fold(carry):
                m, l, acc = carry
                s = jnp.where(mask, _scores(static, qb[i], kb[j]), NEG_INF)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            return jax.lax.cond(mask.any(), fold, lambda c: c, carry)

        carry = _while_range(kb.shape[0], key_block, tuple(x[i] for x in stats))
        return tuple(x.at[i].set(y) for x, y in zip(stats, carry, strict=True))

    return _while_range(qb.shape[0], query_block, stats)


def _ring_attention_fwd(static, c, q, k, v, pos, seg, window):
    out, lse = _ring_forward(static, c, q, k, v, pos, seg, window)
    return out, (q, k, v, pos, seg, window, out, lse)


def _ring_attention_bwd(static: _Static, c: int, res, d_out):
    """The chunks go around the ring again, each with its dk, dv accumulators: device r adds what its
    queries give the chunk it holds (`blockwise`'s backward with the global out and log-sum-exp, which
    make each chunk's share exact), and after C steps every accumulator is back at its chunk's owner."""
    q, k, v, pos, seg, window, out, lse = res

    def step(_, carry):
        dq, chunk, dkv = carry
        upcoming = _pass_on(c, chunk)
        k_c, v_c, pos_c, seg_c = chunk
        grads = _attention_bwd(static, (q, k_c, v_c, pos, pos_c, seg, seg_c, window, out, lse), d_out)
        dq_c, dk_c, dv_c = (x.astype(jnp.float32) for x in grads[:3])
        return dq + dq_c, upcoming, _pass_on(c, (dkv[0] + dk_c, dkv[1] + dv_c))

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq, _, (dk, dv) = jax.lax.fori_loop(0, c, step, (zeros(q), (k, v, pos, seg), (zeros(k), zeros(v))))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def split_cached_attention(fold, q_btkgh, cache, kv, layer, q_pos_bt):
    """Cached attention over a cache whose blocks' slots are split over the mesh's context axis (C ways:
    `cache.context_split`, `context_parts`, `as_part`): every device runs `fold` (`attention._fold_cache`)
    over its own slots of the blocks in use, giving the online softmax's (max m, normaliser l, weighted sum
    acc) of its keys, and the C partial softmaxes are combined once: m* = max_r m_r, l = sum_r l_r e^(m_r -
    m*), acc likewise (a pmax and two psums of (B, K, G, T[, H]), no key crosses a device). q (B, T, K, G,
    H) scaled; returns (m*, l, acc) (B, K, G, T[, H]), rows and kv heads split as the queries'."""
    mesh = jax.sharding.get_abstract_mesh()
    tables, table_specs, kv_specs = cache.context_parts(kv)
    q_spec = logical_spec(("batch", None, "kv_heads", None, None), q_btkgh.shape, mesh)
    stat_spec = P(*q_spec[:1], q_spec[2], None, None)
    split = cache.context_split

    def local(q, q_pos, tables, kv):
        m, l, acc = fold(q, cache.as_part(tables, kv, split), kv, layer, q_pos)[0]
        m_all = jax.lax.pmax(m, AXIS)
        scale = jnp.exp(m - m_all)  # 1 where this device holds the max, 0 where it saw no key
        return m_all, jax.lax.psum(l * scale, AXIS), jax.lax.psum(acc * scale[..., None], AXIS)

    pos_spec = P(q_spec[0], None)
    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(q_spec, pos_spec, table_specs, kv_specs),
        out_specs=(stat_spec, stat_spec, P(*stat_spec, None)), check_vma=False,
    )  # fmt: skip
    return sharded(q_btkgh, q_pos_bt, tables, kv)
