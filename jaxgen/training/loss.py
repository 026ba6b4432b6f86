"""The LM head and cross-entropy in chunks of tokens, with the gradient computed on the way forward.

The whole-batch logits (B, T, V) in float32 are the largest tensors of a training step with a large
vocabulary: 8192 tokens x 128256 words (Llama 3) is 4.2 GB, and the loss and its gradient keep three or
four such arrays alive. Here each row's tokens go through the head `chunk` at a time. Since the loss is
the last operation before the scalar objective, its gradient with respect to each chunk's logits,
softmax - onehot, is known as soon as the chunk's logits are: the forward pass already multiplies it
back into the hidden states' and the head weight's gradients (a custom VJP that saves those two and
scales them by the incoming cotangent). No logits are stored and none are recomputed: memory
O(B x chunk x V), no extra FLOPs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.sharding import constrain


class _Static(NamedTuple):
    chunk: int
    softcap: float | None  # the model's final_softcap
    tied: bool  # the head is the embedding (V, D), contracted on D


def head_cross_entropy(params, x_btd, targets_bt, mask_bt, cfg: ModelConfig, chunk: int):
    """(sum of -log p(target) over tokens where mask is 1, number of such tokens), both float32 ().

    x_btd: the final-normed hidden states (model.hidden_states). Equal to `step.cross_entropy` of
    `model.lm_head`'s logits. chunk: tokens of each row per step of the loop (the sequence is padded to
    a multiple of it with masked tokens)."""
    dtype = jnp.dtype(cfg.dtype)
    w = (params["embed_vd"] if cfg.tie_embeddings else params["head_dv"]).astype(dtype)
    t = x_btd.shape[1]
    pieces = -(-t // min(chunk, t))
    chunk = -(-t // pieces)  # pieces of equal size: T = 1500 by 1024 runs 2 x 750, not 2 x 1024
    extra = -t % chunk
    if extra:
        x_btd = jnp.pad(x_btd, ((0, 0), (0, extra), (0, 0)))
        targets_bt, mask_bt = (jnp.pad(a, ((0, 0), (0, extra))) for a in (targets_bt, mask_bt))
    mask = mask_bt.astype(jnp.float32)
    total = _fused(_Static(chunk, cfg.final_softcap, cfg.tie_embeddings), x_btd.astype(dtype), w, targets_bt, mask)
    return total, jnp.sum(mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, x_btd, w, targets_bt, mask_bt):
    return _forward(static, x_btd, w, targets_bt, mask_bt)[0]


def _forward(static: _Static, x_btd, w, targets_bt, mask_bt):
    """The loss sum and its gradients with respect to x (B, T, D) and w, one chunk of each row at a time."""
    b, t, d = x_btd.shape
    n = t // static.chunk
    xs = x_btd.reshape(b, n, static.chunk, d)
    tg, mk = targets_bt.reshape(b, n, static.chunk), mask_bt.reshape(b, n, static.chunk)
    contract = (((2,), (1,)), ((), ())) if static.tied else (((2,), (0,)), ((), ()))

    def body(i, carry):
        total, dx, dw = carry
        x_c = jax.lax.dynamic_index_in_dim(xs, i, 1, keepdims=False)  # (B, c, D)
        t_c = jax.lax.dynamic_index_in_dim(tg, i, 1, keepdims=False)
        m_c = jax.lax.dynamic_index_in_dim(mk, i, 1, keepdims=False)
        raw = jax.lax.dot_general(x_c, w, contract, preferred_element_type=jnp.float32)  # (B, c, V)
        logits = raw if static.softcap is None else static.softcap * jnp.tanh(raw / static.softcap)
        is_target = jnp.arange(logits.shape[-1]) == t_c[..., None]
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
        g = (jnp.exp(logits - lse[..., None]) - is_target) * m_c[..., None]  # d loss / d logits
        if static.softcap is not None:  # d/dx cap * tanh(x / cap) = 1 - tanh^2
            g = g * (1.0 - jnp.square(logits / static.softcap))
        g = g.astype(w.dtype)
        if static.tied:  # w (V, D)
            dx_c = jnp.einsum("bcv,vd->bcd", g, w, preferred_element_type=jnp.float32)
            dw = dw + jnp.einsum("bcv,bcd->vd", g, x_c, preferred_element_type=jnp.float32)
        else:  # w (D, V)
            dx_c = jnp.einsum("bcv,dv->bcd", g, w, preferred_element_type=jnp.float32)
            dw = dw + jnp.einsum("bcd,bcv->dv", x_c, g, preferred_element_type=jnp.float32)
        dx = jax.lax.dynamic_update_index_in_dim(dx, dx_c.astype(dx.dtype), i, 1)
        return total + jnp.sum(nll * m_c), dx, constrain(dw, w_names)

    # the weight's gradient sharded like the weight (FSDP / tensor axes), not replicated in the loop
    w_names = ("vocab", "embed") if static.tied else ("embed", "vocab")
    init = (jnp.zeros((), jnp.float32), jnp.zeros_like(xs), constrain(jnp.zeros(w.shape, jnp.float32), w_names))
    # a while loop, not a scan: JAX must not partially evaluate it (see model.blockwise._forward)
    total, dx, dw = jax.lax.while_loop(
        lambda s: s[0] < n, lambda s: (s[0] + 1, body(s[0], s[1])), (jnp.int32(0), init)
    )[1]
    return total, dx.reshape(b, t, d), dw.astype(w.dtype)


def _fused_fwd(static, x_btd, w, targets_bt, mask_bt):
    total, dx, dw = _forward(static, x_btd, w, targets_bt, mask_bt)
    return total, (dx, dw)


def _fused_bwd(static, res, ct):
    dx, dw = res
    return dx * ct.astype(dx.dtype), dw * ct.astype(dw.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
