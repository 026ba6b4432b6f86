"""Low-rank adapters (LoRA): each targeted product x @ W of a layer gains x @ A @ B * (alpha / rank).

    adapters = init_lora(cfg, rng)               # {target: {"a_...": (L, in..., r), "b_...": (L, r, out...)}}
    params = attach(base, adapters)              # the adapters at params["layers"]["lora"]
    logits, _ = forward(params, tokens, positions, cfg=cfg)
    base, adapters = detach(params)

The adapters ride in the params pytree under `params["layers"]["lora"]`, stacked on the L axis like
every layer weight, so the layer scan (and decoding's unstacking) slices them with the rest; a layer
whose params hold no "lora" key runs exactly as without this module. Targets: q, k, v, o of attention
and gate, up, down of a dense MLP (`ModelConfig.lora.targets`). A is (in, r), B is (r, out) with the
product's own axes (q's B is (r, N, H), o's A is (N, H, r)); PEFT stores lora_A as (r, in) and lora_B
as (out, r). B starts at zero, as in PEFT, so an untrained adapter changes nothing. The rank axis is
replicated (logical name None); the long side keeps the base weight's logical name.

DoRA (`model.lora.dora`, weight-decomposed LoRA as PEFT runs it): each target also holds a magnitude
"m_<out>" (L, *out), one per output feature, and its product becomes x @ W' with W' = m * V / ||V||,
V = W + A @ B * alpha / rank and the norm per output feature over the input axes. As PEFT (and DoRA's
section 4.3), the norm is held constant in the backward pass: no gradient flows through it. m starts at
||W|| (`init_lora` reads the base), so an untrained DoRA adapter changes nothing either.

Serving many adapters at once (`Bank`, the engine's multi-LoRA): up to M adapters stacked on a slot axis,
slot 0 all zeros (rows without an adapter), each row of the batch reading its own slot (Punica / S-LoRA's
gathered low-rank product):

    bank = init_bank(cfg, max_loras, max_rank)   # {target: {"a_..": (L, M + 1, *in, r), "b_..": (L, M + 1, r, *out)}}
    params = attach(base, Bank(bank))            # then decode_params: one Bank per layer
    logits, cache = forward(for_rows(params, slot_b), tokens, positions, cache, cfg=cfg)   # slot_b (B,) int32
    bank = write_slot(bank, slot, bank_entry(adapters, scale, bank))   # jitted, donated: no recompilation
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig
from jaxgen.config.model import LORA_TARGETS
from jaxgen.model.params import ParamSpec, flops_per_token
from jaxgen.sharding import named_sharding


def _product_axes(cfg: ModelConfig) -> dict:
    """{target: (input axes, output axes)}, each a tuple of (size, logical name, letter)."""
    D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff
    d, n, k, h, f = (D, "embed", "d"), (N, "heads", "n"), (K, "kv_heads", "k"), (H, "head_dim", "h"), (F, "mlp", "f")
    return {
        "q": ((d,), (n, h)), "k": ((d,), (k, h)), "v": ((d,), (k, h)), "o": ((n, h), (d,)),
        "gate": ((d,), (f,)), "up": ((d,), (f,)), "down": ((f,), (d,)),
    }  # fmt: skip


def lora_specs(cfg: ModelConfig) -> dict:
    """{target: {"a_<in>r": ParamSpec (L, *in, r), "b_r<out>": ParamSpec (L, r, *out)}} of the configured
    targets; "normal" marks A (drawn), "zeros" B. DoRA adds "m_<out>": ParamSpec (L, *out), "norms" (the
    base weight's, see `init_lora`)."""
    L, r = cfg.num_layers, cfg.lora.rank
    specs = {}
    for target in cfg.lora.targets:
        ins, outs = _product_axes(cfg)[target]
        a_name = "a_" + "".join(x[2] for x in ins) + "r"
        b_name = "b_r" + "".join(x[2] for x in outs)
        specs[target] = {
            a_name: ParamSpec((L, *(x[0] for x in ins), r), ("layers", *(x[1] for x in ins), None), "normal"),
            b_name: ParamSpec((L, r, *(x[0] for x in outs)), ("layers", None, *(x[1] for x in outs)), "zeros"),
        }
        if cfg.lora.dora:
            m_name = "m_" + "".join(x[2] for x in outs)
            specs[target][m_name] = ParamSpec((L, *(x[0] for x in outs)), ("layers", *(x[1] for x in outs)), "norms")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def lora_shardings(cfg: ModelConfig, mesh) -> dict:
    return jax.tree.map(lambda s: named_sharding(mesh, s.names, s.shape), lora_specs(cfg), is_leaf=_is_spec)


def init_lora(cfg: ModelConfig, rng: jax.Array, base: dict | None = None) -> dict:
    """Float32 adapters: A uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform_(a=sqrt(5))), B zeros.
    DoRA: each magnitude the norms of `base`'s weight per output feature (the layer-stacked params the
    adapters will ride on; needed then), as PEFT starts it: with B zero the adapted weight is W."""
    leaves, treedef = jax.tree.flatten(lora_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(rng, len(leaves))

    def make(spec: ParamSpec, key):
        if spec.init in ("zeros", "norms"):  # the norms are set below, from the base
            return jnp.zeros(spec.shape, jnp.float32)
        bound = 1.0 / math.sqrt(math.prod(spec.shape[1:-1]))  # fan_in: the input axes between L and r
        return jax.random.uniform(key, spec.shape, jnp.float32, -bound, bound)

    adapters = jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys, strict=True)])
    if not cfg.lora.dora:
        return adapters
    if base is None:
        raise ValueError("model.lora.dora: the magnitudes start at the base weights' norms, and no base was given")
    return with_norms(base, adapters, cfg)


