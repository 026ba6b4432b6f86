"""NF4 weights (4-bit NormalFloat, QLoRA: Dettmers et al. 2023) for a LoRA run's frozen base,
`model.lora.base_dtype=nf4`: about half a byte a parameter, dequantized inside each product.

The code book is bitsandbytes' 16 NF4 values (`CODE`: quantiles of a standard normal, scaled to [-1, 1],
with an exact 0). A weight is stored output-major, (stack axes..., O, I) as int8's `QArray` is (O and I the
products of the output and input axes), and cut into blocks of `BLOCK` = 64 consecutive values along that
row-major layout: each block is 64 inputs of one output channel. That is bitsandbytes' rule applied to a
Hugging Face `Linear` weight, itself (out, in): the same blocks, the same codes, the same bytes. It is also
the product's layout: the product contracts I, so a block's scale belongs to one output row and a shard of
I (or O) holds whole blocks. Each block is scaled by its absmax (float32), each value becomes the nearest
code (a value on a midpoint takes the lower, as bitsandbytes' thresholds do), and two 4-bit codes are
packed into one uint8, the first in the high nibble (bitsandbytes' packing). I is padded with zeros to a
multiple of 64 (no family's shapes need it).

No double quantization of the absmax scales: float32 scales cost 4 / 64 = 0.0625 byte a parameter; 8-bit
scales in blocks of 256 would cost 0.0159, saving 0.047 byte a parameter (0.33 GB of Llama 3.1 8B's
6.0 GB base), not worth a second level of code here (docs/training.md, "LoRA fine-tuning").
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64  # values per absmax scale
CODE = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ],
    np.float32,
)  # fmt: skip
# the 15 decision thresholds between neighbouring codes, halved in float64 as bitsandbytes' constants are
MIDPOINTS = ((CODE[:-1].astype(np.float64) + CODE[1:]) / 2).astype(np.float32)


@flax.struct.dataclass
class NF4:
    """A matrix product's weight in NF4: `packed` (stack..., O, I' / 2) uint8 and `absmax` (stack..., O,
    I' / 64) float32, I' = I padded to a multiple of 64. `shape` is the weight's own, input axes first."""

    packed: jax.Array  # uint8, two codes a byte, the first in the high nibble
    absmax: jax.Array  # float32, one scale per block of 64 values along I
    in_dims: tuple[int, ...] = flax.struct.field(pytree_node=False)
    out_dims: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-2], *self.in_dims, *self.out_dims)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.packed.dtype

    def matrix(self, dtype=jnp.float32) -> jax.Array:
        """The dequantized weight output-major: (stack..., O, I)."""
        return dequantize(self.packed, self.absmax, math.prod(self.in_dims), dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The dequantized weight in its own shape, (stack..., *in_dims, *out_dims)."""
        return self.matrix(dtype).swapaxes(-1, -2).reshape(self.shape)


def is_nf4(x) -> bool:
    return isinstance(x, NF4)


@jax.jit  # one program per shape, not a dispatch per operation (create_base runs eagerly)
def quantize_matrix(w_oi) -> tuple[jax.Array, jax.Array]:
    """(packed (..., O, I' / 2) uint8, absmax (..., O, I' / 64) float32) of w (..., O, I): see the module."""
    w = jnp.asarray(w_oi, jnp.float32)
    pad = -w.shape[-1] % BLOCK
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)  # (..., O, I' / 64, 64)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None]
    codes = jnp.searchsorted(jnp.asarray(MIDPOINTS), scaled, side="left").astype(jnp.uint8)  # midpoints below
    pairs = codes.reshape(*w.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1], absmax


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize(packed, absmax, n_in: int, dtype=jnp.float32) -> jax.Array:
    """The (..., O, I) weight `quantize_matrix` packed, I = n_in: code times its block's absmax."""
    codes = jnp.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], -1, BLOCK)
    values = jnp.asarray(CODE)[codes] * absmax[..., None]  # (..., O, I' / 64, 64) float32
    return values.reshape(*packed.shape[:-1], -1)[..., :n_in].astype(dtype)


def quantize(w, lead: int, n_in: int, sharding=None) -> NF4:
    """`w` (stack..., *in, *out) in NF4, its `lead` stack axes kept and its next `n_in` axes the input;
    `sharding`: the (stack..., O, I) layout's NamedSharding (`quant.out_major_sharding`), given to both
    arrays, whose last axes are I's blocks."""
    in_dims, out_dims = tuple(w.shape[lead : lead + n_in]), tuple(w.shape[lead + n_in :])
    w2 = jnp.asarray(w).reshape(*w.shape[:lead], math.prod(in_dims), -1).swapaxes(-1, -2)  # (stack..., O, I)
    packed, absmax = quantize_matrix(w2)
    if sharding is not None:
        packed, absmax = (jax.device_put(x, _fitted(sharding, x.shape)) for x in (packed, absmax))
    return NF4(packed=packed, absmax=absmax, in_dims=in_dims, out_dims=out_dims)


def _fitted(sharding, shape):
    """`sharding` less the mesh axes that do not divide their dimension (a small I has fewer blocks than
    a tensor-parallel split has devices: its scales are then whole on each)."""
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

    def fits(axes, size):
        names = (axes,) if isinstance(axes, str) else axes or ()
        return size % math.prod(mesh.shape[a] for a in names) == 0

    fitted = [axes if fits(axes, size) else None for axes, size in zip(spec, shape, strict=True)]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))


def dense(x2, w: NF4, out_dtype):
    """x2 (R, I) float times an NF4 weight (I, O) -> (R, O) `out_dtype`, the weight dequantized to x's dtype
    inside the product (per layer and step: only the packed bytes persist)."""
    return _frozen_product(x2, w.packed, w.absmax, math.prod(w.in_dims)).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _frozen_product(x2, packed, absmax, n_in: int):
    """x2 (R, I) times the dequantized (O, I) weight, contracting both along I: float32 (R, O).

    The custom gradient keeps the packed bytes, not the dequantized weight, as the backward's residual (a
    plain autodiff would save the float (O, I) matrix of every layer) and dequantizes again for x's
    gradient; the weight is frozen (zero cotangents), as in `quant._frozen_product`."""
    w = dequantize(packed, absmax, n_in, x2.dtype)
    return jax.lax.dot_general(x2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _frozen_product_fwd(x2, packed, absmax, n_in):
    return _frozen_product(x2, packed, absmax, n_in), (packed, absmax, x2[:0])  # x2[:0]: its dtype


def _frozen_product_bwd(n_in, res, g):
    packed, absmax, x_empty = res
    w = dequantize(packed, absmax, n_in, x_empty.dtype)
    dx = jax.lax.dot_general(g.astype(x_empty.dtype), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    dx = dx.astype(x_empty.dtype)
    return dx, np.zeros(packed.shape, jax.dtypes.float0), jnp.zeros_like(absmax)


_frozen_product.defvjp(_frozen_product_fwd, _frozen_product_bwd)
