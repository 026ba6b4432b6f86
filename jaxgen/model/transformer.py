"""The decoder-only transformer: the pure forward pass over the parameters of `jaxgen.model.params`.

    params = init_params(cfg, rng)                                        # jaxgen.model.params
    logits, _ = forward(params, tokens, positions, cfg=cfg)               # training: cache=None
    logits, cache = forward(params, tokens, positions, cache, cfg=cfg)    # prefill / decode

Parameters are a nested dict of arrays. Per-layer weights are stacked on a leading L axis and run
with `lax.scan`, so training's compile time does not grow with depth; with a cache, layers run as a
Python loop (the contiguous cache holds one buffer per layer, see `jaxgen.model.kvcache`). Names
end with their per-layer axes (`w_q_dnh` is stored as (L, D, N, H)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig
from jaxgen.model import attention, kernels, layers, layout, lora, moe, quant
from jaxgen.model.cache import Cache
from jaxgen.sharding import axis_size, constrain

# --- forward ---------------------------------------------------------------------------------------


def forward(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Cache | None = None,
    *,
    cfg: ModelConfig,
    segment_ids: jax.Array | None = None,
    with_aux: bool = False,
    fresh: bool = False,
    taps: tuple[int, ...] = (),
):
    """Logits for every position, and the updated cache.

    tokens, positions: (B, T) int32; a position of -1 marks padding, never attended to.
    segment_ids: (B, T) int32 or None; packed documents do not attend across segments
        (training only: a cache holds one sequence per row).
    cache: None for a training pass over whole sequences; or a cache to prefill or decode (any type
        of the contract `jaxgen.model.cache.Cache`: a `KVCache`, whose slots [end, end + T)
        receive this call's keys and values, or the serving engine's `PagedCache`, where each token
        goes to its row's page for its position). The model never asks which.
    fresh: a static promise that this call is a whole prompt's prefill: each row's tokens are its whole
        sequence (positions 0, 1, ... then -1 padding) and the cache holds nothing of these rows (a
        `KVCache` just made by `init`; a slot's own empty pages). Attention then runs over this call's
        keys alone, by the implementation training uses (on a mesh with a context axis: ring or
        allgather, each device its share of the prompt's queries), and the cache only stores the keys
        (`attention.store_prompt`). Refused without a cache, with segment ids, or with a prompt length
        the context axis does not split (the rule of `context.check_fit`).
    taps: layer indices (static; 0..L, L = the last layer's output) whose input residual stream is also
        returned, concatenated: features (B, T, len(taps) * D) for an EAGLE-3 draft head (`model.eagle`).
    Returns logits (B, T, V) float32 and the cache (None when none was given), then the tapped features
    when `taps` is given; with `with_aux`, also
    the auxiliary losses {"router_aux": the load-balancing loss over all layers, "router_z": the
    z-loss's mean over layers} (mixture of experts; zeros for a dense model).
    """
    x, cache, aux, tapped = _run(params, tokens, positions, cache, cfg, segment_ids, fresh, taps)
    logits = lm_head(params, x, cfg)
    return (logits, cache) + ((tapped,) if taps else ()) + ((aux,) if with_aux else ())


def hidden_states(
    params, tokens, positions, cache=None, *, cfg: ModelConfig, segment_ids=None, with_aux=False, fresh=False,
    taps: tuple[int, ...] = (),
):  # fmt: skip
    """The final-normed hidden states (B, T, D) and the cache (then, as in `forward`, the tapped features
    with `taps` and the router losses with `with_aux`): `forward` without the LM head, for callers that
    need logits at a few positions only (prefill needs the last one) or compute the head in chunks."""
    x, cache, aux, tapped = _run(params, tokens, positions, cache, cfg, segment_ids, fresh, taps)
    return (x, cache) + ((tapped,) if taps else ()) + ((aux,) if with_aux else ())


def layer_constants(cfg: ModelConfig) -> dict:
    """What differs between layers beside their weights, as arrays with a leading L axis that the layer
    scan carries (so a pattern of local and global layers keeps one stacked, scanned layer):
    "window" (L,) int32, a huge number on global layers (only with a sliding window), and "inv_freq"
    (L, H/2), the rotary frequencies of each layer (only with RoPE)."""
    consts = {"index": np.arange(cfg.num_layers, dtype=np.int32)}
    if cfg.sliding_window is not None:
        wide = np.iinfo(np.int32).max
        consts["window"] = np.array(
            [wide if cfg.is_global(i) else cfg.sliding_window for i in range(cfg.num_layers)], np.int32
        )
    if cfg.position == "rope":
        glob = np.asarray(layers.rope_frequencies(cfg))
        local = glob if cfg.rope_local_theta is None else np.asarray(layers.rope_frequencies(cfg, cfg.rope_local_theta))
        consts["inv_freq"] = np.stack([glob if cfg.is_global(i) else local for i in range(cfg.num_layers)])
    return consts


def _run(params, tokens, positions, cache, cfg: ModelConfig, segment_ids, fresh=False, taps=()):
    """The embedding, every layer and the final norm: (B, T, D), the cache, the mean auxiliary losses and
    the residual stream entering each layer of `taps` (L: after the last), concatenated (B, T, n D) or None."""
    for i in taps:
        if not 0 <= i <= cfg.num_layers:
            raise ValueError(f"tap layer {i} is not allowed: 0..{cfg.num_layers} (num_layers)")
    if fresh:
        attention.check_prompt(cache, segment_ids, tokens.shape[1], cfg)
    params = _cast(params, cfg)
    x = _embed(params, tokens, positions, cfg)

    t = tokens.shape[1]
    if cache is None or fresh:  # whole sequences (a fresh prompt's too): the backend's attention_impl
        impl = kernels.fit_length(kernels.choose(cfg), t, cfg)
        # dense: the whole (T, T) mask once, windowed per layer; cudnn: its segment mask once, shared by
        # every layer; blockwise and splash mask block by block
        mask = None
        if impl == "dense":
            mask = attention.attention_mask(positions, positions, segment_ids, segment_ids)
        elif impl == "cudnn":
            mask = kernels.cudnn_mask(positions, segment_ids)
        kv = None
    if cache is not None:  # decoding: masks are built block by block, over the cache blocks in use only
        cache = cache.with_positions(positions)
        kv = cache.arrays()  # keys, values (and int8 scales), written layer by layer

    def layer_step(carry, xs):
        x, kv, tapped = carry
        p, consts = xs
        tapped = tuple(jnp.where(consts["index"] == i, x, old) for i, old in zip(taps, tapped, strict=True))
        if cache is None:
            attend = functools.partial(
                _attend_plain, impl=impl, mask=mask, positions=positions, segment_ids=segment_ids, cfg=cfg
            )
        elif fresh:  # a whole prompt: attention as above, its keys then stored
            attend = functools.partial(
                _attend_prompt, cache=cache, kv=kv, impl=impl, mask=mask, positions=positions, cfg=cfg
            )
        else:
            attend = functools.partial(_attend_cache, cache=cache, kv=kv, positions=positions, cfg=cfg)
        x, kv, aux = _block(x, p, positions, consts, attend, cfg)
        return (x, kv, tapped), aux

    if cache is None and cfg.remat != "none":  # recompute in the backward pass what the policy does not keep
        # layers unrolled (the planner's counting compiles) need the recompute kept apart from the forward it
        # repeats, or the compiler merges the two and counts no recompute; a scan's body is apart already
        unrolled = isinstance(params["layers"], list)
        layer_step = jax.checkpoint(layer_step, policy=remat_policy(cfg.remat), prevent_cse=unrolled)
    consts = layer_constants(cfg)
    if cache is not None:  # caches index their layers statically (one buffer each): a Python loop
        params = unstack_layers(params)  # a no-op on what decoding holds (`decode_params`)
    (x, kv, tapped), aux = _over_layers(layer_step, (x, kv, tuple(jnp.zeros_like(x) for _ in taps)),
                                        params["layers"], consts)  # fmt: skip
    tapped = tuple(x if i == cfg.num_layers else old for i, old in zip(taps, tapped, strict=True))
    x = layers.norm(x, params["final_norm"], cfg)
    router = {"router_aux": moe.balance_loss(aux["share"], aux["mean_prob"]), "router_z": aux["router_z"].mean()}
    features = jnp.concatenate(tapped, axis=-1) if taps else None
    return x, (None if cache is None else cache.advance(kv, t)), router, features


def _embed(params, tokens, positions, cfg: ModelConfig):
    """(B, T, D): token embeddings, scaled (Gemma) and with learned positions (GPT-2) where configured."""
    embedding = params["embed_vd"]
    rows = lambda ids: quant.embed(embedding, ids, cfg.dtype) if quant.is_q(embedding) else embedding[ids]
    if tokens.size == 1 and axis_size("tensor") > 1:
        # one token in all (decoding at batch 1) over a vocabulary split over devices is looked up twice:
        # XLA:GPU makes a gather of one row a dynamic-slice, and its partitioner then gathers the table whole
        # on every device, every step (Llama 3.2 1B on 8 GPUs: 525 MB a step); a gather of two rows is
        # partitioned as a lookup per shard and a sum (docs/accelerators.md, "Decode against the HBM floor")
        x = rows(jnp.concatenate([tokens, tokens]))[:1]
    else:
        x = rows(tokens)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
    if cfg.position == "learned":
        x = x + params["pos_embed_td"][jnp.clip(positions, 0, cfg.max_seq_len - 1)]
    return constrain(x, ("batch", "seq", "act_embed"))


def _over_layers(layer_step, carry, layer_params, consts):
    """`layer_step` over every layer: a Python loop over unstacked layers (a list: caches index their
    layers statically), else `lax.scan` over the stacked L axis. Returns the carry and the stacked aux."""
    if not isinstance(layer_params, list):
        return jax.lax.scan(layer_step, carry, (layer_params, consts))
    auxes = []
    for i, p in enumerate(layer_params):
        carry, aux = layer_step(carry, (p, {k: v[i] for k, v in consts.items()}))
        auxes.append(aux)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


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


def decode_params(params: dict, rows: int, cfg: ModelConfig | None = None) -> dict:
    """The params as decoding reads them: per-layer (`unstack_layers`) and, for products of at least
    `layout.OUT_MAJOR_ROWS` rows (`rows`: the batch decoded together), output-major weights
    (`layout.decode_layout`). Idempotent; `layout.train_layout` undoes the second step. A deterministic
    `cfg` keeps the weights as trained: its tiled products are the training forward's (`_block_tiled`).
    With `cfg`, float weights wider than its compute dtype are held in it, cast once (`_cast`): inside a
    decode loop `forward`'s own cast ran at every step, on a GPU a kernel per weight moving three times its
    bfloat16 bytes (the float32 read, the copy written and read again)."""
    params = unstack_layers(params if cfg is None else _cast(params, cfg, wider_only=True))  # cast first: less held
    return layout.decode_layout(params, 1 if cfg is not None and cfg.deterministic else rows)


def stack_layers(params: dict) -> dict:
    """The inverse of `unstack_layers`: `layers` as stacked (L, ...) arrays (a copy of the weights).

    For a small model's forward pass of a few tokens per row (speculative decoding's W + 1): on XLA:CPU
    with d_model 192 such products against per-layer matrices took about twice as long as against slices
    of the stack (with d_model 768 the other way round: see `Generator._stacked_params`).
    """
    layers_ = params["layers"]
    if not isinstance(layers_, list):
        return params
    return params | {"layers": jax.tree.map(lambda *w: jnp.stack(w), *layers_)}


def lm_head(params, x_btd, cfg: ModelConfig):
    """Logits (B, T, V) float32 from hidden states; the head is the embedding when tied."""
    params = _cast(params, cfg)
    x = x_btd.reshape(-1, x_btd.shape[-1])  # 2-D products: see layers.dense
    w = params["embed_vd"] if cfg.tie_embeddings else params["head_dv"]
    if cfg.deterministic:  # per tile of rows (layers.per_tile), the weight as trained
        return constrain(_head_tiles(x, w, cfg).reshape(*x_btd.shape[:-1], -1), ("batch", "seq", "vocab"))
    if quant.is_q(w):  # int8 (inference, `quant.quantize_params(embedding=True)`)
        logits = quant.head(x, w, cfg.tie_embeddings)
    elif cfg.tie_embeddings:  # contract with the embedding's rows as stored: `.T` made XLA copy it each step
        contract_d = (((1,), (1,)), ((), ()))
        head = lambda x2: jax.lax.dot_general(x2, params["embed_vd"], contract_d, preferred_element_type=jnp.float32)
        logits = layers.of_rows(head, x)
    elif layout.is_out_major(w):  # decoding's (V, D) head: see jaxgen.model.layout
        logits = layout.product(x, w, jnp.float32)
    else:
        logits = layers.of_rows(lambda x2: jnp.matmul(x2, params["head_dv"], preferred_element_type=jnp.float32), x)
    logits = layers.softcap(logits.reshape(*x_btd.shape[:-1], -1), cfg.final_softcap)
    return constrain(logits, ("batch", "seq", "vocab"))


def _head_tiles(x, w, cfg: ModelConfig):
    """Deterministic mode's head: (R, D) -> (R, V) float32, one product (and softcap) per tile of rows."""
    if quant.is_q(w) or layout.is_out_major(w):
        raise ValueError(f"model.deterministic: a float head as trained only, got {type(w).__name__}")
    contract = (((1,), (1 if cfg.tie_embeddings else 0,)), ((), ()))  # the embedding's rows as stored

    def head(t, w):
        logits = jax.lax.dot_general(t, w, contract, preferred_element_type=jnp.float32)
        return layers.softcap(logits, cfg.final_softcap)

    return layers.per_tile(head, x, consts=(w,))


def _cast(params, cfg: ModelConfig, wider_only: bool = False):
    """The params in the compute dtype (`wider_only`: those floats wider than it, the rest as they are); int8
    weights (`jaxgen.model.quant`) stay int8, and integer arrays (a LoRA bank's row slots,
    `jaxgen.model.lora.Bank`) stay integers."""
    dtype = jnp.dtype(cfg.dtype)

    def cast(p):
        kept = quant.is_q(p) or not jnp.issubdtype(p.dtype, jnp.floating)
        return p if kept or (wider_only and p.dtype.itemsize <= dtype.itemsize) else p.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=quant.is_q)


def _qkv(x, p, positions, consts, cfg: ModelConfig):
    """Queries (B, T, N, H) and keys and values (B, T, K, H) of the (normed) input: biased, q and k
    normed (qk_norm), then rotated (RoPE, with this layer's frequencies)."""
    h = layers.norm(x, p["attn_norm"], cfg) if "attn_norm" in p else x
    adapters = p.get("lora")  # low-rank adapters (jaxgen.model.lora); None: the products alone
    q = lora.add(layers.dense(h, p["w_q_dnh"]), h, adapters, "q", cfg, w=p["w_q_dnh"])  # (B, T, N, H)
    k = lora.add(layers.dense(h, p["w_k_dkh"]), h, adapters, "k", cfg, w=p["w_k_dkh"])  # (B, T, K, H)
    v = lora.add(layers.dense(h, p["w_v_dkh"]), h, adapters, "v", cfg, w=p["w_v_dkh"])
    if layers.split_tokens(q.shape[:2]):  # each token's activations on the device of its chunk
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k, v = (constrain(a, ("batch", "seq", "kv_heads", "head_dim")) for a in (k, v))
    if "b_q_nh" in p:
        q, k, v = q + p["b_q_nh"], k + p["b_k_kh"], v + p["b_v_kh"]
    if cfg.qk_norm != "none":
        q = layers.rms_norm(q, p.get("q_norm_h", p.get("q_norm_nh")), cfg)
        k = layers.rms_norm(k, p.get("k_norm_h", p.get("k_norm_kh")), cfg)
    if cfg.position == "rope":
        q = layers.rope(q, positions, consts["inv_freq"])
        k = layers.rope(k, positions, consts["inv_freq"])
    return q, k, v


def _block(x, p, positions, consts, attend, cfg: ModelConfig):
    """One transformer block, its norms where `norm_placement` puts them. `attend(q, k, v, consts) ->
    (out, kv)` is plain attention (kv None) or cached attention (kv: the cache's keys and values, this
    layer's written). Returns x, kv and the layer's auxiliary losses."""
    if cfg.deterministic:
        return _block_tiled(x, p, positions, consts, attend, cfg)
    q, k, v = _qkv(x, p, positions, consts, cfg)
    out, kv = attend(q, k, v, consts)
    x, aux = _after_attention(x, out, p, positions, cfg)
    return constrain(x, ("batch", "seq", "act_embed")), kv, aux


def _after_attention(x, out, p, positions, cfg: ModelConfig):
    """The rest of a block once attention gave `out` (B, T, N, H): its projection, the residual, the MLP.
    Returns x (B, T, D) and the layer's auxiliary losses."""
    adapters = p.get("lora")
    o = layers.dense(out, p["w_o_nhd"], in_axes=2)  # (B, T, D)
    out = lora.add(o, out, adapters, "o", cfg, in_axes=2, w=p["w_o_nhd"])
    if "b_o_d" in p:
        out = out + p["b_o_d"]
    if "post_attn_norm" in p:
        out = layers.norm(out, p["post_attn_norm"], cfg)
    x = x + out
    h = layers.norm(x, p["mlp_norm"], cfg) if "mlp_norm" in p else x
    if cfg.num_experts:
        out, aux = moe.mlp(h, p["mlp"], positions >= 0, cfg)
    else:
        out, aux = layers.mlp(h, p["mlp"], cfg, adapters), _NO_ROUTER
    if "post_mlp_norm" in p:
        out = layers.norm(out, p["post_mlp_norm"], cfg)
    return x + out, aux


def _block_tiled(x, p, positions, consts, attend, cfg: ModelConfig):
    """`_block` in deterministic mode: what comes before attention (norm, products, qk-norm, RoPE) and what
    comes after (projection, residual, MLP) each run as one loop over tiles of tokens (`layers.per_tile`),
    their operations those of the plain block on a tile, and attention as the tiled fold. A token's
    numbers then come from the same two loop bodies wherever it is (training, prefill, decode), and a
    layer runs two loops rather than one per operation. Dense MLPs only (the config refuses experts)."""
    special = lambda w: layout.is_out_major(w) or quant.is_q(w)  # (the engine keeps a deterministic model's as trained)
    for w in jax.tree.leaves(p, is_leaf=special):
        if special(w):
            raise ValueError(f"model.deterministic: float (I, O) weights only, got {type(w).__name__}")
    plain = dataclasses.replace(cfg, deterministic=False)
    b, t = positions.shape
    rows = lambda a: a.reshape(b * t, *a.shape[2:])
    back = lambda a: a.reshape(b, t, *a.shape[1:])

    def before(x_r, pos_r, p, consts):  # a tile's tokens as (R, 1) rows
        return tuple(y[:, 0] for y in _qkv(x_r[:, None], p, pos_r[:, None], consts, plain))

    def after(x_r, out_r, pos_r, p):
        return _after_attention(x_r[:, None], out_r[:, None], p, pos_r[:, None], plain)[0][:, 0]

    q, k, v = map(back, layers.per_tile(before, rows(x), rows(positions), consts=(p, consts)))
    out, kv = attend(q, k, v, consts)
    x = back(layers.per_tile(after, rows(x), rows(out), rows(positions), consts=(p,)))
    return constrain(x, ("batch", "seq", "act_embed")), kv, _NO_ROUTER


# A dense MLP's router statistics: no experts (numpy, so importing this module starts no JAX backend).
_NO_ROUTER = {"share": np.zeros((0,), np.float32), "mean_prob": np.zeros((0,), np.float32), "router_z": np.float32(0)}


def _attend_plain(q, k, v, consts, *, impl, mask, positions, segment_ids, cfg: ModelConfig):
    window = consts.get("window")  # None without a sliding window
    if impl == "cudnn":
        return kernels.cudnn_attention(q, k, v, mask, window, cfg, scale=attention.logit_scale(cfg)), None
    if impl != "dense":
        return attention.sequence_attention(q, k, v, positions, segment_ids, window, cfg, impl=impl), None
    if window is not None:  # this layer's window on top of the shared causal mask
        mask = mask & (positions[:, :, None] - positions[:, None, :] < window)
    return attention.dense_attention(q, k, v, mask, cfg), None


def _attend_prompt(q, k, v, consts, *, cache, kv, positions, cfg: ModelConfig, **plain):
    """A whole prompt (`forward`'s `fresh`): attention over its own keys as in training (context-parallel
    on a context mesh), then its keys and values stored in the cache (`attention.store_prompt`)."""
    out, _ = _attend_plain(q, k, v, consts, positions=positions, segment_ids=None, cfg=cfg, **plain)
    return out, attention.store_prompt(cache, kv, consts["index"], k, v, positions)


def remat_policy(name: str):
    """The `jax.checkpoint` policy of `model.remat` (see ModelConfig): what the layer keeps."""
    policies = jax.checkpoint_policies
    return {
        "full": None,  # nothing saved: the whole layer is recomputed from its input
        "dots": policies.checkpoint_dots,
        "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
        "offload_dots": policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    }[name]


def _attend_cache(q, k, v, consts, *, cache, kv, positions, cfg: ModelConfig):
    """Writes this layer's keys and values into the cache, then attends over the cache's blocks in use."""
    layer = consts["index"]
    kv = cache.write(kv, layer, k, v, positions)
    return attention.cached_attention(q, cache, kv, layer, positions, consts.get("window"), cfg)