def with_norms(base: dict, adapters: dict, cfg: ModelConfig) -> dict:
    """`adapters` (DoRA's) with each magnitude set to ||W + A @ B * scale|| per output feature, W `base`'s
    (layer-stacked) weight: the magnitudes that make the DoRA adapter act as the plain LoRA one."""
    out = {}
    for target, pair in adapters.items():
        a, b, m = parts(pair)
        w = _float(_base_weight(base, target))  # (L, *in, *out)
        norms = jax.vmap(weight_norms, in_axes=(0, 0, 0, None))(w, a, b, cfg.lora.scale)
        out[target] = pair | {_magnitude_key(pair): norms.astype(m.dtype)}
    return out


def parts(pair: dict) -> tuple:
    """(A, B, DoRA's magnitude or None) of one target's adapter: "a_..", "b_.." and "m_.." sort in that order."""
    a, b, *m = (pair[k] for k in sorted(pair))
    return a, b, (m[0] if m else None)


def _magnitude_key(pair: dict) -> str:
    return next(k for k in pair if k.startswith("m_"))


def is_dora(adapters: dict) -> bool:
    """Whether `adapters` ({target: {"a_..", "b_..", ...}}) carry DoRA's magnitudes."""
    return any(k.startswith("m_") for pair in adapters.values() for k in pair)


def _float(w) -> jax.Array:
    """A weight as a float32 array in its own shape (*in, *out), whatever its layout: int8 (`quant.QArray`)
    dequantized, decoding's output-major (`layout.OutMajor`) back to (I, O)."""
    from jaxgen.model import layout, quant

    if layout.is_out_major(w):
        w = w.in_major()
    return w.dequantize(jnp.float32) if quant.is_q(w) else w.astype(jnp.float32)


def weight_norms(w, a, b, scale: float) -> jax.Array:
    """||W + A @ B * scale|| per output feature, over the input axes: w (*in, *out), a (*in, r), b (r, *out) ->
    (*out) float32 (PEFT's get_weight_norm: the norm of each row of its (out, in) weight)."""
    r = a.shape[-1]
    n_in = a.size // r
    ab = jnp.dot(
        a.reshape(n_in, r).astype(jnp.float32), b.reshape(r, -1).astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )  # fmt: skip
    v = _float(w).reshape(n_in, -1) + ab * scale  # (in, out)
    return jnp.sqrt(jnp.sum(v * v, axis=0)).reshape(b.shape[1:])


def _base_weight(base: dict, target: str):
    node = base
    for key in TARGET_PARAMS[target]:
        node = node[key]
    return node


def count_lora(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(lora_specs(cfg), is_leaf=_is_spec))


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """`params.flops_per_token` for a LoRA step (for MFU): the frozen weights' products run forward and
    backward to their inputs (4 FLOPs per weight, not 6: no weight gradient), the adapters' all three ways."""
    weights = flops_per_token(cfg, 0)  # 6 per matrix weight, attention's scores left out (seq_len 0)
    return flops_per_token(cfg, seq_len) - weights / 3 + 6.0 * count_lora(cfg)


# --- serving many adapters: a bank of slots -------------------------------------------------------------


