"""Mixture of experts (Mixtral, Qwen3-MoE): a router sends each token to k of E gated MLPs.

    out_btd, aux = moe.mlp(x_btd, p, valid_bt, cfg)

p (one layer): w_router_de (D, E); w_gate_edf, w_up_edf (E, D, F); w_down_efd (E, F, D).
aux: this layer's router statistics (`router_stats`); `balance_loss` pools them over layers.

Dispatch is dropless (no token is dropped for want of capacity), in one of three ways that give the
same numbers (tests/test_moe.py):
    dense       every expert on every token, weighted by the routing weights (0 for experts not
                picked): E / k times the expert FLOPs. The reference.
    grouped     the M * k (token, expert) assignments sorted by expert and laid out so that each tile
                of rows belongs to one expert; one (tile, D) x (D, F) product per tile in use
                (`grouped_matmul`, with its own backward). FLOPs: the experts' own plus at most E
                tiles of padding; only the experts in use are read (a decode step at batch 1 reads k
                experts, not E).
    ragged_dot  `jax.lax.ragged_dot` over the sorted assignments: a grouped-matmul kernel on GPU.
                XLA:CPU lowers it to a product with every expert under a mask (measured: no faster
                than dense), so `auto` picks `grouped` on CPU.
    megablox    the Pallas grouped matmul for TPU shipped in jax (`megablox.gmm`, with its own
                backward); off TPU it runs in Pallas interpret mode (slow: for tests only).
`auto` is megablox on TPU, ragged_dot on GPU, grouped on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgen.config import ModelConfig
from jaxgen.model import layers, quant
from jaxgen.sharding import constrain


def mlp(x_btd, p: dict, valid_bt, cfg: ModelConfig):
    """The MoE layer on (B, T, D); `valid_bt` (bool) marks real tokens for the auxiliary losses."""
    b, t, d = x_btd.shape
    x_md = x_btd.reshape(b * t, d)
    # int8 experts (inference) are expanded here: their grouped and per-expert products have no int8 path
    p = {name: w.dequantize(x_btd.dtype) if quant.is_q(w) else w for name, w in p.items()}
    logits_me, weights_mk, experts_mk = route(x_md, p["w_router_de"], cfg)
    impl = _impl(cfg)
    if impl == "dense":
        out = _dense(x_md, weights_mk, experts_mk, p, cfg)
    elif impl == "megablox":
        out = _sorted_per_device(x_md, weights_mk, experts_mk, p, cfg, impl)
    else:
        out = _sorted(x_md, weights_mk, experts_mk, p, cfg, impl)
    return out.reshape(b, t, d), router_stats(logits_me, experts_mk, valid_bt.reshape(-1), cfg.num_experts)


def route(x_md, w_router_de, cfg: ModelConfig):
    """Router logits (M, E) float32, and each token's k routing weights and experts (M, k): softmax
    over all experts, the top k kept, rescaled to sum to 1 when `router_renormalize`."""
    logits = jnp.matmul(x_md, w_router_de, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.router_renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return logits, weights, experts


def router_stats(logits_me, experts_mk, valid_m, num_experts: int) -> dict:
    """One layer's router statistics over valid tokens: "share" (E,), the share of assignments that go
    to each expert (summing to k); "mean_prob" (E,), each expert's mean router probability; and
    "router_z", the z-loss mean(logsumexp(logits)^2). `balance_loss` pools the first two over layers."""
    w = valid_m.astype(jnp.float32)
    count = jnp.maximum(w.sum(), 1.0)
    probs = jax.nn.softmax(logits_me, axis=-1)
    picked = jax.nn.one_hot(experts_mk, num_experts, dtype=jnp.float32).sum(1)  # (M, E)
    z = jax.nn.logsumexp(logits_me, axis=-1)
    return {
        "share": (picked * w[:, None]).sum(0) / count,
        "mean_prob": (probs * w[:, None]).sum(0) / count,
        "router_z": jnp.sum(w * z * z) / count,
    }


def balance_loss(share_le, mean_prob_le):
    """Switch Transformer's load-balancing loss E * sum_e f_e P_e with f and P pooled over the layers
    first (L, E) -> (E,), as transformers' load_balancing_loss_func computes it; k when balanced."""
    num_experts = share_le.shape[-1]
    return num_experts * jnp.sum(share_le.mean(0) * mean_prob_le.mean(0))


