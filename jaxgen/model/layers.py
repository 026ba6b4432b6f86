"""The building blocks of the transformer: norms, rotary positions, the MLP, 2-D weight products.
Attention and its mask are `jaxgen.model.attention`. In deterministic mode (`model.deterministic`) the
transformer runs them on fixed tiles of tokens (`per_tile`; a block as two loops, `transformer._block_tiled`).

Shapes use the glossary in `jaxgen.sharding` (B, T, S, D, N, K, G, H, F).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import ModelConfig
from jaxgen.model import kernels, layout, lora, quant
from jaxgen.sharding import constrain, context_size

TILE = 8  # tokens per tile in deterministic mode (`per_tile`)


def per_tile(fn, *xs, consts: tuple = (), tile: int = TILE):
    """fn(*rows, *consts) over fixed tiles of `tile` rows: xs (M, ...) each (the same M) are padded with zero
    rows to a multiple of `tile`, cut into (M / tile, tile, ...) and mapped (`map_tiles`); fn's outputs
    (tile, ...) come back as (M, ...). `consts` (weights, say) go to every tile whole. Model deterministic
    mode (`ModelConfig.deterministic`) runs every per-token computation this way (a transformer block as
    two such loops: `transformer._block_tiled`).

    Why: XLA:CPU computes a row of a matrix product, or a row's sum, in an order that depends on how many
    rows the operation has (measured: x @ w's row i changed by ~1e-5 between 2 and 60 rows; a sum over
    257 columns is split into windows of 32 below 16 rows), and transcendental functions gave other bits
    for the same input in another program. A loop body of fixed shape is one program, whatever the row
    count, and a row's result does not depend on its place in the tile. The body's inputs and outputs sit
    behind optimization barriers, to keep it apart from what surrounds the loop.

    The gradient is fn's over all rows at once (`tiled_values`): only the values need the tiles."""

    def tiled(xs, consts):
        m = xs[0].shape[0]
        pad = num_tiles(m, tile) * tile - m
        tiles = tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, tile, *x.shape[1:]) for x in xs)
        barrier = jax.lax.optimization_barrier  # the body apart from what surrounds the loop
        out = map_tiles(lambda t: barrier(fn(*barrier(t), *consts)), tiles)
        return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:m], out)

    return tiled_values(tiled, lambda xs, consts: fn(*xs, *consts))(xs, consts)


def tiled_values(tiled, plain):
    """A function whose values are `tiled`'s (deterministic mode's programs) and whose gradient is
    `plain`'s: the same maths without tiles, differentiated as the model is without the flag. Only the
    forward's bits have to match the engine's, and differentiating the loops over tiles cost 5 to 8 plain
    backward passes (configs/tiny.yaml on CPU). The two gradients differ by rounding, as those of any two
    implementations of one function do. The backward recomputes `plain`'s forward (what it keeps)."""

    @jax.custom_vjp
    def fn(*args):
        return tiled(*args)

    def backward(args, grad):
        return jax.vjp(plain, *args)[1](grad)

    fn.defvjp(lambda *args: (tiled(*args), args), backward)
    return fn


