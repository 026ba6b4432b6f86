"""The decoder-only transformer: its parameter table, initialisation and the pure forward pass.

    params = init_params(cfg, rng)
    logits, _ = forward(params, tokens, positions, cfg=cfg)               # training: cache=None
    logits, cache = forward(params, tokens, positions, cache, cfg=cfg)    # prefill / decode

Parameters are a nested dict of arrays. Per-layer weights are stacked on a leading L axis and run
with `lax.scan`, so compile time does not grow with depth. Names end with their per-layer axes
(`w_q_dnh` is stored as (L, D, N, H)).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.model import attention, layers
from jaxgen.model.kvcache import KVCache
from jaxgen.sharding import constrain, named_sharding


class ParamSpec(NamedTuple):
    shape: tuple[int, ...]
    names: tuple[str | None, ...]  # logical axis names, see jaxgen.sharding
    init: str  # "normal", "out" (normal scaled by 1/sqrt(2L), GPT-2), "ones", "zeros"


def _norm_specs(cfg: ModelConfig, stacked: bool) -> dict:
    lead, lead_names = ((cfg.num_layers,), ("layers",)) if stacked else ((), ())
    d = cfg.d_model
    init = "zeros" if cfg.norm_unit_offset else "ones"  # the norm multiplies by (1 + scale)
    specs = {"scale_d": ParamSpec((*lead, d), (*lead_names, "act_embed"), init)}
    if cfg.norm == "layernorm":
        specs["bias_d"] = ParamSpec((*lead, d), (*lead_names, "act_embed"), "zeros")
    return specs


def param_specs(cfg: ModelConfig) -> dict:
    """The single table of parameters: shape, logical axes and initialiser of each."""
    L, D, N, K, H, F, V = (
        cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size,
    )  # fmt: skip
    layer = {
        "attn_norm": _norm_specs(cfg, stacked=True),
        "w_q_dnh": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), "normal"),
        "w_k_dkh": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "w_v_dkh": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "w_o_nhd": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), "out"),
        "mlp_norm": _norm_specs(cfg, stacked=True),
        "mlp": {
            "w_up_df": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
            "w_down_fd": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "out"),
        },
    }
    if cfg.mlp in ("swiglu", "geglu"):
        layer["mlp"]["w_gate_df"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal")
    if cfg.use_bias or cfg.qkv_bias:
        layer |= {
            "b_q_nh": ParamSpec((L, N, H), ("layers", "heads", "head_dim"), "zeros"),
            "b_k_kh": ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros"),
            "b_v_kh": ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros"),
        }
    if cfg.use_bias:
        layer["b_o_d"] = ParamSpec((L, D), ("layers", "act_embed"), "zeros")
        layer["mlp"] |= {
            "b_up_f": ParamSpec((L, F), ("layers", "mlp"), "zeros"),
            "b_down_d": ParamSpec((L, D), ("layers", "act_embed"), "zeros"),
        }
        if cfg.mlp != "gelu":
            layer["mlp"]["b_gate_f"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
    specs = {
        "embed_vd": ParamSpec((V, D), ("vocab", "embed"), "normal"),
        "layers": layer,
        "final_norm": _norm_specs(cfg, stacked=False),
    }
    if cfg.position == "learned":
        specs["pos_embed_td"] = ParamSpec((cfg.max_seq_len, D), (None, "embed"), "normal")
    if not cfg.tie_embeddings:
        specs["head_dv"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_shardings(cfg: ModelConfig, mesh) -> dict:
    return jax.tree.map(lambda s: named_sharding(mesh, s.names, s.shape), param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Float32 parameters drawn from `rng`. Jit it with `param_shardings` to create them sharded."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(rng, len(leaves))
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5

    def make(spec: ParamSpec, key):
        if spec.init == "ones":
            return jnp.ones(spec.shape, jnp.float32)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, jnp.float32)
        std = out_std if spec.init == "out" else cfg.init_std
        return std * jax.random.normal(key, spec.shape, jnp.float32)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys, strict=True)])


def count_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec))


# --- forward ---------------------------------------------------------------------------------------


def forward(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    *,
    cfg: ModelConfig,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits for every position, and the updated cache.

    tokens, positions: (B, T) int32; a position of -1 marks padding, never attended to.
    segment_ids: (B, T) int32 or None; packed documents do not attend across segments
        (training only: a cache holds one sequence per row).
    cache: None for a training pass over whole sequences; or a cache to prefill or decode (any type
        with the interface of `jaxgen.model.attention`: a `KVCache`, whose slots [end, end + T)
        receive this call's keys and values, or the serving engine's `PagedCache`, where each token
        goes to its row's page for its position). The model never asks which.
    Returns logits (B, T, V) float32 and the cache (None when none was given).
    """
    x, cache = hidden_states(params, tokens, positions, cache, cfg=cfg, segment_ids=segment_ids)
    return lm_head(params, x, cfg), cache


