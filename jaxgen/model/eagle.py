"""EAGLE-3 draft heads: a one-layer network that drafts a target model's next tokens from the target's own
hidden states (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", 2025).

The head reads the residual stream entering a low, a middle and a high layer of the target (`Head.layers`,
the target's `forward(..., taps=...)`), concatenated (n D) and projected to D (`fc_fd`). Each head token
joins that feature with the embedding of the token that follows it (the target's own embedding, shared,
never trained here), each through its own RMSNorm, concatenated to 2 D, into one Llama decoder layer
(attention over the head's own keys, SwiGLU MLP; the residual is the feature), then a final norm and an
LM head over the draft vocabulary, whose ids map to the target's through `Head.draft_to_target`.

Alignment: the feature at position t (the target's state that predicted token t + 1) and token t + 1 make
the head's token at position t; it predicts token t + 2. Drafting further, the head feeds back its own
output hidden state (before the final norm) with the token it drafted, one position on; training
unrolls the same k steps (`train_forward`, EAGLE-3's training-time test), so the head learns on its own
features what it meets when drafting.

Shapes: B rows, T tokens, D the target's d_model, n the tapped layers, V the target's vocabulary, Vd the
draft vocabulary (Vd <= V), k the unrolled steps.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig
from jaxgen.model import attention, layers, quant


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers a head taps: EAGLE-3's (2, L // 2, L - 3) where the target is deep enough (the
    layers vLLM and SGLang tap by default), else (1, L // 2, L): a small model's last output included."""
    if num_layers >= 6:
        return 2, num_layers // 2, num_layers - 3
    return min(1, num_layers), num_layers // 2, num_layers


def head_config(cfg: ModelConfig, draft_vocab: int = 0) -> ModelConfig:
    """The head's decoder layer as a one-layer Llama of the target's width (its attention, cache and
    RoPE are the model's own code); `draft_vocab` 0: the target's vocabulary."""
    rope = cfg.position == "rope"
    return ModelConfig(
        vocab_size=draft_vocab or cfg.vocab_size, num_layers=1, d_model=cfg.d_model, num_heads=cfg.num_heads,
        num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size, d_ff=cfg.d_ff, max_seq_len=cfg.max_seq_len,
        position="rope", rope_theta=cfg.rope_theta if rope else 10000.0,
        rope_scaling=cfg.rope_scaling if rope else "none", rope_factor=cfg.rope_factor,
        rope_low_freq_factor=cfg.rope_low_freq_factor, rope_high_freq_factor=cfg.rope_high_freq_factor,
        rope_original_max_len=cfg.rope_original_max_len, norm="rmsnorm", norm_eps=cfg.norm_eps, mlp="swiglu",
        dtype=cfg.dtype, cache_layout=cfg.cache_layout, init_std=cfg.init_std,
    )  # fmt: skip


@flax.struct.dataclass
class Head:
    """A trained head: its params (`init_params`), the draft vocabulary's target ids, and (static) its
    layer config and the target layers it taps."""

    params: dict
    draft_to_target: jax.Array  # (Vd,) int32: the target token id of each draft id
    cfg: ModelConfig = flax.struct.field(pytree_node=False)  # `head_config`
    layers: tuple[int, ...] = flax.struct.field(pytree_node=False)


def init_params(hcfg: ModelConfig, num_taps: int, rng) -> dict:
    """The head's params: fc_fd (n D, D); embed_norm, hidden_norm, mlp_norm, final_norm {scale_d: (D,)};
    layer {w_q_dnh (2 D, N, H), w_k_dkh, w_v_dkh (2 D, K, H), w_o_nhd (N, H, D), mlp {w_gate_df, w_up_df
    (D, F), w_down_fd (F, D)}}; head_dv (D, Vd)."""
    d, n, k, h, f = hcfg.d_model, hcfg.num_heads, hcfg.kv_heads, hcfg.head_size, hcfg.d_ff
    keys = iter(jax.random.split(rng, 9))

    def normal(*shape):
        return hcfg.init_std * jax.random.normal(next(keys), shape, jnp.float32)

    ones = lambda: {"scale_d": jnp.ones((d,), jnp.float32)}
    return {
        "fc_fd": normal(num_taps * d, d),
        "embed_norm": ones(), "hidden_norm": ones(), "mlp_norm": ones(), "final_norm": ones(),
        "layer": {
            "w_q_dnh": normal(2 * d, n, h), "w_k_dkh": normal(2 * d, k, h), "w_v_dkh": normal(2 * d, k, h),
            "w_o_nhd": normal(n, h, d),
            "mlp": {"w_gate_df": normal(d, f), "w_up_df": normal(d, f), "w_down_fd": normal(f, d)},
        },
        "head_dv": normal(d, hcfg.vocab_size),
    }  # fmt: skip


