"""int8 weights for inference: symmetric, one float32 scale per output channel, applied at load time.

A quantized weight is a `QArray` (int8 values `q` and a float32 `scale` with the weight's rank, 1 on
the contracted axes), a pytree that slices, shards and donates like the array it replaces, so the
decode loop carries int8 weights and never a float copy. Products take it through `dense`: the
activations are quantized per row on the fly (absmax / 127) and multiplied int8 x int8 with int32
accumulation, then rescaled by (row scale x channel scale). That is the product XLA:CPU runs fast
(see `dense`); GPUs and TPUs have int8 matrix units for it.

What is quantized (`quantize_params`): every matrix of the attention and the MLP (MoE experts too:
those are stored int8 and expanded per step, as their einsums take no int8 path), and, with
`embedding=True`, the embedding (one scale per vocabulary row: the lookup reads row scales, the tied
head's output channels are the same rows) and an untied head. Norms, biases and anything training
needs stay as they are: quantized params are for inference only (`jaxgen.model.transformer.forward`),
or a LoRA run's frozen base (`frozen_base`: int8, or NF4 from `jaxgen.model.nf4`, which `is_q` and `dense`
take too).

Why not qwix (Google's JAX quantization library): it quantizes by intercepting the products of Flax
modules, and jaxgen's model is plain functions over a dict of arrays; the one product and the scale
rule below are all this needs (about 100 lines), and they are tested against float32 here.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.model import nf4

# contracted axes of each weight kind, by the name's axis letters (the glossary in jaxgen.sharding),
# counted on one layer's weight (a stacked layer weight has a leading L axis on top)
CONTRACTED = {
    "dnh": (0,), "dkh": (0,), "nhd": (0, 1), "df": (0,), "fd": (0,),  # attention and MLP products
    "edf": (1,), "efd": (1,),  # MoE experts (E leads)
    "dv": (0,),  # an untied head: one scale per vocabulary column
    "vd": (1,),  # the embedding: one scale per vocabulary row (the tied head's output channels)
}  # fmt: skip
_EMBEDDING = ("embed_vd", "head_dv")
OUT_MAJOR_KINDS = ("dnh", "dkh", "nhd", "df", "fd")  # the products of `dense`: stored (O, I), see `dense`


def product_kind(name: str) -> str | None:
    """The axis letters of the matrix product weight named `name` ("w_up_df" -> "df", "head_dv" ->
    "dv"), or None for anything else (norms, biases, the router)."""
    kind = name.rsplit("_", 1)[-1]
    return kind if kind in CONTRACTED and name.startswith(("w_", *_EMBEDDING)) else None


@flax.struct.dataclass
class QArray:
    """int8 values and scales. `q` has the weight's shape, or with `in_dims` (a matrix product's weight
    whose contracted axes lead) it is stored output-major: (stack axes..., O, I), O and I the products
    of the output and input axes, I = prod(in_dims). `shape` is always the weight's own."""

    q: jax.Array  # int8
    scale: jax.Array  # float32, the weight's rank with 1 on the contracted axes: w ~= q * scale
    in_dims: tuple[int, ...] | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.in_dims is None:
            return self.q.shape
        lead = self.q.shape[:-2]
        return (*lead, *self.in_dims, *self.scale.shape[len(lead) + len(self.in_dims) :])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.q.dtype

    def values(self) -> jax.Array:
        """The int8 values in the weight's own shape."""
        return self.q if self.in_dims is None else self.q.swapaxes(-1, -2).reshape(self.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values().astype(jnp.float32) * self.scale).astype(dtype)


def is_q(x) -> bool:
    """A quantized weight: int8 (`QArray`) or NF4 (`jaxgen.model.nf4.NF4`, a LoRA run's frozen base)."""
    return isinstance(x, QArray | nf4.NF4)


def quantize(w, contracted: tuple[int, ...], out_major: bool = False) -> QArray:
    """Symmetric int8 of `w` with one scale per position of the axes not in `contracted`; `out_major`
    (contracted axes leading, after any stack axes): stored (stack..., O, I), see `dense`."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    if not out_major:
        return QArray(q=q, scale=scale)
    lead = contracted[0]
    in_dims = w.shape[lead : lead + len(contracted)]
    q2 = q.reshape(*w.shape[:lead], math.prod(in_dims), -1).swapaxes(-1, -2)  # (stack..., O, I)
    sharding = out_major_sharding(w, lead, len(in_dims))
    return QArray(q=q2 if sharding is None else jax.device_put(q2, sharding), scale=scale, in_dims=tuple(in_dims))


def out_major_sharding(w, lead: int, n_in: int):
    """The float weight's NamedSharding carried to the (stack..., O, I) layout: the output axes' mesh
    axes shard O, the input axes' shard I (so tensor-parallel products stay split); None otherwise."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))

    def merged(axes):
        names = [a for entry in axes if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
        return None if not names else names[0] if len(names) == 1 else tuple(names)

    out_major = (*spec[:lead], merged(spec[lead + n_in :]), merged(spec[lead : lead + n_in]))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*out_major))


def quantize_params(params: dict, embedding: bool = False, kind: str = "int8") -> dict:
    """The params with every matrix product's weight as a `QArray` (see the module docstring), or with
    `kind="nf4"` as `nf4.NF4` (MoE experts too; all output-major, (stack..., O, I)).

    `embedding`: also the embedding and an untied head (int8 only). Already quantized weights are left alone."""

    def visit(path, w):
        name = str(getattr(path[-1], "key", ""))
        axes = product_kind(name)
        if is_q(w) or axes is None:
            return w
        if name in _EMBEDDING and not (embedding and kind == "int8"):
            return w
        lead = w.ndim - len(axes)  # a stacked layer weight's L axis
        contracted = tuple(lead + a for a in CONTRACTED[axes])
        if kind == "nf4":  # the stack axes (L, and E of experts) lead, then the contracted ones
            sharding = out_major_sharding(w, contracted[0], len(contracted))
            return nf4.quantize(w, contracted[0], len(contracted), sharding)
        return quantize(w, contracted, out_major=axes in OUT_MAJOR_KINDS)

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_q)


