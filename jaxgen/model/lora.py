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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxgen.config import ModelConfig
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
    targets; "normal" marks A (drawn), "zeros" B."""
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
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def lora_shardings(cfg: ModelConfig, mesh) -> dict:
    return jax.tree.map(lambda s: named_sharding(mesh, s.names, s.shape), lora_specs(cfg), is_leaf=_is_spec)


def init_lora(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Float32 adapters: A uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform_(a=sqrt(5))), B zeros."""
    leaves, treedef = jax.tree.flatten(lora_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(rng, len(leaves))

    def make(spec: ParamSpec, key):
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, jnp.float32)
        bound = 1.0 / math.sqrt(math.prod(spec.shape[1:-1]))  # fan_in: the input axes between L and r
        return jax.random.uniform(key, spec.shape, jnp.float32, -bound, bound)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys, strict=True)])


def count_lora(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(lora_specs(cfg), is_leaf=_is_spec))


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """`params.flops_per_token` for a LoRA step (for MFU): the frozen weights' products run forward and
    backward to their inputs (4 FLOPs per weight, not 6: no weight gradient), the adapters' all three ways."""
    weights = flops_per_token(cfg, 0)  # 6 per matrix weight, attention's scores left out (seq_len 0)
    return flops_per_token(cfg, seq_len) - weights / 3 + 6.0 * count_lora(cfg)


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
    (..., *out), or None when this layer has no adapter there (nothing is computed)."""
    if adapters is None or target not in adapters:
        return None
    a, b = (adapters[target][k] for k in sorted(adapters[target]))  # "a_..." sorts before "b_..."
    n_in = math.prod(a.shape[:in_axes])
    lead = x.shape[: x.ndim - in_axes]
    low = x.reshape(-1, n_in) @ a.reshape(n_in, -1)  # (R, r): two thin products, never the (in, out) matrix
    y = (low @ b.reshape(b.shape[0], -1)) * jnp.asarray(cfg.lora.scale, low.dtype)
    return y.reshape(*lead, *b.shape[1:])


def add(y, x, adapters: dict | None, target: str, cfg: ModelConfig, in_axes: int = 1):
    """y plus `delta` (y itself, untouched, without an adapter for `target`)."""
    d = delta(x, adapters, target, cfg, in_axes)
    return y if d is None else y + d.astype(y.dtype)


TARGET_PARAMS = {  # target -> the path of the (layer-stacked) base weight it adapts
    "q": ("layers", "w_q_dnh"), "k": ("layers", "w_k_dkh"), "v": ("layers", "w_v_dkh"), "o": ("layers", "w_o_nhd"),
    "gate": ("layers", "mlp", "w_gate_df"), "up": ("layers", "mlp", "w_up_df"), "down": ("layers", "mlp", "w_down_fd"),
}  # fmt: skip


def merge(base: dict, adapters: dict, cfg: ModelConfig) -> dict:
    """The base params (as trained: layers stacked, no adapters attached) with each target's weight
    W (L, *in, *out) replaced by W + A @ B * alpha / rank, computed in float32 and cast back to W's dtype.

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
        a, b = (pair[k].astype(jnp.float32) for k in sorted(pair))  # A (L, *in, r), B (L, r, *out)
        L, r = a.shape[0], a.shape[-1]
        ab = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1), precision=jax.lax.Precision.HIGHEST)
        w32 = w.dequantize(jnp.float32) if quant.is_q(w) else w.astype(jnp.float32)
        merged = w32 + (ab * scale).reshape(w32.shape)
        node[name] = merged if quant.is_q(w) else merged.astype(w.dtype)
    return out