def project(head: Head, features_btf):
    """The target's tapped features (B, T, n D) projected to the head's input (B, T, D)."""
    return layers.dense(features_btf.astype(head.params["fc_fd"].dtype), head.params["fc_fd"])


def _inputs(head: Head, embed_vd, hidden_btd, tokens_bt, positions_bt):
    """Queries (B, T, N, H), keys and values (B, T, K, H) of the head's tokens."""
    p, hcfg = head.params, head.cfg
    e = quant.embed(embed_vd, tokens_bt, hidden_btd.dtype) if quant.is_q(embed_vd) else embed_vd[tokens_bt]
    e = layers.norm(e.astype(hidden_btd.dtype), p["embed_norm"], hcfg)
    x = jnp.concatenate([e, layers.norm(hidden_btd, p["hidden_norm"], hcfg)], axis=-1)  # the embedding first
    freq = jnp.asarray(layers.rope_frequencies(hcfg))
    q = layers.rope(layers.dense(x, p["layer"]["w_q_dnh"]), positions_bt, freq)
    k = layers.rope(layers.dense(x, p["layer"]["w_k_dkh"]), positions_bt, freq)
    return q, k, layers.dense(x, p["layer"]["w_v_dkh"])


def _outputs(head: Head, hidden_btd, attended_btnh):
    """The layer's output hidden state (B, T, D) (fed back when drafting on) and its logits (B, T, Vd)."""
    p, hcfg = head.params, head.cfg
    x = hidden_btd + layers.dense(attended_btnh, p["layer"]["w_o_nhd"], in_axes=2)
    x = x + layers.mlp(layers.norm(x, p["mlp_norm"], hcfg), p["layer"]["mlp"], hcfg)
    logits = jnp.matmul(layers.norm(x, p["final_norm"], hcfg), p["head_dv"], preferred_element_type=jnp.float32)
    return x, logits


def step(head: Head, embed_vd, hidden_btd, tokens_bt, positions_bt, cache):
    """One call of the head over T tokens with its cache (any `jaxgen.model.cache.Cache` of `head.cfg`):
    hidden (B, T, D) (projected features or the head's own outputs), the tokens that follow them (B, T),
    their positions (B, T) (-1: padding). Returns (hidden out (B, T, D), logits (B, T, Vd), cache)."""
    hcfg = head.cfg
    cache = cache.with_positions(positions_bt)
    q, k, v = _inputs(head, embed_vd, hidden_btd, tokens_bt, positions_bt)
    kv = cache.write(cache.arrays(), 0, k, v, positions_bt)
    out, kv = attention.cached_attention(q, cache, kv, 0, positions_bt, None, hcfg)
    hidden, logits = _outputs(head, hidden_btd, out.astype(hidden_btd.dtype))
    return hidden, logits, cache.advance(kv, tokens_bt.shape[1])


def to_target(head: Head, draft_ids):
    """Target token ids of draft ids (any shape)."""
    return jnp.take(head.draft_to_target, draft_ids)


