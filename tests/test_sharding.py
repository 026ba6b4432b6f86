"""8 fake CPU devices on a (data, fsdp, tensor) = (2, 2, 2) mesh against 1 device."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxgen.config import MeshConfig
from jaxgen.sharding import make_mesh
from jaxgen.targets import hlo
from jaxgen.training.checkpoint import Checkpointer
from jaxgen.training.step import create_train_state, make_optimizer, make_train_step, put_batch, train_step
from tests.conftest import axis_collectives
from tests.test_train import random_batch


def _run(cfg, devices, steps=3):
    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    state = create_train_state(cfg, mesh)
    step = make_train_step(cfg, mesh, state)
    losses = []
    for i in range(steps):
        state, m = step(state, put_batch(random_batch(cfg, seed=i), mesh))
        losses.append((float(m["loss"]), float(m["grad_norm"])))  # the norm: Adam's update hides a gradient's scale
    return state, losses


@pytest.fixture(scope="module")
def runs(tiny_cfg):
    sharded_cfg = dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2))
    return _run(tiny_cfg, 1), _run(sharded_cfg, 8)


def _assert_equal(one, other):
    """Two `_run`s' losses, gradient norms and weights within float32 rounding of each other."""
    (single, l1), (state, l8) = one, other
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(state.params)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-6)


def test_eight_devices_equal_one(runs):
    _assert_equal(*runs)


def test_accumulated_gradients_are_summed_over_data_replicas_once_a_step(runs, tiny_cfg):
    """With `training.grad_accum` on data x fsdp x tensor, each data replica adds up its own rows' gradients
    over the micro-batches (2 rows each: one per fsdp device) and the replicas' sums are added once, after
    the last: in the compiled step no sum inside a loop runs across the data axis (the accumulation summed
    over data every micro-batch before), one after does. The steps equal one device's without accumulation."""
    training = dataclasses.replace(tiny_cfg.training, grad_accum=2)
    cfg = dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2), training=training)
    _assert_equal(runs[0], _run(cfg, 8))
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    state = create_train_state(cfg, mesh)
    step = jax.jit(functools.partial(train_step, cfg=cfg, tx=make_optimizer(cfg.optimizer, cfg.training.steps)))
    with jax.set_mesh(mesh):
        text = step.lower(state, put_batch(random_batch(cfg), mesh)).compile().as_text()
    inside, outside = axis_collectives(text, mesh)
    assert not inside and "all-reduce" in outside, (inside, outside)


def test_accumulating_whole_gradients_sums_over_fsdp_once_a_step(runs, tiny_cfg):
    """`training.accumulate_whole`: the weights gathered once a step, every device sums its own row's whole
    gradient over the micro-batches, and the sum over data and fsdp runs once, after the last: no all-gather,
    all-reduce or reduce-scatter inside a loop spans fsdp (the default gathers the weights and reduce-scatters
    each micro-batch's gradient over fsdp inside, which is checked too, so the test can tell the two apart).
    Equal to one device, in float32 and (the weights cast to bfloat16 before the gather) in bfloat16."""
    training = dataclasses.replace(tiny_cfg.training, grad_accum=2, accumulate_whole=True)
    cfg = dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2), training=training)
    _assert_equal(runs[0], _run(cfg, 8))
    # bfloat16: losses and gradient norms (the weights differ by Adam's first steps on near-zero gradients)
    bf16 = lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, dtype="bfloat16"))
    np.testing.assert_allclose(_run(bf16(cfg), 8, steps=2)[1], _run(bf16(tiny_cfg), 1, steps=2)[1], rtol=2e-3)
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    for whole in (True, False):
        c = dataclasses.replace(cfg, training=dataclasses.replace(training, accumulate_whole=whole))
        state = create_train_state(c, mesh)
        step = jax.jit(functools.partial(train_step, cfg=c, tx=make_optimizer(c.optimizer, c.training.steps)))
        with jax.set_mesh(mesh):
            text = step.lower(state, put_batch(random_batch(c), mesh)).compile().as_text()
        sums_in, sums_out = axis_collectives(text, mesh, "fsdp")
        gathers_in, _ = axis_collectives(text, mesh, "fsdp", ops=("all-gather",))
        if whole:
            assert not sums_in and not gathers_in and sums_out, (sums_in, gathers_in, sums_out)
        else:
            assert sums_in and gathers_in, (sums_in, gathers_in)


