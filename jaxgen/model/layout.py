"""How a decoding model's weights sit in memory: matrix products' weights output-major, (O, I).

At decode a matrix product is a few rows (the batch) times a whole weight. Stored as trained, (I, O),
XLA:CPU's product kernel (YNNPACK) runs those products slower than with both operands running along I
in memory, from about 8 rows on, while for one row (O, I) costs a little (measured: docs/performance.md,
"Decode weight layout"): `decode_layout` takes the batch the weights will serve and keeps (I, O) below
`OUT_MAJOR_ROWS`. Training and the stored checkpoints keep (I, O); `OutMajor` is a pytree, so the
decode loop carries it as it is.
"""

from __future__ import annotations

import math

import flax.struct
import jax

from jaxgen.model import quant

OUT_MAJOR_ROWS = 8  # rows per product from which (O, I) measured faster
_KINDS = (*quant.OUT_MAJOR_KINDS, "dv")  # attention, MLP and an untied head's products (not the embedding)


@flax.struct.dataclass
class OutMajor:
    """A matrix product's weight stored (O, I): O, I the products of its output and input axes.
    `shape` is the weight's own, as trained (input axes first)."""

    w: jax.Array  # (O, I)
    in_dims: tuple[int, ...] = flax.struct.field(pytree_node=False)
    out_dims: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.in_dims, *self.out_dims)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.w.dtype

    def in_major(self) -> jax.Array:
        """The weight as trained: (*in_dims, *out_dims)."""
        return self.w.T.reshape(self.shape)


def is_out_major(x) -> bool:
    return isinstance(x, OutMajor)


def product(x, w: OutMajor, preferred=None):
    """x (..., I) times the weight: (..., O), contracting both operands along their minor axis."""
    return jax.lax.dot_general(x, w.w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=preferred)


def decode_layout(params: dict, rows: int) -> dict:
    """Per-layer params (see `transformer.unstack_layers`) with every float matrix product's weight
    `OutMajor` when products will have at least `OUT_MAJOR_ROWS` rows; the params unchanged below.
    int8 weights (`quant.QArray`) are output-major already; MoE experts and the router stay."""
    if rows < OUT_MAJOR_ROWS:
        return params

    def visit(path, w):
        kind = quant.product_kind(str(getattr(path[-1], "key", "")))
        if quant.is_q(w) or is_out_major(w) or kind not in _KINDS or w.ndim != len(kind):
            return w  # (a stacked (L, ...) weight too: decoding unstacks first)
        n_in = len(quant.CONTRACTED[kind])  # the contracted axes lead
        in_dims, out_dims = tuple(w.shape[:n_in]), tuple(w.shape[n_in:])
        return OutMajor(w.reshape(math.prod(in_dims), -1).T, in_dims, out_dims)

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda x: quant.is_q(x) or is_out_major(x))


def train_layout(params: dict) -> dict:
    """The inverse of `decode_layout`: every weight as trained, (I, O)."""
    return jax.tree.map(lambda w: w.in_major() if is_out_major(w) else w, params, is_leaf=is_out_major)