def _impl(cfg: ModelConfig) -> str:
    if cfg.moe_impl != "auto":
        return cfg.moe_impl
    return {"cpu": "grouped", "tpu": "megablox"}.get(jax.default_backend(), "ragged_dot")


def _expert(x_rd, p: dict, e, cfg: ModelConfig):
    """Expert e's gated MLP on rows (R, D)."""
    gate = x_rd @ p["w_gate_edf"][e]
    up = x_rd @ p["w_up_edf"][e]
    return layers.gated(gate, up, cfg.mlp) @ p["w_down_efd"][e]


def _dense(x_md, weights_mk, experts_mk, p: dict, cfg: ModelConfig):
    """Every expert on every token; the combine weights are zero for experts a token did not pick."""
    m = x_md.shape[0]
    combine_me = jnp.zeros((m, cfg.num_experts), x_md.dtype)
    combine_me = combine_me.at[jnp.arange(m)[:, None], experts_mk].add(weights_mk.astype(x_md.dtype))
    gate = jnp.einsum("md,edf->emf", x_md, p["w_gate_edf"])
    up = jnp.einsum("md,edf->emf", x_md, p["w_up_edf"])
    gate = constrain(gate, ("expert", None, "mlp"))
    out_emd = jnp.einsum("emf,efd->emd", layers.gated(gate, up, cfg.mlp), p["w_down_efd"])
    return jnp.einsum("emd,me->md", out_emd, combine_me)


def _sorted(x_md, weights_mk, experts_mk, p: dict, cfg: ModelConfig, impl: str):
    """The assignments sorted by expert, run as groups (tiles or a grouped matmul), summed back per token."""
    m, d = x_md.shape
    k = experts_mk.shape[1]
    flat_e = experts_mk.reshape(-1)  # (A,), A = M * k; assignment a belongs to token a // k
    sizes = jnp.bincount(flat_e, length=cfg.num_experts).astype(jnp.int32)  # (E,) rows per expert
    x_ad = jnp.repeat(x_md, k, axis=0)  # (A, D) in assignment order (its gradient is a sum over k)
    if impl == "grouped":
        y = _tiles(x_ad, flat_e, sizes, p, cfg)
    else:
        order = jnp.argsort(flat_e, stable=True)
        product = jax.lax.ragged_dot if impl == "ragged_dot" else _megablox
        xs = x_ad[order]
        h = layers.gated(product(xs, p["w_gate_edf"], sizes), product(xs, p["w_up_edf"], sizes), cfg.mlp)
        y = jnp.zeros_like(xs).at[order].set(product(h, p["w_down_efd"], sizes), unique_indices=True)
    return (y.reshape(m, k, d) * weights_mk[..., None].astype(y.dtype)).sum(1)