def hidden_states(params, tokens, positions, cache=None, *, cfg: ModelConfig, segment_ids=None):
    """The final-normed hidden states (B, T, D) and the cache: `forward` without the LM head, for
    callers that need logits at a few positions only (prefill needs the last one)."""
    params = _cast(params, cfg)
    x = params["embed_vd"][tokens]  # (B, T, D)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
    if cfg.position == "learned":
        x = x + params["pos_embed_td"][jnp.clip(positions, 0, cfg.max_seq_len - 1)]
    x = constrain(x, ("batch", "seq", "act_embed"))

    t = tokens.shape[1]
    if cache is None:  # training: the whole (T, T) mask once
        mask = attention.attention_mask(positions, positions, segment_ids, segment_ids, cfg.sliding_window)
        kv = None
    else:  # decoding: masks are built block by block, over the cache blocks in use only
        cache = cache.with_positions(positions)
        kv = (cache.k, cache.v)

    def layer_step(carry, xs):
        x, kv = carry
        p, i = xs
        if cache is None:
            attend = functools.partial(_attend_plain, mask=mask, cfg=cfg)
        else:
            attend = functools.partial(_attend_cache, cache=cache, kv=kv, layer=i, positions=positions, cfg=cfg)
        x, kv = _block(x, p, positions, attend, cfg)
        return (x, kv), None

    if isinstance(params["layers"], list):  # unstacked (see `unstack_layers`): a Python loop
        for i, p in enumerate(params["layers"]):
            (x, kv), _ = layer_step((x, kv), (p, i))
    else:
        (x, kv), _ = jax.lax.scan(layer_step, (x, kv), (params["layers"], jnp.arange(cfg.num_layers)))
    x = layers.norm(x, params["final_norm"], cfg)
    return x, (None if cache is None else cache.advance(kv, t))


def unstack_layers(params: dict) -> dict:
    """The params with `layers` as a list of per-layer dicts instead of stacked (L, ...) arrays.

    For decoding: with stacked weights each step slices every layer's matrices out of the stack, and
    for a matrix-vector product XLA:CPU copies the slice first, reading the weights twice. A list makes
    `forward` loop over layers in Python (compile time then grows with depth, which training avoids).
    """
    stacked = params["layers"]
    if isinstance(stacked, list):
        return params
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return params | {"layers": [jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(num_layers)]}


def lm_head(params, x_btd, cfg: ModelConfig):
    """Logits (B, T, V) float32 from hidden states; the head is the embedding when tied."""
    params = _cast(params, cfg)
    x = x_btd.reshape(-1, x_btd.shape[-1])  # 2-D products: see layers.dense
    if cfg.tie_embeddings:  # contract with the embedding's rows as stored: `.T` made XLA copy it each step
        contract_d = (((1,), (1,)), ((), ()))
        logits = jax.lax.dot_general(x, params["embed_vd"], contract_d, preferred_element_type=jnp.float32)
    else:
        logits = jnp.matmul(x, params["head_dv"], preferred_element_type=jnp.float32)
    logits = logits.reshape(*x_btd.shape[:-1], -1)
    return constrain(logits, ("batch", "seq", "vocab"))


def _cast(params, cfg: ModelConfig):
    dtype = jnp.dtype(cfg.dtype)
    return jax.tree.map(lambda p: p.astype(dtype), params)


def _qkv(x, p, positions, cfg: ModelConfig):
    """Pre-norm queries (B, T, N, H) and keys and values (B, T, K, H), rotated when RoPE."""
    h = layers.norm(x, p["attn_norm"], cfg)
    q = layers.dense(h, p["w_q_dnh"])  # (B, T, N, H)
    k = layers.dense(h, p["w_k_dkh"])  # (B, T, K, H)
    v = layers.dense(h, p["w_v_dkh"])
    if "b_q_nh" in p:
        q, k, v = q + p["b_q_nh"], k + p["b_k_kh"], v + p["b_v_kh"]
    if cfg.position == "rope":
        inv_freq = layers.rope_frequencies(cfg)
        q = layers.rope(q, positions, inv_freq)
        k = layers.rope(k, positions, inv_freq)
    return q, k, v


def _block(x, p, positions, attend, cfg: ModelConfig):
    """One pre-norm transformer block. `attend(q, k, v) -> (out, kv)` is plain attention (kv None)
    or cached attention (kv: the cache's keys and values, this layer's written)."""
    q, k, v = _qkv(x, p, positions, cfg)
    out, kv = attend(q, k, v)
    out = layers.dense(out, p["w_o_nhd"], in_axes=2)  # (B, T, D)
    if "b_o_d" in p:
        out = out + p["b_o_d"]
    x = x + out
    x = x + layers.mlp(layers.norm(x, p["mlp_norm"], cfg), p["mlp"], cfg)
    return constrain(x, ("batch", "seq", "act_embed")), kv


def _attend_plain(q, k, v, *, mask, cfg: ModelConfig):
    return attention.dense_attention(q, k, v, mask, cfg.kv_heads), None


def _attend_cache(q, k, v, *, cache, kv, layer, positions, cfg: ModelConfig):
    """Writes this layer's keys and values into the cache, then attends over the cache's blocks in use."""
    kv = cache.write(kv, layer, k, v, positions)
    return attention.cached_attention(q, cache, kv, layer, positions, cfg.kv_heads, cfg.sliding_window)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), counted as PaLM's MFU does.

    Every weight matmul costs 2 FLOPs per weight per token forward and twice that backward: 6 * P,
    where P counts the matmul weights (the embedding lookup is a gather and is excluded, the LM head
    included, tied or not). Attention scores and the weighted sum add 2 * 2 * T * N * H per layer
    forward, so 12 * L * T * N * H in all, with the full T x T square counted (causal masking does not
    reduce the work our dense kernel does). Norms, softmax and activations are ignored.
    """
    D, N, K, H, F, V, L = (
        cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size, cfg.num_layers,
    )  # fmt: skip
    per_layer = D * N * H + 2 * D * K * H + N * H * D + (2 if cfg.mlp == "gelu" else 3) * D * F
    matmul_weights = L * per_layer + D * V
    return 6.0 * matmul_weights + 12.0 * L * seq_len * N * H