def num_tiles(m: int, tile: int = TILE) -> int:
    """How many tiles of `tile` rows `per_tile` cuts M rows into."""
    return max(-(-m // tile), 1)


def map_tiles(fn, xs):
    """`lax.map(fn, xs)` as a loop whose trip count XLA cannot see: a loop of one tile is kept (XLA removes
    a loop it knows runs once, and the body's operations then fuse with their neighbours, which differ
    from program to program)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs))
    out = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), shapes)

    def step(i, out):
        y = fn(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), xs))
        return jax.tree.map(lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y, i, 0), out, y)

    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), step, out)


def over_rows(fn, x, axes: int = 1, consts: tuple = ()):
    """fn(x's trailing `axes` axes, *consts), per row of the rest, by `per_tile`: (..., *tail) -> (..., *tail')."""
    lead, tail = x.shape[: x.ndim - axes], x.shape[x.ndim - axes :]
    y = per_tile(fn, x.reshape(-1, *tail), consts=consts)
    return y.reshape(*lead, *y.shape[1:])


def dense(x, w, in_axes: int = 1):
    """x (..., *w.shape[:in_axes]) times w -> (..., *w.shape[in_axes:]), as one 2-D matrix product (on a
    context mesh, with the leading (B, T) axes kept apart: `split_tokens`).

    Flattening first matters on XLA:CPU: the backward pass of a multi-axis einsum such as
    "btd,dnh->btnh" inside the layer scan turned into slow transposing copies (a SwiGLU layer's
    gradient took 1.45x as long as with 2-D products).
    """
    n_in = math.prod(w.shape[:in_axes])
    lead = x.shape[: x.ndim - in_axes]
    keep = split_tokens(lead)
    rows = x.reshape(*lead, n_in) if keep else x.reshape(-1, n_in)
    if layout.is_out_major(w):  # decoding's (O, I) layout: see jaxgen.model.layout
        y = layout.product(rows, w)
    elif quant.is_q(w):  # int8 weights (inference): an int8 x int8 product
        y = quant.dense(x.reshape(-1, n_in), w, x.dtype)
    elif keep:
        y = rows @ w.reshape(n_in, -1)
    else:
        y = of_rows(lambda x2: x2 @ w.reshape(n_in, -1), rows)
    return y.reshape(*lead, *w.shape[in_axes:])


def split_tokens(lead: tuple[int, ...]) -> bool:
    """Whether activations of leading axes `lead` ((B, T)) keep their tokens apart from their rows: on a
    context mesh, for more than one token a row. Flattened, the context-split T merged into B x T and the
    partitioner gathered the whole sequence's activations for each product (and the layer scan kept them),
    where each device should hold its chunk (tests/test_targets.py). int8 weights still flatten."""
    return len(lead) > 1 and lead[-1] > 1 and context_size() > 1


def of_rows(product, x2):
    """product(x2) for x2 (R, I), a matrix product's rows; one row as two (the row and zeros) where
    `kernels.pads_one_row` says (XLA:GPU: a gemm that reads the weight once, not a multiply written out)."""
    if x2.shape[0] == 1 and kernels.pads_one_row():
        return product(jnp.pad(x2, ((0, 1), (0, 0))))[:1]
    return product(x2)


def norm(x_btd, p: dict, cfg: ModelConfig):
    """LayerNorm (scale and bias) or RMSNorm (scale only), computed in float32 (per tile of rows in
    deterministic mode)."""
    if cfg.deterministic:
        return over_rows(functools.partial(_norm, cfg=cfg), x_btd, consts=(p,))
    return _norm(x_btd, p, cfg)


def _norm(x_btd, p: dict, cfg: ModelConfig):
    x = x_btd.astype(jnp.float32)
    if cfg.norm == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    x = rms_norm(x, p["scale_d"], cfg)
    if "bias_d" in p:
        x = x + p["bias_d"].astype(jnp.float32)
    return x.astype(x_btd.dtype)


def rms_norm(x, scale, cfg: ModelConfig):
    """RMSNorm over the trailing `scale.ndim` axes (one head's H, or a whole projection's N x H), in
    float32; Gemma's norms multiply by (1 + scale)."""
    axes = tuple(range(x.ndim - scale.ndim, x.ndim))
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt((y * y).mean(axes, keepdims=True) + cfg.norm_eps)
    scale = scale.astype(jnp.float32)
    return (y * (1.0 + scale if cfg.norm_unit_offset else scale)).astype(x.dtype)


def log_softmax(x, cfg: ModelConfig):
    """jax.nn.log_softmax over the last axis; per tile of rows in deterministic mode (`per_tile`: the
    engine's and the training forward's log-probabilities are then the same numbers)."""
    if cfg.deterministic:
        return over_rows(lambda t: jax.nn.log_softmax(t, axis=-1), x)
    return jax.nn.log_softmax(x, axis=-1)


def softcap(x, cap: float | None):
    """cap * tanh(x / cap): logits squashed into (-cap, cap) (Gemma 2); identity for None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope_frequencies(cfg: ModelConfig, theta: float | None = None):
    """Inverse frequencies (H/2,) float32 of the rotary embedding, with the config's context scaling;
    numpy, so they stay constants under jit. `theta`: a local layer's own base (no scaling).

    linear divides every frequency by rope_factor. llama3 (Llama 3.1) leaves high frequencies alone,
    divides low ones (wavelength beyond original_max_len / low_freq_factor) by the factor, and blends
    linearly in between.
    """
    h = cfg.head_size
    exponents = np.arange(0, h, 2, dtype=np.float32) / h
    if theta is not None:  # a sliding-window layer's own base (Gemma 3): no context scaling
        return (1.0 / theta**exponents).astype(np.float32)
    inv_freq = (1.0 / cfg.rope_theta**exponents).astype(np.float32)
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / np.float32(factor)
    if cfg.rope_scaling == "llama3":
        low, high, old_len = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    return inv_freq


def rope(x_btnh, positions_bt, inv_freq):
    """Rotary position embedding, rotate-half convention (as in Llama); inv_freq from `rope_frequencies`."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # (B, T, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


# The activations below are recomputed in the backward pass from their inputs (jax.checkpoint): otherwise
# autodiff keeps their intermediates (tanh, the cube, the sigmoid), three or four (B, T, F) arrays per
# layer, a quarter of gpt2-124m's training activations, to save elementwise work that costs next to
# nothing beside the layer's matrix products.


@functools.partial(jax.checkpoint, static_argnums=(2,))
def gated(gate, up, mlp: str):
    """SwiGLU's silu(gate) * up (mlp="swiglu"), or GeGLU's tanh-GELU(gate) * up."""
    act = jax.nn.silu(gate) if mlp == "swiglu" else jax.nn.gelu(gate, approximate=True)
    return act * up


@jax.checkpoint
def gelu(x):
    return jax.nn.gelu(x, approximate=True)


def mlp(x_btd, p: dict, cfg: ModelConfig, adapters: dict | None = None):
    """GELU MLP (GPT-2), SwiGLU (Llama) or GeGLU (Gemma; tanh-approximated GELU gate). adapters: the
    layer's low-rank adapters (jaxgen.model.lora), of which gate, up and down apply here."""
    up = lora.add(dense(x_btd, p["w_up_df"]), x_btd, adapters, "up", cfg, w=p["w_up_df"])
    if "b_up_f" in p:
        up = up + p["b_up_f"]
    if cfg.mlp in ("swiglu", "geglu"):
        gate = lora.add(dense(x_btd, p["w_gate_df"]), x_btd, adapters, "gate", cfg, w=p["w_gate_df"])
        if "b_gate_f" in p:
            gate = gate + p["b_gate_f"]
        hidden = gated(gate, up, cfg.mlp)
    else:
        hidden = gelu(up)
    if hidden.ndim == 3 and split_tokens(hidden.shape[:2]):  # each token's activations on its chunk's device
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
    out = lora.add(dense(hidden, p["w_down_fd"]), hidden, adapters, "down", cfg, w=p["w_down_fd"])
    if "b_down_d" in p:
        out = out + p["b_down_d"]
    return out
