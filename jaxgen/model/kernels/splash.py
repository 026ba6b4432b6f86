"""The Pallas splash-attention kernel shipped in jax for whole sequences (TPU; elsewhere it runs in
interpret mode: exact but slow, for tests).

A Mosaic kernel is not partitioned by the compiler: under a mesh it runs inside `shard_map`, each device
on its rows (the batch axes) and kv heads (the tensor axis, where it divides them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgen.config import ModelConfig
from jaxgen.model.kernels.masks import by_window, segments
from jaxgen.sharding import logical_spec, per_device


def unfit(cfg: ModelConfig, backend: str) -> str | None:
    """Why the splash kernel cannot run this config here, or None (elsewhere than a TPU it runs in
    interpret mode: exact but slow, for tests)."""
    if backend != "tpu" and cfg.attention_impl == "auto":
        return f"it is a TPU kernel, the backend is {backend}"
    return None


def attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, window, cfg: ModelConfig, *, scale: float,
              interpret=None):  # fmt: skip
    """The Pallas splash kernel (one per query-head group, multi-query form), vmapped over the batch
    and the kv heads: (B, T, N, H). T must be a multiple of the block size (min(512, T), and a multiple
    of 128 on TPU). `scale` multiplies q . k (`attention.logit_scale`). interpret: None = on any backend
    but TPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

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
    seg = segments(positions_bt, segment_ids_bt)
    q = (q_btnh.astype(jnp.float32) * scale).astype(q_btnh.dtype)
    q = q.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, H)
    k_, v_ = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)  # (B, K, T, H)

    def local(q, k_, v_, seg, window):
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

        return by_window(run, window, cfg)

    window = jnp.asarray(0 if window is None else window, jnp.int32)  # by_window reads it only for a pattern
    out = _per_device(local, q, k_, v_, seg, window)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _per_device(local, q_bkgth, k_bkth, v_bkth, seg_bt, window):
    """`local` on each device's rows and kv heads under the current mesh (`sharding.per_device`)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = logical_spec(("batch",), q_bkgth.shape[:1], mesh)[0]
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if k_bkth.shape[1] % tensor == 0 else None  # else every device all heads
    q_spec, kv_spec = P(batch, heads, None, None, None), P(batch, heads, None, None)
    in_specs = (q_spec, kv_spec, kv_spec, P(batch, None), P())
    return per_device(local, in_specs, q_spec, q_bkgth, k_bkth, v_bkth, seg_bt, window)
