"""What the fused sequence kernels (cuDNN, splash) share: masks by index and a static window.

Both mask by index, not by position: a key is visible when it is not after the query in the row, is in
the same packed segment and (local layers) within the window. That equals the position rule of
`attention.attention_mask` when positions grow by one along each segment of a row (true of every batch
jaxgen builds: packed training windows, left- or right-padded prompts). Padding (position -1) becomes a
segment of its own, so no real token sees it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig

_WIDE = np.iinfo(np.int32).max  # a global layer's "window" (see transformer.layer_constants)


def by_window(fn, window, cfg: ModelConfig):
    """fn(static window or None) for this layer: the kernels' masks are static, while the scanned
    layer's window is a traced scalar; a mixed local/global pattern runs both under `lax.cond`."""
    if cfg.sliding_window is None:
        return fn(None)
    if not any(cfg.is_global(i) for i in range(cfg.num_layers)):
        return fn(cfg.sliding_window)
    return jax.lax.cond(window < _WIDE, lambda: fn(cfg.sliding_window), lambda: fn(None))


def segments(positions_bt, segment_ids_bt):
    """Segment ids (B, T) with padding (position -1) in a segment of its own, -1."""
    seg = jnp.zeros_like(positions_bt) if segment_ids_bt is None else segment_ids_bt
    return jnp.where(positions_bt < 0, -1, seg)