def frozen_base(params: dict, kind: str) -> dict:
    """A LoRA run's frozen base as `model.lora.base_dtype` = `kind` holds it: float32 as it is; bfloat16
    cast; int8 every matrix product's weight quantized per output channel, the rest as it is; nf4 those
    weights NF4 and the rest (embedding, head, norms) bfloat16, as QLoRA holds them (the float32 embedding
    and head alone would be 4.2 GB of Llama 3.1 8B's base)."""
    if kind == "bfloat16":
        return jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    if kind == "int8":
        return quantize_params(params)
    if kind == "nf4":
        half = lambda w: w if is_q(w) or not jnp.issubdtype(w.dtype, jnp.floating) else w.astype(jnp.bfloat16)
        return jax.tree.map(half, quantize_params(params, kind="nf4"), is_leaf=is_q)
    return params


def is_quantized(params: dict) -> bool:
    return any(is_q(x) for x in jax.tree.leaves(params, is_leaf=is_q))


def weight_bytes(params: dict) -> int:
    """Bytes the params hold, int8 values and their scales included."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def dense(x2, w: QArray | nf4.NF4, out_dtype):
    """x2 (R, I) float times a QArray (I, O) -> (R, O) `out_dtype` (an NF4 weight: `nf4.dense`).

    The activations are quantized per row and multiplied int8 x int8 into int32. On XLA:CPU (2 cores,
    x (B, 2048) by (2048, 8192)) that product took 2.33 ms at B=8 against 4.66 ms in float32, while
    converting the int8 matrix to float first took 26 ms at every B (the convert is not fused: the whole
    matrix is written every step). The weight is stored output-major, (O, I), so both operands run
    along I in memory: for one row by (768, 3072) that product took 0.27-0.30 ms against 0.53-0.56 ms in
    float32 and 0.60-0.72 ms with the (I, O) layout (`quantize_params` stores these weights so)."""
    if nf4.is_nf4(w):
        return nf4.dense(x2, w, out_dtype)
    if w.in_dims is None:
        wq, out_major = w.q.reshape(x2.shape[-1], -1), False
    else:
        wq, out_major = w.q, True
    return _frozen_product(x2, wq, w.scale.reshape(-1), out_major).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _frozen_product(x2, wq, scale_o, out_major: bool):
    """x2 (R, I) times int8 wq ((I, O), or (O, I) when out_major) times the (O,) scales: float32 (R, O).

    The custom gradient is for LoRA on an int8 base (jaxgen.model.lora): rounding the activations has a
    zero gradient, so x's is taken through the dequantized weight instead, as QLoRA does; the weight
    itself is frozen (zero cotangents). Inference never differentiates and runs the forward alone."""
    contract = (((1,), (1,)), ((), ())) if out_major else (((1,), (0,)), ((), ()))
    y = _int8_product(x2, lambda xq: jax.lax.dot_general(xq, wq, contract, preferred_element_type=jnp.int32))
    return y * scale_o  # (O,) scales: the contracted axes are 1s


def _frozen_product_fwd(x2, wq, scale_o, out_major):
    return _frozen_product(x2, wq, scale_o, out_major), (wq, scale_o, x2[:0])  # x2[:0]: its dtype


def _frozen_product_bwd(out_major, res, g):
    wq, scale_o, x_empty = res
    w = wq.astype(jnp.float32)
    contract = (((1,), (0,)), ((), ())) if out_major else (((1,), (1,)), ((), ()))
    dx = jax.lax.dot_general(g.astype(jnp.float32) * scale_o, w, contract).astype(x_empty.dtype)
    return dx, np.zeros(wq.shape, jax.dtypes.float0), jnp.zeros_like(scale_o)


_frozen_product.defvjp(_frozen_product_fwd, _frozen_product_bwd)


def head(x2, w: QArray, tied: bool):
    """Logits (R, V) float32 of x2 (R, D): the tied embedding (V, D) or an untied head (D, V), int8."""
    contract = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
    y = _int8_product(x2, lambda xq: jax.lax.dot_general(xq, w.q, contract, preferred_element_type=jnp.int32))
    return y * w.scale.reshape(-1)  # (the tied (V, D) embedding is output-major already)


def embed(w: QArray, tokens, dtype):
    """Rows of an int8 embedding (V, D) for `tokens`, dequantized: (..., D)."""
    return (w.q[tokens].astype(jnp.float32) * w.scale[tokens, 0][..., None]).astype(dtype)


def _int8_product(x2, product):
    """`product` (int8 (R', I) -> int32 (R', O)) of x2 (R, I) quantized per row, rescaled by the rows'
    scales: float32 (R, O). On CPU a single row is padded to 2 (one row falls off XLA:CPU's int8 fast
    path; with the output-major layout 2 rows measured fastest of 1, 2, 4 and 8)."""
    x = x2.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    xs = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x / xs), -127, 127).astype(jnp.int8)
    rows = xq.shape[0]
    if rows < 2 and jax.default_backend() == "cpu":
        xq = jnp.pad(xq, ((0, 2 - rows), (0, 0)))
    return product(xq)[:rows].astype(jnp.float32) * xs