def test_replica_groups_are_read_in_every_form_xla_prints():
    expected = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.replica_groups("x = f32[] all-reduce(y), replica_groups={{0,4},{1,5},{2,6},{3,7}}") == expected
    assert hlo.replica_groups("x = f32[] all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=f") == expected
    by_mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true"
    assert hlo.replica_groups(f"x = f32[] all-reduce(y), {by_mesh}") == expected
    by_ids = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global"
    assert hlo.replica_groups(f"x = f32[] all-reduce(y), {by_ids}") == expected
    assert hlo.replica_groups("x = f32[] all-reduce(y), to_apply=f") is None
    assert hlo.replica_groups("x = f32[] all-reduce(y), replica_groups={}, to_apply=f") is None
    pairs = "x = f32[4] collective-permute(y), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}"
    assert hlo.replica_groups(pairs) == [[0, 1], [1, 0], [2, 3], [3, 2]]
    with pytest.raises(ValueError, match=r"a form not read here: '\{0,2\}"):
        hlo.replica_groups("x = f32[] all-reduce(y), replica_groups={0,2}<=unknown")


def test_parameters_and_optimizer_state_are_really_sharded(runs):
    _, (state, _) = runs
    w_q = state.params["layers"]["w_q_dnh"]  # (L, D, N, H): D over fsdp, N over tensor
    assert w_q.sharding.spec[1:3] == ("fsdp", "tensor")
    assert w_q.addressable_shards[0].data.shape == (w_q.shape[0], w_q.shape[1] // 2, w_q.shape[2] // 2, w_q.shape[3])
    embed = state.params["embed_vd"]  # (V, D): V over tensor, D over fsdp
    assert embed.addressable_shards[0].data.shape == (embed.shape[0] // 2, embed.shape[1] // 2)
    mu = state.opt_state[1][0].mu["layers"]["w_q_dnh"]  # AdamW's first moment follows the params
    assert mu.sharding.spec == w_q.sharding.spec
    assert len(w_q.sharding.device_set) == 8


def test_checkpoint_saved_on_eight_devices_restores_on_one(runs, tiny_cfg, tmp_path):
    _, (sharded, _) = runs
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, sharded, {"next_index": 24})
    ckpt.wait()
    target = create_train_state(tiny_cfg, make_mesh(tiny_cfg.mesh, jax.devices()[:1]))
    restored, data = Checkpointer(tmp_path).restore(3, target)
    assert data == {"next_index": 24}
    assert len(restored.params["embed_vd"].sharding.device_set) == 1
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(restored)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "features",
    [
        dict(qk_norm="full", norm_placement="post"),  # OLMo 2: a norm over heads split across devices
        dict(
            qk_norm="head",
            norm_placement="sandwich",
            norm_unit_offset=True,
            sliding_window=5,
            global_every=2,
            rope_local_theta=100.0,
            attn_softcap=2.0,
            final_softcap=5.0,
            query_scale=10.0,
        ),  # Gemma 2/3
    ],
    ids=["olmo2", "gemma"],
)
def test_newer_layer_features_on_eight_devices_equal_one_device(features):
    from jaxgen import model
    from jaxgen.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, **features)
    params = model.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape), params)  # norms too
    tokens = np.random.default_rng(0).integers(0, 128, (4, 16)).astype(np.int32)
    positions = np.tile(np.arange(16, dtype=np.int32), (4, 1))
    forward = jax.jit(lambda p: model.forward(p, tokens, positions, cfg=cfg)[0])
    want = forward(params)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        got = forward(jax.device_put(params, model.param_shardings(cfg, mesh)))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_an_embed_dimension_fsdp_does_not_divide_is_replicated_without_a_context_axis():
    """The `embed` rule falls back to a leading part of fsdp x context; on a mesh without context it is fsdp
    alone, and a dimension fsdp does not divide stays whole (as every rule's does)."""
    from jaxgen.sharding import logical_spec

    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    assert tuple(logical_spec(("embed",), (6,), mesh)) == (None,)
    assert tuple(logical_spec(("embed",), (8,), mesh)) == ("fsdp",)