@flax.struct.dataclass
class Bank:
    """Up to M adapters of rank up to r stacked on a slot axis, for serving rows with different adapters in
    one batch. `weights`: {target: {"a_..": (M + 1, *in, r), "b_..": (M + 1, r, *out)}} for one layer (a
    leading L when stacked); slot 0 is all zeros (a row without an adapter), a smaller rank is padded with
    zeros, and B holds its scale (alpha / rank) already. `rows`: (B,) int32, each row's slot ((L, B) when
    stacked); None until `for_rows` gives it (the weights alone then, as the engine holds them)."""

    weights: dict
    rows: jax.Array | None = None


def bank_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The products a bank serves adapters on: attention's four, and a dense MLP's (gate only when gated)."""
    if cfg.num_experts:
        return ("q", "k", "v", "o")
    return tuple(t for t in LORA_TARGETS if not (t == "gate" and cfg.mlp == "gelu"))


def init_bank(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32) -> dict:
    """Zeros {target: {"a_..": (L, M + 1, *in, r), "b_..": (L, M + 1, r, *out)}} over `bank_targets`: the
    weights of a `Bank` of `max_loras` slots (and slot 0) of rank `max_rank`."""
    return {
        target: {name: jnp.zeros((s.shape[0], max_loras + 1, *s.shape[1:]), dtype) for name, s in pair.items()}
        for target, pair in _specs_of_rank(cfg, max_rank).items()
    }


def bank_bytes(cfg: ModelConfig, max_loras: int, max_rank: int) -> int:
    """Bytes of `init_bank`'s weights in the compute dtype (counted from shapes: nothing is allocated)."""
    size = sum(math.prod(s.shape) for s in jax.tree.leaves(_specs_of_rank(cfg, max_rank), is_leaf=_is_spec))
    return size * (max_loras + 1) * jnp.dtype(cfg.dtype).itemsize


def _specs_of_rank(cfg: ModelConfig, rank: int) -> dict:
    lora_cfg = dataclasses.replace(cfg.lora, rank=rank, targets=bank_targets(cfg))
    return lora_specs(dataclasses.replace(cfg, lora=lora_cfg))


def bank_entry(adapters: dict, scale: float, bank: dict) -> dict:
    """One slot's weights (host arrays) for `bank` (`init_bank`'s structure, stacked or a list of layers'):
    `adapters` ({target: {"a_..": (L, *in, r), "b_..": (L, r, *out)}}, `init_lora`'s layout) with B times
    `scale`, the rank padded with zeros to the bank's, every target the adapters lack all zeros. ValueError
    naming the target or the rank when they do not fit the bank, or when a weight is NaN or infinite."""
    if not math.isfinite(scale):
        raise ValueError(f"adapter scale {scale} is not a finite number")
    layers_ = bank if isinstance(bank, list) else None
    ref = layers_[0] if layers_ is not None else jax.tree.map(lambda w: w[0], bank)  # one layer: (M + 1, ...)
    num_layers = len(layers_) if layers_ is not None else jax.tree.leaves(bank)[0].shape[0]
    if is_dora(adapters):  # its rows would need W' = m * V / ||V||: a factor per slot the bank does not hold
        raise ValueError("it is a DoRA adapter (use_dora): the adapter bank serves plain LoRA only; merge it first")
    unknown = sorted(set(adapters) - set(ref))
    if unknown:
        raise ValueError(f"adapter target {unknown[0]} is not served: the adapter bank holds {', '.join(ref)}")
    entry = {}
    for target, pair in ref.items():
        (a_name, a_ref), (b_name, b_ref) = sorted(pair.items())
        a_shape, b_shape = (num_layers, *a_ref.shape[1:]), (num_layers, *b_ref.shape[1:])
        a, b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
        if target in adapters:
            got_a, got_b = (np.asarray(adapters[target][k], np.float32) for k in sorted(adapters[target]))
            r = got_a.shape[-1]
            if r > a_shape[-1]:
                raise ValueError(f"adapter rank {r} is above serve.max_lora_rank={a_shape[-1]}")
            if got_a.shape != (*a_shape[:-1], r) or got_b.shape != (num_layers, r, *b_shape[2:]):
                raise ValueError(
                    f"adapter target {target}: A {got_a.shape} and B {got_b.shape} do not fit this model "
                    f"(A (L, *in, r) = {(*a_shape[:-1], r)}, B (L, r, *out) = {(num_layers, r, *b_shape[2:])})"
                )
            if not (np.isfinite(got_a).all() and np.isfinite(got_b).all()):  # one NaN would spread through every row
                raise ValueError(f"adapter target {target} has weights that are NaN or infinite: finite numbers only")
            a[..., :r] = got_a
            b[:, :r] = got_b * scale
        entry[target] = {a_name: a, b_name: b}
    return entry


