"""XLA:CPU-only tuning of a cached-attention step, behind `attention.cached_attention`: it changes how a
block's products run on CPU, never what they compute.

    fold_parts        a contiguous block of more than PART slots folded PART slots at a time, those
                      holding written slots only
    pages_per_block   a paged cache's pages gathered and folded together: PART slots' worth
    products_as_sums  whether a decode step's two products run as written-out sums (scores_as_sums,
                      values_as_sums) instead of batched matrix products ($JAXGEN_CPU_DECODE_SUMS=0: never)

Why: XLA:CPU runs tiny batched matrix products far below its speed on large ones and splits the products
over a long block into many small fusions (measured: docs/performance.md, "CPU decode attention").
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

PART = 64  # slots: a longer contiguous block is folded in parts of this many, those in use only
MAX_TERMS = 64  # products written out term by term: at most this many terms per sum


def fold_parts(fold_block, stats, block, filled):
    """`fold_block(stats, *block)` for a contiguous block (keys (B, K, H, Sb), values (B, K, Sb, H),
    positions (B, Sb)) of which the first `filled` slots (() int32, may lie outside [0, Sb]) are written.
    A block of more than PART slots is folded PART slots at a time by a `fori_loop` over the parts in use,
    the block riding in the carry (as `kv` does in `attention.cached_attention`; the compiled decode step
    of a 2048-slot cache holds no copy of a block): on CPU a longer block costs more than its share, and
    the parts past the filled slots are skipped. One loop body per block keeps compile time as it was (a
    cond per part more than doubled it)."""
    size = block[0].shape[-1]
    if size <= PART:
        return fold_block(stats, *block)
    in_use = jnp.clip(-(-filled // PART), 1, size // PART)

    def body(c, carry):
        stats, (k_bkhs, v_bksh, pos_bs) = carry
        part = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, c * PART, PART, axis)
        return fold_block(stats, part(k_bkhs, 3), part(v_bksh, 2), part(pos_bs, 1)), (k_bkhs, v_bksh, pos_bs)

    return jax.lax.fori_loop(0, in_use, body, (stats, block))[0]


def pages_per_block(page_size: int) -> int:
    """Pages a paged cache gathers and folds per step of its loop (`PagedCache.fold`): on CPU as many as
    make PART slots (at least one), elsewhere one. On CPU a loop step over one small page costs several
    times its share (measured with bench/paged_step.py: a decode step at batch 64 of configs/tiny.yaml
    1.8x the contiguous cache's with one 16-slot page a step, 1.2x with four)."""
    return max(1, PART // page_size) if jax.default_backend() == "cpu" else 1


def products_as_sums(q_btkgh) -> bool:
    """Whether a block's two products run as written-out sums of broadcast products rather than as
    batched matrix products: on CPU, for one query per row (a decode step) and grouped queries (G > 1).
    There a product is B x K tiny (G, H) x (H, S) matrix products, which XLA:CPU's product kernels run
    far below their speed on large ones, while a sum of H (or S) broadcast products is one fused loop
    that reads each key and value once. For G = 1 (one query per kv head: gpt2-124m) the matrix products
    won; accelerators run them natively.

    The price is compile time: a sum is H (or S) operations in the program where a product is one, so a
    decode program compiles in about twice the time (a 2-layer, d 64 Llama's decode loop: 5.3 s against 2.5).
    A process that compiles many programs and runs each briefly (a test suite, a notebook trying shapes)
    sets $JAXGEN_CPU_DECODE_SUMS=0 and keeps the matrix products. Read when a program is traced."""
    _, t, _, g, h = q_btkgh.shape
    on_cpu = jax.default_backend() == "cpu"
    return sums_wanted() and on_cpu and t == 1 and g > 1 and h <= MAX_TERMS  # (H = 128: not measured)


def sums_wanted() -> bool:
    """$JAXGEN_CPU_DECODE_SUMS: 1 (the default) lets `products_as_sums` choose the sums, 0 never."""
    value = os.environ.get("JAXGEN_CPU_DECODE_SUMS", "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"JAXGEN_CPU_DECODE_SUMS={value!r} is not allowed: 0 (matrix products) or 1 (sums, the default)"
        )
    return value == "1"


def scores_as_sums(q_btkgh, k_bkhs):
    """(B, K, G, 1, S): the scores of one query per row, as a sum over the H key dims."""
    q = q_btkgh[:, 0]  # (B, K, G, H)
    s = sum(q[:, :, :, i, None] * k_bkhs[:, :, None, i, :] for i in range(q.shape[-1]))
    return s[:, :, :, None]


def values_as_sums(p_bkgts, v_bksh):
    """(B, K, G, 1, H): probabilities times values for one query per row, as sums over the S slots,
    cut into C chunks of at most MAX_TERMS slots (so a long block stays a short sum) added at the end."""
    b, k, g, _, s = p_bkgts.shape
    c = -(-s // MAX_TERMS)
    while s % c:
        c += 1
    p = p_bkgts.reshape(b, k, g, c, s // c)
    v = v_bksh.reshape(b, k, c, s // c, v_bksh.shape[-1])
    out = sum(p[:, :, :, :, i, None] * v[:, :, None, :, i, :] for i in range(s // c))  # (B, K, G, C, H)
    return out.sum(3)[:, :, :, None]