def train_forward(head: Head, embed_vd, features_btf, tokens_bt, positions_bt, segment_ids_bt, k: int):
    """EAGLE-3's training-time test: k unrolled draft steps over whole sequences, without a cache.

    Step j's row t is the head at position t + j (positions_bt + j): fed the target's feature of row t and
    token t + 1 at j = 0, then its own hidden output of step j - 1 and token t + j + 1 (the sequence's own,
    so each step learns on the prefix that earlier drafts got right). Its attention sees the keys of step 0
    at rows <= t of its segment (what the head's cache holds of verified tokens when drafting) and its own
    keys of steps 1..j at row t (the drafts before it). Returns logits (k, B, T, Vd), step j's predicting
    token t + j + 2; rows past the sequence's end get token 0 (the caller masks their loss)."""
    hcfg = head.cfg
    b, t = tokens_bt.shape
    n, kh = hcfg.num_heads, hcfg.kv_heads
    hidden = project(head, features_btf)
    causal = attention.attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt)  # (B, T, T)
    keys0 = values0 = None
    diag_k, diag_v, out = [], [], []
    for j in range(k):
        tok = shift(tokens_bt, j + 1)
        pos = jnp.where(positions_bt >= 0, positions_bt + j, -1)
        q, kk, vv = _inputs(head, embed_vd, hidden, tok, pos)
        if j == 0:
            keys0, values0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        qg = q.reshape(b, t, kh, n // kh, -1).astype(jnp.float32) * attention.logit_scale(hcfg)
        s0 = jnp.einsum("btkgh,bskh->btkgs", qg, keys0.astype(jnp.float32))
        s0 = jnp.where(causal[:, :, None, None], s0, attention.NEG_INF)
        sd = [jnp.einsum("btkgh,btkh->btkg", qg, d.astype(jnp.float32))[..., None] for d in diag_k]
        probs = jax.nn.softmax(jnp.concatenate([s0, *sd], axis=-1), axis=-1)
        att = jnp.einsum("btkgs,bskh->btkgh", probs[..., :t], values0.astype(jnp.float32))
        for i, d in enumerate(diag_v):
            att = att + probs[..., t + i, None] * d.astype(jnp.float32)[:, :, :, None]
        hidden, logits = _outputs(head, hidden, att.reshape(b, t, n, -1).astype(hidden.dtype))
        out.append(logits)
    return jnp.stack(out)


def shift(x_bt, by: int):
    """x shifted left by `by` along T (x[:, t + by] at t, any trailing axes), zeros past the end."""
    return jnp.concatenate([x_bt[:, by:], jnp.zeros_like(x_bt[:, :by])], axis=1)


def frequent_tokens(tokens: np.ndarray, vocab_size: int, draft_vocab: int) -> np.ndarray:
    """The draft vocabulary: the `draft_vocab` most frequent token ids of `tokens` (ties by id), sorted
    (int32). Every id when `draft_vocab` is 0 or the whole vocabulary."""
    if not draft_vocab or draft_vocab >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    counts = np.bincount(np.asarray(tokens, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    top = np.argsort(-counts, kind="stable")[:draft_vocab]
    return np.sort(top).astype(np.int32)


def new_head(cfg: ModelConfig, rng, layers_: tuple[int, ...] = (), draft_to_target=None) -> Head:
    """A randomly initialised head for target `cfg` (tapped `layers_`, default `default_layers`)."""
    layers_ = check_layers(tuple(layers_) or default_layers(cfg.num_layers), cfg.num_layers)
    d2t = np.arange(cfg.vocab_size, dtype=np.int32) if draft_to_target is None else np.asarray(draft_to_target)
    hcfg = head_config(cfg, len(d2t))
    return Head(init_params(hcfg, len(layers_), rng), jnp.asarray(d2t, jnp.int32), hcfg, layers_)


def check_layers(layers_: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The tapped layers, ValueError unless each is 0..num_layers (the target's)."""
    for i in layers_:
        if not 0 <= i <= num_layers:
            raise ValueError(f"draft.layers: layer {i} is not allowed: 0..{num_layers} (the target's layers)")
    return layers_


def check_head(head: Head, cfg: ModelConfig) -> Head:
    """A head must fit its target: ValueError naming what differs."""
    if not isinstance(head, Head):
        raise ValueError(f"an EAGLE draft head must be a jaxgen.model.eagle.Head, got {type(head).__name__}")
    differs = []
    if head.cfg.d_model != cfg.d_model:
        differs.append(f"hidden size {head.cfg.d_model} vs the target's {cfg.d_model}")
    if head.params["fc_fd"].shape[0] != len(head.layers) * cfg.d_model:
        differs.append(f"fc input {head.params['fc_fd'].shape[0]} vs {len(head.layers)} x {cfg.d_model}")
    if max(head.layers) > cfg.num_layers:
        differs.append(f"tapped layers {head.layers} vs the target's {cfg.num_layers} layers")
    if int(np.max(np.asarray(head.draft_to_target))) >= cfg.vocab_size:
        differs.append(f"draft token ids reach {int(np.max(np.asarray(head.draft_to_target)))}, the target's "
                       f"vocabulary has {cfg.vocab_size}")  # fmt: skip
    if head.cfg.max_seq_len < cfg.max_seq_len:
        differs.append(f"max_seq_len {head.cfg.max_seq_len} vs the target's {cfg.max_seq_len}")
    if differs:
        raise ValueError("the EAGLE head does not fit this target: " + "; ".join(differs))
    return head


def quantized(head: Head) -> Head:
    """The head with its layer's matrix products in int8 (`quant.quantize_params`: q, k, v, o and the MLP, one
    scale per output channel), as `serve.quantize=int8` holds the target's; the input projection `fc_fd`
    and the draft vocabulary's `head_dv` stay as they are. Already int8: unchanged."""
    return head.replace(params=head.params | {"layer": quant.quantize_params(head.params["layer"])})


def with_max_len(head: Head, max_seq_len: int) -> Head:
    """The head reaching `max_seq_len` positions (RoPE: any)."""
    return head.replace(cfg=dataclasses.replace(head.cfg, max_seq_len=max_seq_len))