def write_slot(bank, slot, entry: dict):
    """`bank` (stacked, or a list of layers' weights) with slot `slot` (() int32) holding `entry`
    (`bank_entry`); jit it with the bank donated: the slot is written in place, nothing recompiles."""
    if isinstance(bank, list):
        return [
            jax.tree.map(lambda w, e, i=i: w.at[slot].set(e[i].astype(w.dtype)), layer, entry)
            for i, layer in enumerate(bank)
        ]
    return jax.tree.map(lambda w, e: w.at[:, slot].set(e.astype(w.dtype)), bank, entry)


def bank_of(params: dict):
    """The bank's weights in `params` (stacked, or a list of layers' when decoding), or None."""
    layers_ = params["layers"]
    if isinstance(layers_, list):
        banks = [p.get("lora") for p in layers_]
        return [b.weights for b in banks] if banks and isinstance(banks[0], Bank) else None
    bank = layers_.get("lora")
    return bank.weights if isinstance(bank, Bank) else None


def without_bank(params: dict) -> dict:
    """`params` without their bank (the weights alone); `params` itself when they hold none."""
    if bank_of(params) is None:
        return params
    layers_ = params["layers"]
    if isinstance(layers_, list):
        return params | {"layers": [{k: v for k, v in p.items() if k != "lora"} for p in layers_]}
    return params | {"layers": {k: v for k, v in layers_.items() if k != "lora"}}


def with_bank(params: dict, weights) -> dict:
    """`params` with the bank's weights replaced by `weights` (as `bank_of` gives them)."""
    layers_ = params["layers"]
    if isinstance(layers_, list):
        return params | {"layers": [p | {"lora": Bank(w)} for p, w in zip(layers_, weights, strict=True)]}
    return params | {"layers": layers_ | {"lora": Bank(weights)}}


def for_rows(params: dict, rows):
    """`params` whose bank reads slot `rows[b]` (B,) int32 for row b; `params` itself when `rows` is None
    or there is no bank."""
    if rows is None or bank_of(params) is None:
        return params
    layers_ = params["layers"]
    if isinstance(layers_, list):
        return params | {"layers": [p | {"lora": p["lora"].replace(rows=rows)} for p in layers_]}
    num_layers = jax.tree.leaves(layers_["lora"].weights)[0].shape[0]
    stacked_rows = jnp.broadcast_to(rows, (num_layers, *rows.shape))  # the layer scan slices it with the rest
    return params | {"layers": layers_ | {"lora": layers_["lora"].replace(rows=stacked_rows)}}


def _gathered_delta(x, bank: Bank, target: str, in_axes: int):
    """What row b's adapter (slot `bank.rows[b]`) adds to its product of x (B, ..., *in); None when the bank
    lacks `target`. Rows no more than slots (a prefill's one row): each row gathers its A (*in, r) and
    B (r, *out), two thin batched products. More rows than slots (decoding): every slot's A at once, each row
    keeping its own slot's r columns (the others times zero), then every slot's B: two plain products that
    read the bank once, where gathering would read an adapter per row."""
    if target not in bank.weights:
        return None
    a, b = (bank.weights[target][k] for k in sorted(bank.weights[target]))  # (M + 1, *in, r), (M + 1, r, *out)
    rows = bank.rows.astype(jnp.int32)
    n, slots, r = x.shape[0], a.shape[0], a.shape[-1]
    n_in = math.prod(a.shape[1 : 1 + in_axes])
    x3 = x.reshape(n, -1, n_in)  # (B, T, in)
    if n <= slots:
        a_rows = a[rows].reshape(n, n_in, r).astype(x.dtype)  # (B, in, r)
        b_rows = b[rows].reshape(n, r, -1).astype(x.dtype)  # (B, r, out)
        y = jnp.einsum("btr,bro->bto", jnp.einsum("bti,bir->btr", x3, a_rows), b_rows)
    else:
        own = jax.nn.one_hot(rows, slots, dtype=x.dtype)  # (B, M + 1): 1 at the row's slot
        low = jnp.einsum("bti,mir->btmr", x3, a.reshape(slots, n_in, r).astype(x.dtype)) * own[:, None, :, None]
        y = jnp.einsum("btmr,mro->bto", low, b.reshape(slots, r, -1).astype(x.dtype))  # (B, T, out)
    return y.reshape(*x.shape[: x.ndim - in_axes], *b.shape[2:])


