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
needs stay as they are: quantized params are for inference only (`jaxgen.model.transformer.forward`).

Why not qwix (Google's JAX quantization library): it quantizes by intercepting the products of Flax
modules, and jaxgen's model is plain functions over a dict of arrays; the one product and the scale
rule below are all this needs (about 100 lines), and they are tested against float32 here.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

# contracted axes of each weight kind, by the name's axis letters (the glossary in jaxgen.sharding),
# counted on one layer's weight (a stacked layer weight has a leading L axis on top)
_CONTRACTED = {
    "dnh": (0,), "dkh": (0,), "nhd": (0, 1), "df": (0,), "fd": (0,),  # attention and MLP products
    "edf": (1,), "efd": (1,),  # MoE experts (E leads)
    "dv": (0,),  # an untied head: one scale per vocabulary column
    "vd": (1,),  # the embedding: one scale per vocabulary row (the tied head's output channels)
}  # fmt: skip
_EMBEDDING = ("embed_vd", "head_dv")


@flax.struct.dataclass
class QArray:
    q: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's rank with 1 on the contracted axes: w ~= q * scale

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self):
        return self.q.dtype

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def is_q(x) -> bool:
    return isinstance(x, QArray)


def quantize(w, contracted: tuple[int, ...]) -> QArray:
    """Symmetric int8 of `w` with one scale per position of the axes not in `contracted`."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return QArray(q=jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale=scale)


def quantize_params(params: dict, embedding: bool = False) -> dict:
    """The params with every matrix product's weight as a `QArray` (see the module docstring).

    `embedding`: also the embedding and an untied head. Already quantized weights are left alone."""

    def visit(path, w):
        name = str(getattr(path[-1], "key", ""))
        kind = name.rsplit("_", 1)[-1]
        if is_q(w) or kind not in _CONTRACTED or not name.startswith(("w_", *_EMBEDDING)):
            return w
        if name in _EMBEDDING and not embedding:
            return w
        lead = w.ndim - len(kind)  # a stacked layer weight's L axis
        return quantize(w, tuple(lead + a for a in _CONTRACTED[kind]))

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_q)


def is_quantized(params: dict) -> bool:
    return any(is_q(x) for x in jax.tree.leaves(params, is_leaf=is_q))


def weight_bytes(params: dict) -> int:
    """Bytes the params hold, int8 values and their scales included."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def dense(x2, w: QArray, out_dtype):
    """x2 (R, I) float times a QArray reshaped (I, O) -> (R, O) `out_dtype`.

    The activations are quantized per row and multiplied int8 x int8 into int32. On XLA:CPU (2 cores,
    x (B, 2048) by (2048, 8192)) that product took 2.33 ms at B=8 against 4.66 ms in float32, while
    converting the int8 matrix to float first took 26 ms at every B (the convert is not fused: the whole
    matrix is written every step). A single row falls off the int8 fast path, so rows are padded to 8."""
    wq = w.q.reshape(x2.shape[-1], -1)
    y = _int8_product(x2, lambda xq: jax.lax.dot(xq, wq, preferred_element_type=jnp.int32))
    return (y * w.scale.reshape(-1)).astype(out_dtype)  # (O,) scales: the contracted axes are 1s


def head(x2, w: QArray, tied: bool):
    """Logits (R, V) float32 of x2 (R, D): the tied embedding (V, D) or an untied head (D, V), int8."""
    contract = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
    y = _int8_product(x2, lambda xq: jax.lax.dot_general(xq, w.q, contract, preferred_element_type=jnp.int32))
    return y * w.scale.reshape(-1)


def embed(w: QArray, tokens, dtype):
    """Rows of an int8 embedding (V, D) for `tokens`, dequantized: (..., D)."""
    return (w.q[tokens].astype(jnp.float32) * w.scale[tokens, 0][..., None]).astype(dtype)


def _int8_product(x2, product):
    """`product` (int8 (R', I) -> int32 (R', O)) of x2 (R, I) quantized per row, rescaled by the rows'
    scales: float32 (R, O). Fewer than 8 rows are padded to 8 on CPU (see `dense`)."""
    x = x2.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    xs = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x / xs), -127, 127).astype(jnp.int8)
    rows = xq.shape[0]
    if rows < 8 and jax.default_backend() == "cpu":
        xq = jnp.pad(xq, ((0, 8 - rows), (0, 0)))
    return product(xq)[:rows].astype(jnp.float32) * xs
