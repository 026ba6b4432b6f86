"""The parameter table: every parameter's shape, logical axes and initialiser, in one place.

    specs = param_specs(cfg)                     # nested dict of ParamSpec, as the params are nested
    params = init_params(cfg, rng)               # float32 arrays drawn from rng
    shardings = param_shardings(cfg, mesh)       # NamedShardings from the logical axis names

Per-layer weights are stacked on a leading L axis; names end with their per-layer axes (`w_q_dnh` is
stored as (L, D, N, H)). `flops_per_token` counts training FLOPs from the same shapes (for MFU).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
from jaxgen.sharding import named_sharding


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
    L, D, N, K, H, V = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.vocab_size
    layer = {
        "w_q_dnh": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), "normal"),
        "w_k_dkh": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "w_v_dkh": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "w_o_nhd": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), "out"),
        "mlp": _expert_specs(cfg) if cfg.num_experts else _mlp_specs(cfg),
    }
    if cfg.norm_placement != "post":
        layer |= {"attn_norm": _norm_specs(cfg, stacked=True), "mlp_norm": _norm_specs(cfg, stacked=True)}
    if cfg.norm_placement != "pre":
        layer |= {"post_attn_norm": _norm_specs(cfg, stacked=True), "post_mlp_norm": _norm_specs(cfg, stacked=True)}
    layer |= _qk_norm_specs(cfg) | _attention_bias_specs(cfg)
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


def _mlp_specs(cfg: ModelConfig) -> dict:
    L, D, F = cfg.num_layers, cfg.d_model, cfg.d_ff
    mlp = {
        "w_up_df": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "w_down_fd": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "out"),
    }
    if cfg.mlp in ("swiglu", "geglu"):
        mlp["w_gate_df"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal")
    if cfg.use_bias:
        mlp |= {
            "b_up_f": ParamSpec((L, F), ("layers", "mlp"), "zeros"),
            "b_down_d": ParamSpec((L, D), ("layers", "act_embed"), "zeros"),
        }
        if cfg.mlp != "gelu":
            mlp["b_gate_f"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
    return mlp


def _attention_bias_specs(cfg: ModelConfig) -> dict:
    L, D, N, K, H = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
    specs = {}
    if cfg.use_bias or cfg.qkv_bias:
        specs |= {
            "b_q_nh": ParamSpec((L, N, H), ("layers", "heads", "head_dim"), "zeros"),
            "b_k_kh": ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros"),
            "b_v_kh": ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros"),
        }
    if cfg.use_bias:
        specs["b_o_d"] = ParamSpec((L, D), ("layers", "act_embed"), "zeros")
    return specs


def _qk_norm_specs(cfg: ModelConfig) -> dict:
    """RMSNorm scales for queries and keys: per head (H,) or over the whole projection (N, H) / (K, H)."""
    L, N, K, H = cfg.num_layers, cfg.num_heads, cfg.kv_heads, cfg.head_size
    init = "zeros" if cfg.norm_unit_offset else "ones"
    if cfg.qk_norm == "head":
        return {
            "q_norm_h": ParamSpec((L, H), ("layers", "head_dim"), init),
            "k_norm_h": ParamSpec((L, H), ("layers", "head_dim"), init),
        }
    if cfg.qk_norm == "full":
        return {
            "q_norm_nh": ParamSpec((L, N, H), ("layers", "heads", "head_dim"), init),
            "k_norm_kh": ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), init),
        }
    return {}


def _expert_specs(cfg: ModelConfig) -> dict:
    """The router and E stacked gated MLPs of width F (see jaxgen.model.moe)."""
    L, D, E, F = cfg.num_layers, cfg.d_model, cfg.num_experts, cfg.d_ff
    return {
        "w_router_de": ParamSpec((L, D, E), ("layers", "embed", None), "normal"),
        "w_gate_edf": ParamSpec((L, E, D, F), ("layers", "expert", "embed", "mlp"), "normal"),
        "w_up_edf": ParamSpec((L, E, D, F), ("layers", "expert", "embed", "mlp"), "normal"),
        "w_down_efd": ParamSpec((L, E, F, D), ("layers", "expert", "mlp", "embed"), "out"),
    }


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
    mlp = (2 if cfg.mlp == "gelu" else 3) * D * F
    if cfg.num_experts:  # k experts run per token, and the router
        mlp = 3 * D * F * cfg.experts_per_token + D * cfg.num_experts
    per_layer = D * N * H + 2 * D * K * H + N * H * D + mlp
    matmul_weights = L * per_layer + D * V
    return 6.0 * matmul_weights + 12.0 * L * seq_len * N * H