def attach(base: dict, adapters: dict) -> dict:
    """The params with `adapters` (of `init_lora`'s structure) at params["layers"]["lora"]."""
    return base | {"layers": base["layers"] | {"lora": adapters}}


def detach(params: dict) -> tuple[dict, dict | None]:
    """(the params without adapters, the adapters or None)."""
    layers_ = dict(params["layers"])
    adapters = layers_.pop("lora", None)
    return params | {"layers": layers_}, adapters


def delta(x, adapters: dict | None, target: str, cfg: ModelConfig, in_axes: int = 1):
    """What the adapter of `target` adds to its product of x (..., *in): (x @ A) @ B * alpha / rank, shaped
    (..., *out), or None when this layer has no adapter there (nothing is computed). A `Bank`: each row's own."""
    if isinstance(adapters, Bank):
        return _gathered_delta(x, adapters, target, in_axes)
    if adapters is None or target not in adapters:
        return None
    a, b, _ = parts(adapters[target])
    n_in = math.prod(a.shape[:in_axes])
    lead = x.shape[: x.ndim - in_axes]
    low = x.reshape(-1, n_in) @ a.reshape(n_in, -1)  # (R, r): two thin products, never the (in, out) matrix
    y = (low @ b.reshape(b.shape[0], -1)) * jnp.asarray(cfg.lora.scale, low.dtype)
    return y.reshape(*lead, *b.shape[1:])


def add(y, x, adapters: dict | None, target: str, cfg: ModelConfig, in_axes: int = 1, w=None):
    """y plus `delta` (y itself, untouched, without an adapter for `target`). DoRA: (y + delta) * m / ||V||,
    V = `w` (the product's weight, (*in, *out)) + A @ B * scale, the norm held constant for the gradient
    (as PEFT: `weight_norm.detach()`), so that m, A and B train as they do there."""
    d = delta(x, adapters, target, cfg, in_axes)
    if d is None:
        return y
    y = y + d.astype(y.dtype)
    a, b, m = (None, None, None) if isinstance(adapters, Bank) else parts(adapters[target])
    if m is None:
        return y
    norms = jax.lax.stop_gradient(weight_norms(w, a, b, cfg.lora.scale))  # (*out)
    return y * (m.astype(jnp.float32) / norms).astype(y.dtype)


TARGET_PARAMS = {  # target -> the path of the (layer-stacked) base weight it adapts
    "q": ("layers", "w_q_dnh"), "k": ("layers", "w_k_dkh"), "v": ("layers", "w_v_dkh"), "o": ("layers", "w_o_nhd"),
    "gate": ("layers", "mlp", "w_gate_df"), "up": ("layers", "mlp", "w_up_df"), "down": ("layers", "mlp", "w_down_fd"),
}  # fmt: skip


def merge(base: dict, adapters: dict, cfg: ModelConfig) -> dict:
    """The base params (as trained: layers stacked, no adapters attached) with each target's weight
    W (L, *in, *out) replaced by W + A @ B * alpha / rank, computed in float32 and cast back to W's dtype;
    DoRA: by m * V / ||V||, V that sum, the norm per output feature (what `add` computes, in one weight).

    An int8 weight (`jaxgen.model.quant.QArray`) is dequantized and comes back as a float32 array:
    quantizing again would round most of the (small) update away. Everything else is returned as it is.
    One jitted program for the whole tree; the result keeps the base weights' shardings."""
    return _merge(base, adapters, cfg.lora.scale)


@functools.partial(jax.jit, static_argnames="scale")
def _merge(base: dict, adapters: dict, scale: float) -> dict:
    from jaxgen.model import quant

    out = jax.tree.map(lambda x: x, base, is_leaf=quant.is_q)  # new dicts, the same leaves
    for target, pair in adapters.items():
        *parents, name = TARGET_PARAMS[target]
        node = out
        for key in parents:
            node = node[key]
        w = node[name]
        a, b, m = parts(pair)  # A (L, *in, r), B (L, r, *out), DoRA's m (L, *out) or None
        L, r = a.shape[0], a.shape[-1]
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        ab = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1), precision=jax.lax.Precision.HIGHEST)
        w32 = _float(w)
        merged = w32.reshape(ab.shape) + ab * scale  # (L, in, out)
        if m is not None:  # W' = m * V / ||V||, the norm over the input axis
            norms = jnp.sqrt(jnp.sum(merged * merged, axis=1, keepdims=True))
            merged = merged * (m.reshape(L, 1, -1).astype(jnp.float32) / norms)
        merged = merged.reshape(w32.shape)
        node[name] = merged if quant.is_q(w) else merged.astype(w.dtype)
    return out
