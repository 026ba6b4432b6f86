"""The mixture-of-experts layer: its three dispatches agree (values and gradients), the router losses
are transformers' own, experts sharded over 8 devices equal one device, and an MoE model trains.
Parity of whole Mixtral and Qwen3-MoE models with transformers is in test_hf.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.model import moe
from jaxgen.sharding import make_mesh
from tests.test_train import _step_n, random_batch

CFG = ModelConfig(
    vocab_size=257, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, num_experts=8,
    experts_per_token=2, max_seq_len=64,
)  # fmt: skip


def _layer_params(cfg, seed=0):
    params = model.init_params(cfg, jax.random.key(seed))
    return jax.tree.map(lambda w: w[0] * 5, params["layers"]["mlp"])  # layer 0, sharper routing


@pytest.mark.parametrize("shape", [(3, 10), (1, 1)])  # a prefill and a decode step
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_ragged_dot_and_megablox_equal_dense_values_and_gradients(shape, renormalize):
    cfg = dataclasses.replace(CFG, router_renormalize=renormalize)
    p = _layer_params(cfg)
    x = jax.random.normal(jax.random.key(1), (*shape, cfg.d_model))
    valid = jnp.ones(shape, bool)
    probe = jax.random.normal(jax.random.key(2), (*shape, cfg.d_model))

    def run(impl):
        c = dataclasses.replace(cfg, moe_impl=impl)

        def f(p, x):
            out, stats = moe.mlp(x, p, valid, c)
            return jnp.sum(out * probe) + moe.balance_loss(stats["share"][None], stats["mean_prob"][None]), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
        return out, grads

    want_out, want_grads = run("dense")
    impls = ("grouped", "ragged_dot", "megablox") if shape == (3, 10) and renormalize else ("grouped", "ragged_dot")
    for impl in impls:  # megablox runs in Pallas interpret mode here (slow), so at one shape
        out, grads = run(impl)
        np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5, err_msg=impl)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=impl)


def test_every_token_reaches_exactly_its_top_k_experts():
    """The grouped dispatch against a per-token loop written out by hand."""
    cfg = dataclasses.replace(CFG, moe_impl="grouped")
    p = _layer_params(cfg, seed=3)
    x = jax.random.normal(jax.random.key(4), (2, 9, cfg.d_model))
    out, _ = moe.mlp(x, p, jnp.ones((2, 9), bool), cfg)
    flat = np.asarray(x).reshape(-1, cfg.d_model)
    logits = flat @ np.asarray(p["w_router_de"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for m, row in enumerate(flat):
        top = np.argsort(-probs[m])[:2]
        weights = probs[m, top] / probs[m, top].sum()
        want = 0
        for e, w in zip(top, weights, strict=True):
            gate, up = row @ np.asarray(p["w_gate_edf"][e]), row @ np.asarray(p["w_up_edf"][e])
            hidden = gate / (1 + np.exp(-gate)) * up
            want = want + w * (hidden @ np.asarray(p["w_down_efd"][e]))
        np.testing.assert_allclose(np.asarray(out).reshape(-1, cfg.d_model)[m], want, atol=1e-4, rtol=1e-4)


def test_router_losses_equal_transformers_load_balancing_loss():
    """Two layers that route differently: f and P are pooled over layers before their product, as
    transformers' load_balancing_loss_func does (a mean of per-layer products would differ)."""
    rng = np.random.default_rng(0)
    b, t, e, k = 3, 7, 8, 2
    logits = [rng.normal(size=(b * t, e)).astype(np.float32) * s for s in (2, 0.5)]
    mask = np.ones((b, t), np.int64)
    mask[1, 4:] = 0  # padding is left out of both
    valid = mask.reshape(-1) > 0
    stats = []
    for lg in logits:
        _, experts = jax.lax.top_k(jax.nn.softmax(lg), k)
        stats.append(moe.router_stats(jnp.asarray(lg), experts, jnp.asarray(valid), e))
    ours = moe.balance_loss(jnp.stack([s["share"] for s in stats]), jnp.stack([s["mean_prob"] for s in stats]))
    theirs = load_balancing_loss_func(tuple(torch.from_numpy(lg) for lg in logits), e, k, torch.from_numpy(mask))
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)
    lse = np.log(np.exp(logits[0]).sum(-1))
    np.testing.assert_allclose(float(stats[0]["router_z"]), np.mean(lse[valid] ** 2), rtol=1e-5)


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_experts_sharded_over_eight_devices_equal_one_device(impl):
    cfg = dataclasses.replace(CFG, moe_impl=impl)
    params = model.init_params(cfg, jax.random.key(5))
    tokens = np.random.default_rng(6).integers(0, 257, (4, 12)).astype(np.int32)
    positions = np.tile(np.arange(12, dtype=np.int32), (4, 1))
    forward = jax.jit(lambda p, x, pos: model.forward(p, x, pos, cfg=cfg)[0])
    want = forward(params, tokens, positions)

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4), jax.devices()[:8])
    sharded = jax.device_put(params, model.param_shardings(cfg, mesh))
    spec = sharded["layers"]["mlp"]["w_gate_edf"].sharding.spec
    assert spec[1] == "tensor" and spec[3] is None, spec  # 2 whole experts per device, F not split again
    with jax.set_mesh(mesh):
        got = forward(sharded, tokens, positions)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_megablox_per_device_on_eight_devices_equals_one_device_values_and_gradients():
    """megablox (a Mosaic kernel, which no compiler partitions) runs on each device's rows under `shard_map`
    (the TPU compiler refused it on a mesh before: tests/test_targets.py): 10 rows over 8 devices (padded to
    16), outputs and gradients of the input and of every weight equal the dense layer's on one device."""
    cfg = dataclasses.replace(CFG, moe_impl="megablox")
    p = _layer_params(cfg)
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
    valid, probe = jnp.ones((2, 5), bool), jax.random.normal(jax.random.key(2), (2, 5, cfg.d_model))

    def grads(c):
        def f(p, x):
            return jnp.sum(moe.mlp(x, p, valid, c)[0] * probe)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    want = grads(dataclasses.replace(cfg, moe_impl="dense"))(p, x)
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4), jax.devices()[:8])
    with jax.set_mesh(mesh):
        got = grads(cfg)(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_model_trains_and_reports_router_losses(tiny_cfg):
    moe_model = dataclasses.replace(tiny_cfg.model, num_experts=4, experts_per_token=2, router_z_coef=1e-3)
    cfg = dataclasses.replace(
        tiny_cfg, model=moe_model, training=dataclasses.replace(tiny_cfg.training, steps=40),
        optimizer=dataclasses.replace(tiny_cfg.optimizer, learning_rate=1e-2, warmup_steps=5, weight_decay=0.0),
    )  # fmt: skip
    _, losses = _step_n(cfg, [random_batch(cfg, seed=1)] * 40)
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])


def test_load_balancing_loss_reaches_the_router_gradient(tiny_cfg):
    """The load-balancing loss is in the training objective: router_aux_coef changes the router's gradient."""
    from jaxgen.training.step import loss_sum

    base = dataclasses.replace(tiny_cfg.model, num_experts=4, experts_per_token=2, moe_impl="dense")
    batch = random_batch(tiny_cfg, seed=2)
    params = model.init_params(base, jax.random.key(0))

    def router_grad(coef):
        cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(base, router_aux_coef=coef))
        grads = jax.jit(jax.grad(lambda p: loss_sum(p, batch, cfg)[0]))(params)
        return np.asarray(grads["layers"]["mlp"]["w_router_de"])

    without, with_aux = router_grad(0.0), router_grad(1.0)
    assert np.abs(with_aux - without).max() > 1e-3 * np.abs(without).max()