def _sorted_per_device(x_md, weights_mk, experts_mk, p: dict, cfg: ModelConfig, impl: str):
    """`_sorted` on each device's share of the rows under a mesh (`shard_map`): the compiler does not partition
    a Mosaic kernel (megablox), which the TPU compiler refuses otherwise. Rows are independent (a token's
    output is its own experts' sum), so any split of them is exact: they are padded to a multiple of the mesh's
    size (zero rows, expert 0, weight 0: they add nothing to an output or a gradient) and split over every mesh
    axis, so no two devices hold the same row and shard_map's transpose sums the expert weights' gradients
    over all of them; each device multiplies by the whole expert weights (gathered into the call)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _sorted(x_md, weights_mk, experts_mk, p, cfg, impl)
    m = x_md.shape[0]
    pad = -m % mesh.size
    rows = P(tuple(mesh.axis_names))
    experts = {k: p[k] for k in ("w_gate_edf", "w_up_edf", "w_down_efd")}
    local = jax.shard_map(
        lambda x, w, e, ps: _sorted(x, w, e, ps, cfg, impl), mesh=mesh,
        in_specs=(rows, rows, rows, jax.tree.map(lambda _: P(), experts)), out_specs=rows, check_vma=False,
    )  # fmt: skip
    padded = [jnp.pad(a, ((0, pad), (0, 0))) for a in (x_md, weights_mk, experts_mk)]
    return local(*padded, experts)[:m]


def _megablox(x_ad, w_eio, sizes_e):
    """megablox.gmm on rows padded to whole row tiles (the padding rows belong to no group)."""
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # Pallas TPU code: loaded when used

    a = x_ad.shape[0]
    tm = 128 if a >= 128 else 8
    rows = -(-a // tm) * tm
    x = jnp.pad(x_ad, ((0, rows - a), (0, 0)))
    tiling = tuple(128 if n % 128 == 0 else n for n in (tm, *w_eio.shape[1:]))
    interpret = jax.default_backend() != "tpu"
    out = megablox.gmm(x, w_eio, sizes_e, jnp.float32, tiling, None, None, False, interpret)
    return out[:a].astype(x_ad.dtype)


def _tiles(x_ad, expert_a, sizes_e, p: dict, cfg: ModelConfig):
    """Rows (A, D) through their experts (A,), one tile of rows at a time; (A, D) in the same order.

    Rows are placed expert by expert, each expert's from a tile boundary, so every tile has one expert;
    at most (A + E * (tile - 1)) // tile tiles exist, and the tiles in use come first. Placing is one
    scatter and reading back one gather (the sort moves integers only).
    """
    a, d = x_ad.shape
    num_e = cfg.num_experts
    # About a quarter of an expert's mean share of rows (8..256): padding each expert to whole tiles
    # then adds at most ~1/4 more rows (work), and the loop stays short.
    tile = int(min(256, max(8, 2 ** (-(-a // (4 * num_e)) - 1).bit_length())))
    num_tiles = (a + num_e * (tile - 1)) // tile
    padded = -(-sizes_e // tile) * tile  # rows each expert takes, rounded up to whole tiles
    start = jnp.cumsum(padded) - padded  # first padded row of each expert
    order = jnp.argsort(expert_a, stable=True)  # sorting ints only: rows move once, below
    first = jnp.cumsum(sizes_e) - sizes_e  # first sorted position of each expert
    rank = jnp.zeros_like(expert_a).at[order].set(jnp.arange(a) - first[expert_a[order]], unique_indices=True)
    place = start[expert_a] + rank  # (A,) each row's row in the padded layout, distinct
    x_pad = jnp.zeros((num_tiles * tile, d), x_ad.dtype).at[place].set(x_ad, unique_indices=True)
    tile_e = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_tiles) * tile, side="right"), num_e - 1)
    used = (padded.sum() // tile).astype(jnp.int32)
    x_pad = x_pad.reshape(num_tiles, tile, d)
    gate = grouped_matmul(x_pad, p["w_gate_edf"], tile_e, used)
    up = grouped_matmul(x_pad, p["w_up_edf"], tile_e, used)
    y = grouped_matmul(layers.gated(gate, up, cfg.mlp), p["w_down_efd"], tile_e, used)
    return y.reshape(-1, d).at[place].get(unique_indices=True)


@jax.custom_vjp
def grouped_matmul(x_tid, w_eio, tile_e, used):
    """Tile j of rows (tile, I) times its expert's matrix w[tile_e[j]] (I, O), for the first `used`
    tiles (the rest are zeros): (tiles, tile, O). Loops run over the used tiles only and write their
    results in place, forward and backward (the gradient of w is added into one (E, I, O) buffer, slice
    by slice, instead of a whole buffer per tile as autodiff of a scan would)."""
    return _tile_products(x_tid, w_eio, tile_e, used, lambda x, w: x @ w, w_eio.shape[-1])


def _tile_products(x_tid, w_eio, tile_e, used, product, width):
    out = jnp.zeros((*x_tid.shape[:2], width), x_tid.dtype)

    def body(j, out):
        return out.at[j].set(product(x_tid[j], w_eio[tile_e[j]]))

    return jax.lax.fori_loop(0, used, body, out)


def _grouped_fwd(x_tid, w_eio, tile_e, used):
    return grouped_matmul(x_tid, w_eio, tile_e, used), (x_tid, w_eio, tile_e, used)


def _grouped_bwd(res, dy_tio):
    x_tid, w_eio, tile_e, used = res
    dx = _tile_products(dy_tio, w_eio, tile_e, used, lambda dy, w: dy @ w.T, x_tid.shape[-1])

    def body(j, dw):  # accumulated in float32 whatever the weights' dtype
        e = tile_e[j]
        return dw.at[e].add(jnp.matmul(x_tid[j].T, dy_tio[j], preferred_element_type=jnp.float32))

    dw = jax.lax.fori_loop(0, used, body, jnp.zeros(w_eio.shape, jnp.float32))
    return dx, dw.astype(w_eio.dtype), None, None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)
