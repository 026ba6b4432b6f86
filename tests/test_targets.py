"""Compiling for hardware this machine lacks (`jaxgen.targets`, `python -m jaxgen.plan --target`): refusals
without any compiler; with libtpu (the test extra), small programs compiled by the TPU compiler for a
v5e 2x2 slice, their memory and counts checked against what the shapes say."""

import dataclasses
import math
import re

import jax
import numpy as np
import pytest

from jaxgen import plan
from jaxgen.config import ModelConfig
from jaxgen.model import kernels
from jaxgen.targets import catalog, devices, hlo, roofline
from tests.conftest import axis_collectives

TPU = catalog.get("tpu-v5e-4")
# jax's persistent cache cannot load what a compile-only device's compiler wrote ("PjRtCompiler must be
# constructed with a Client"): it would only warn and compile again
SHARED_XLA_CACHE = False
needs_libtpu = pytest.mark.skipif(devices.unavailable(TPU) is not None, reason=str(devices.unavailable(TPU)))


def test_unknown_targets_meshes_and_missing_compilers_are_refused_in_one_line(monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"target 'tpu-v9-4' is not known: one of tpu-v5e-4, .*h200x8"):
        catalog.get("tpu-v9-4")
    with pytest.raises(ValueError, match=r"--mesh fsdp=2 is not allowed on tpu-v5e-4: 2 devices; the target has 4"):
        devices.target_mesh(TPU, {"data": 1, "fsdp": 2, "tensor": 1})
    monkeypatch.setitem(devices._MODULE, "tpu", "no_such_compiler_module")
    assert devices.unavailable(TPU) == (
        "the compiler for tpu-v5e-4 is not installed: pip install 'jaxgen[tpu-compile]' (libtpu, TPU's compiler)"
    )
    assert plan.main(["--config", "configs/tiny.yaml", "--target", "tpu-v5e-4", "--mesh", "fsdp=4"]) == 2
    assert "pip install 'jaxgen[tpu-compile]'" in capsys.readouterr().err
    assert plan.main(["--config", "configs/tiny.yaml", "--target", "v5e"]) == 2
    assert "target 'v5e' is not known" in capsys.readouterr().err


def test_every_target_is_laid_out_as_its_chips():
    for target in catalog.TARGETS.values():
        dims = [int(n) for n in target.topology.split(":")[-1].split("x")]
        assert dims and target.chips == math.prod(dims), target.name
    assert catalog.get("tpu-v5p-8").chips == 4  # v5p slices count TensorCores, two a chip
    assert catalog.get("h200x8x4").chips == 32


def test_collectives_are_read_from_hlo_text():
    text = "\n".join([
        "  %all-gather.1 = bf16[64,192]{1,0:T(8,128)} all-gather(%x), replica_groups=[2,2]<=[4], dimensions={0}",
        "  %all-reduce.2 = (f32[4,64]{1,0}, f32[]{:T(128)}) all-reduce(%a, %b), replica_groups={{0,1},{2,3}}",
        "  %rs = f32[32]{0} reduce-scatter(%c), replica_groups={{0,1,2,3}}, dimensions={0}",
        "  %ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%d), replica_groups={{0,1}}",
        "  %agd = f32[16]{0} all-gather-done(%ags)",
        '  %k = f32[8]{0} custom-call(%e), custom_call_target="tpu_custom_call"',
    ])  # fmt: skip
    assert roofline.collective_bytes(text) == {
        "all-gather": 64 * 192 * 2 + 16 * 4,  # the result; an async pair once, by its start's result
        "all-reduce": 2.0 * (4 * 64 * 4 + 4),  # sent twice: a reduce-scatter, then an all-gather
        "reduce-scatter": 32 * 4 * 4,  # the operand: the result times the group
    }
    assert roofline.custom_calls(text) == {"tpu_custom_call": 1}


def test_int8_products_are_read_from_hlo_text():
    text = "\n".join([
        "  %p0 = s8[16,128]{1,0} parameter(0)",
        "  %p1 = s8[128,256]{1,0} parameter(1)",
        "  %p2 = bf16[16,128]{1,0} parameter(2)",
        "  %c = s32[16,256]{1,0:T(8,128)} convolution(%p0, %p1), dim_labels=bf_io->bf",
        "  %d = s32[16,256]{1,0} dot(s8[16,128]{1,0} %p0, s8[128,256]{1,0} %p1), lhs_contracting_dims={1}",
        "  %f = f32[16,256]{1,0} dot(%p2, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        '  %r = s32[1024]{0} reduce(%m, %z), dimensions={1}, to_apply=%add, metadata={op_name="jit(f)/dot_general"}',
        '  %s = s32[] reduce(%n, %z), dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/reduce_sum"}',
        "  %t = f32[16,256]{1,0} dot(bf16[16,128]{1,0:T(8,128)(2,1)} %p2, s8[128,256]{1,0:T(8,128)(4,1)} %p1)",
    ])  # fmt: skip
    assert hlo.int8_products(text) == 3  # not the bf16 x int8 products, nor a sum that was no product


def test_flops_and_bytes_are_counted_from_hlo_kernels():
    # what XLA:GPU without a GPU leaves to count: a product fused with its operands, and a fusion that only
    # slices a row out of a table (it reads the row, not the table)
    text = """
%fused_dot (p0: bf16[256,512], p1: bf16[512,384]) -> bf16[256,384] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[512,384]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,384]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_row (q0: bf16[1000,512], q1: s32[]) -> f32[1,512] {
  %q0 = bf16[1000,512]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,512]{1,0} dynamic-slice(%q0, %q1, %c), dynamic_slice_sizes={1,512}
  ROOT %cv = f32[1,512]{1,0} convert(%ds)
}

ENTRY %main (a: bf16[256,512], b: bf16[512,384], t: bf16[1000,512], i: s32[]) -> (bf16[256,384], f32[1,512]) {
  %a = bf16[256,512]{1,0} parameter(0)
  %b = bf16[512,384]{1,0} parameter(1)
  %t = bf16[1000,512]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %f = bf16[256,384]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %r = f32[1,512]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_row
  ROOT %out = (bf16[256,384]{1,0}, f32[1,512]{1,0}) tuple(%f, %r)
}
"""
    flops, accessed = hlo.hlo_counts(text)
    assert flops == 2 * 256 * 384 * 512
    assert accessed == (256 * 512 + 512 * 384 + 256 * 384) * 2 + (512 * 2 + 4) + 512 * 4


def test_bytes_in_on_chip_memory_are_not_counted_as_hbm_traffic():
    # what the TPU compiler's memory-space assignment writes: a weight prefetched into on-chip memory (S(1)) by
    # an async copy and a slice of another, products reading the copies, a cache written in place, and an
    # embedding row gathered; the copies read HBM once, the products read on-chip memory
    text = """
%fused_mv (p0: bf16[512,384], p1: bf16[512]) -> f32[384] {
  %p0 = bf16[512,384]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[512]{0:T(512)S(1)} parameter(1)
  %b = bf16[512,384]{1,0:T(8,128)(2,1)} broadcast(%p1), dimensions={0}
  %m = bf16[512,384]{1,0:T(8,128)(2,1)} multiply(%p0, %b)
  %c = f32[512,384]{1,0:T(8,128)} convert(%m)
  %z = f32[] constant(0)
  ROOT %r = f32[384]{0:T(512)} reduce(%c, %z), dimensions={0}, to_apply=%add
}

%fused_row (q0: bf16[1000,512], q1: s32[1,1]) -> bf16[1,512] {
  %q0 = bf16[1000,512]{1,0:T(8,128)(2,1)} parameter(0)
  %q1 = s32[1,1]{1,0} parameter(1)
  ROOT %g = bf16[1,512]{1,0:T(8,128)(2,1)} gather(%q0, %q1), offset_dims={1}, slice_sizes={1,512}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main () -> (f32[384], bf16[64,512]) {
  %w = bf16[512,384]{1,0:T(8,128)(2,1)} parameter(0)
  %v = s8[393216]{0:T(1024)(128)(4,1)} parameter(1)
  %t = bf16[1000,512]{1,0:T(8,128)(2,1)} parameter(2)
  %i = s32[1,1]{1,0} parameter(3)
  %k = bf16[64,512]{1,0:T(8,128)(2,1)} parameter(4)
  %u = bf16[1,512]{1,0:T(8,128)(2,1)} parameter(5)
  %j = s32[] parameter(6)
  %cs = (bf16[512,384]{1,0:T(8,128)(2,1)S(1)}, bf16[512,384]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[512,384]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %ss = ((s8[393216]{0:T(1024)}), s8[131072]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%v), slice={[0:131072]}
  %sd = s8[131072]{0:T(1024)S(1)} slice-done(%ss)
  %row = bf16[1,512]{1,0:T(8,128)(2,1)} fusion(%t, %i), kind=kLoop, calls=%fused_row
  %x = bf16[512]{0:T(512)S(1)} bitcast(%row)
  %y = f32[384]{0:T(512)} fusion(%cd, %x), kind=kOutput, calls=%fused_mv
  %kw = bf16[64,512]{1,0:T(8,128)(2,1)} dynamic-update-slice(%k, %u, %j, %j)
  %ev = (bf16[512,384]{1,0:T(8,128)(2,1)}, bf16[512,384]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%cd)
  %evd = bf16[512,384]{1,0:T(8,128)(2,1)} copy-done(%ev)
  ROOT %out = (f32[384]{0:T(512)}, bf16[64,512]{1,0:T(8,128)(2,1)}, bf16[512,384]{1,0}) tuple(%y, %kw, %evd)
}
"""
    _, accessed = hlo.hlo_counts(text, memory_spaces=True)
    weight, sliced, row, cache_write = 512 * 384 * 2, 131072, 512 * 2, 512 * 2
    gathered = row + 4 + row  # the row and its index read, the row written
    evicted = weight  # the copy back to HBM: written there, read on chip
    assert accessed == weight + sliced + gathered + 384 * 4 + 2 * cache_write + evicted
    assert hlo.hlo_counts(text)[1] > accessed + 2 * weight  # every array as HBM: the copies count again
    assert hlo.hbm_bytes("(bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, f32[4]{0}, u32[]{:S(2)})") == 16


def test_a_fusion_updating_its_parameter_in_place_moves_the_update():
    # a cache write fused with what computes the entry (XLA:GPU's decode step: rotary embedding, then the
    # write): the fusion's output is its buffer parameter's, so it reads its inputs and writes the update
    text = """
%fused_write (p0: bf16[64,8192,128], p1: f32[64,128], p2: s32[]) -> bf16[64,8192,128] {
  %p0 = bf16[64,8192,128]{2,1,0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %cv = bf16[64,128]{1,0} convert(%p1)
  %u = bf16[64,1,128]{2,1,0} bitcast(%cv)
  %z = s32[] constant(0)
  %buf = bf16[64,8192,128]{2,1,0} bitcast(%p0)
  ROOT %w = bf16[64,8192,128]{2,1,0} dynamic-update-slice(%buf, %u, %z, %p2, %z)
}

%fused_copy (q0: bf16[64,8192,128], q1: f32[64,128], q2: s32[]) -> bf16[64,8192,128] {
  %q0 = bf16[64,8192,128]{2,1,0} parameter(0)
  %q1 = f32[64,128]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %n = bf16[64,8192,128]{2,1,0} negate(%q0)
  %cv = bf16[64,128]{1,0} convert(%q1)
  %u = bf16[64,1,128]{2,1,0} bitcast(%cv)
  %z = s32[] constant(0)
  ROOT %w = bf16[64,8192,128]{2,1,0} dynamic-update-slice(%n, %u, %z, %q2, %z)
}

%fused_read (r0: bf16[64,8192,128], r1: f32[64,128], r2: s32[]) -> bf16[64,8192,128] {
  %r0 = bf16[64,8192,128]{2,1,0} parameter(0)
  %r1 = f32[64,128]{1,0} parameter(1)
  %r2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = bf16[64,1,128]{2,1,0} dynamic-slice(%r0, %z, %r2, %z), dynamic_slice_sizes={64,1,128}
  %cv = bf16[64,128]{1,0} convert(%r1)
  %u = bf16[64,1,128]{2,1,0} bitcast(%cv)
  %sum = bf16[64,1,128]{2,1,0} add(%old, %u)
  ROOT %w = bf16[64,8192,128]{2,1,0} dynamic-update-slice(%r0, %sum, %z, %r2, %z)
}

ENTRY %main () -> (bf16[64,8192,128], bf16[64,8192,128], bf16[64,8192,128]) {
  %k = bf16[64,8192,128]{2,1,0} parameter(0)
  %e = f32[64,128]{1,0} parameter(1)
  %j = s32[] parameter(2)
  %kw = bf16[64,8192,128]{2,1,0} fusion(%k, %e, %j), kind=kLoop, calls=%fused_write
  %kn = bf16[64,8192,128]{2,1,0} fusion(%k, %e, %j), kind=kLoop, calls=%fused_copy
  %kr = bf16[64,8192,128]{2,1,0} fusion(%k, %e, %j), kind=kLoop, calls=%fused_read
  ROOT %out = (bf16[64,8192,128]{2,1,0}, bf16[64,8192,128]{2,1,0}, bf16[64,8192,128]{2,1,0}) tuple(%kw, %kn, %kr)
}
"""
    _, accessed = hlo.hlo_counts(text)
    cache, entry = 64 * 8192 * 128 * 2, 64 * 128
    in_place = entry * 4 + 4 + entry * 2  # the new entries (f32) and the index read, the update written
    rewritten = cache + entry * 4 + 4 + cache  # a buffer computed anew (negated) is read and written whole
    read_too = cache + entry * 4 + 4 + cache  # a buffer the fusion also reads: counted whole, as before
    assert accessed == in_place + rewritten + read_too


@pytest.fixture(scope="module")
def tpu_mesh():
    return devices.target_mesh(TPU, {"data": 1, "fsdp": 2, "tensor": 2})


@pytest.fixture(scope="module")
def small_cfg(tiny_cfg):
    """configs/tiny.yaml at TPU-tile sizes (multiples of 128: the compiler pads nothing) and a 128-token
    sequence, so attention is the splash kernel."""
    model = dataclasses.replace(tiny_cfg.model, d_model=128, d_ff=256, num_heads=2, num_kv_heads=2, attention_block=128)
    data = dataclasses.replace(tiny_cfg.data, seq_len=128)
    return dataclasses.replace(
        tiny_cfg, model=model, data=data, training=dataclasses.replace(tiny_cfg.training, batch_size=16)
    )


@needs_libtpu
def test_the_train_step_compiles_for_a_tpu_slice_with_splash_inside_shard_map(small_cfg, tpu_mesh):
    with devices.traced_for("tpu"):
        params, opt_state, _, memory, costs, text = plan._train_step(small_cfg, tpu_mesh)
    assert memory.argument_size_in_bytes < 2**40, "the compiler refused it"
    state = plan.per_device_bytes(params) + plan.per_device_bytes(opt_state)
    assert memory.alias_size_in_bytes >= state  # the donated state really is written over, not copied
    # what the step takes is the state and the batch: the shapes' bytes per device (the matrices and their
    # moments split 4 ways, the batch's rows 2 ways), which the compiler pads up to its (8, 128) tiles
    exact = plan.per_device_bytes(params) + plan.per_device_bytes(opt_state) + 5 * 16 * 128 * 4 / 2
    assert exact <= memory.argument_size_in_bytes <= 1.5 * exact
    assert costs.kernels.get("tpu_custom_call", 0) >= 2  # splash forward and backward, lowered by Mosaic
    # fsdp gathers each layer's weights inside the layer loop (not the whole stack before it), and neither
    # loop moves anything to the host
    comps = hlo.computations(text)
    bodies = [re.search(r"body=%?([\w.\-]+)", line).group(1) for line in comps["ENTRY"] if " while(" in line]
    inside = lambda body: "\n".join(line for c in hlo.reachable(comps, body) for line in comps[c])
    assert bodies and all(roofline.collective_bytes(inside(b)).get("all-gather") for b in bodies)
    whole = {tuple(x.shape) for x in jax.tree.leaves(params["layers"])}  # a stacked (L, ...) weight, gathered
    gathered = [hlo.dims_of(line.split(" = ")[1]) for line in comps["ENTRY"] if " all-gather" in line]
    assert not [d for d in gathered if tuple(d) in whole]
    assert not re.search(r" (send|recv|infeed|outfeed)\(|host_callback|xla_python_cpu_callback", text)


@needs_libtpu
def test_accumulated_gradients_are_summed_over_data_once_a_step_on_the_tpu_compiler(small_cfg):
    """Gradient accumulation on a data x fsdp v5e slice: libtpu's program sums nothing across the data axis
    inside its loops (micro-batches, layers) and the gradients once after them; with
    `training.accumulate_whole`, nothing across fsdp either."""
    cfg = dataclasses.replace(small_cfg, training=dataclasses.replace(small_cfg.training, grad_accum=2))
    mesh = devices.target_mesh(TPU, {"data": 2, "fsdp": 2, "tensor": 1})
    with devices.traced_for("tpu"):
        *_, text = plan._train_step(cfg, mesh)
    inside, outside = axis_collectives(text, mesh)
    assert not inside and "all-reduce" in outside, (inside, outside)
    # training.accumulate_whole: the weights gathered once, nothing summed across fsdp inside the loops either
    whole = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, accumulate_whole=True))
    with devices.traced_for("tpu"):
        *_, text = plan._train_step(whole, mesh)
    for axis in ("data", "fsdp"):
        inside, outside = axis_collectives(text, mesh, axis)
        assert not inside and outside, (axis, inside, outside)
    assert not axis_collectives(text, mesh, "fsdp", ops=("all-gather",))[0]


@needs_libtpu
def test_on_a_context_mesh_no_activation_holds_the_whole_sequence_on_the_tpu_compiler(small_cfg):
    """The train step on a v5e context=4 slice (ring attention), rows of 3072 tokens (a length no other axis
    has): no array in libtpu's partitioned program has a dimension of the whole sequence but the batch's own
    (B, T) token ids, positions and loss mask (replicated over context: a few bytes a token), where each
    chip's quarter is everywhere. The products once
    flattened (B, T) into one axis and the partitioner gathered the whole sequence for them (queries, keys,
    values, the MLP's activations and the layer scan's stacks of them); on one chip it is there too, so
    the test can tell."""
    b, t = 2, 3072
    model = dataclasses.replace(small_cfg.model, max_seq_len=t, attention_impl="ring")
    cfg = dataclasses.replace(small_cfg, model=model, data=dataclasses.replace(small_cfg.data, seq_len=t),
                              training=dataclasses.replace(small_cfg.training, batch_size=b))  # fmt: skip
    whole = {}
    for context in (4, 1):
        mesh = devices.target_mesh(TPU, {"data": 1, "fsdp": 4 // context, "tensor": 1, "context": context})
        with devices.traced_for("tpu"):
            *_, text = plan._train_step(cfg, mesh)
        arrays = {(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in hlo.ARRAY.findall(text)}
        ids = lambda dtype, shape: shape == (b, t) and dtype in ("s32", "pred", "f32")  # the batch's, its mask
        whole[context] = {(d, s) for d, s in arrays if t in s and not ids(d, s)}
        assert any(t // context in s for _, s in arrays)
    assert not whole[4], whole[4]
    assert whole[1]


@needs_libtpu
def test_a_mixture_of_experts_train_step_compiles_for_a_tpu_slice_with_megablox(small_cfg, tpu_mesh):
    """moe_impl auto is megablox on TPU, a Mosaic kernel the compiler does not partition: on a mesh it runs
    per device under shard_map (before, libtpu refused the step: "Mosaic kernels cannot be automatically
    partitioned")."""
    model = dataclasses.replace(small_cfg.model, num_experts=4, experts_per_token=2)
    with devices.traced_for("tpu"):
        memory, costs = plan._train_step(dataclasses.replace(small_cfg, model=model), tpu_mesh)[3:5]
    assert memory.argument_size_in_bytes < 2**40, "the compiler refused it"
    # in the layer loop's body: splash forward and backward (2), megablox's three grouped products forward
    # and their six gradients (each of x and of the weights) backward
    assert costs.kernels.get("tpu_custom_call", 0) >= 2 + 3 + 6


def test_attention_flops_the_compiler_misses_are_added(small_cfg):
    # the compiler does not see inside a custom call, and counts a loop's body once: the model's attention
    # flops stand in for splash's and blockwise's
    mesh = devices.target_mesh(None, {"data": 1, "fsdp": 2, "tensor": 2})
    m = small_cfg.model
    per_device = 12 * m.num_layers * 128 * m.num_heads * m.head_size * 16 * 128 / 4
    with devices.traced_for("tpu"):
        assert plan.kernel_attention_flops(small_cfg, mesh) == per_device
        remat = dataclasses.replace(small_cfg, model=dataclasses.replace(m, remat="full"))
        assert plan.kernel_attention_flops(remat, mesh) == per_device * 16 / 12  # the forward once more
    with devices.traced_for("cpu"):  # blockwise: a loop over key blocks, counted once by the compiler
        assert plan.kernel_attention_flops(small_cfg, mesh) == per_device
        dense = dataclasses.replace(small_cfg, model=dataclasses.replace(m, attention_impl="dense"))
        assert plan.kernel_attention_flops(dense, mesh) == 0  # a product the compiler counts whole


@needs_libtpu
def test_the_counts_of_a_scanned_step_extrapolate_those_of_the_unrolled_one(tiny_cfg, tpu_mesh):
    deeper = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, num_layers=3))
    with devices.traced_for("tpu"):
        unrolled = plan._train_step(deeper, tpu_mesh, unrolled=True)[4]
        line = plan.train_costs(deeper, tpu_mesh)  # from unrolled compiles at 1 and 2 layers
        hidden = plan.kernel_attention_flops(deeper, tpu_mesh)
    assert line.flops == pytest.approx(unrolled.flops + hidden, rel=1e-6)  # layers alike: exactly linear in depth
    assert line.bytes == pytest.approx(unrolled.bytes, rel=0.05)


@needs_libtpu
def test_plan_on_the_tpu_compiler_names_it_and_estimates(capsys):
    assert plan.main(["--config", "configs/tiny.yaml", "--target", "tpu-v5e-4", "--mesh", "fsdp=2,tensor=2",
                      "--slots", "4", "mesh.data=1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "compiled by libtpu for 4 x TPU v5 lite"
    assert "temporaries (libtpu)" in out and "XLA:CPU" not in out
    assert "estimate (roofline of TPU v5 lite, not measured)" in out and "MFU" in out and "HBM floor" in out


@needs_libtpu
def test_a_decode_step_on_a_tpu_slice_reads_its_weights_and_cache_about_once():
    """Decoding one token at batch 1 on 4 chips (tensor parallel, as serving lays it out) moves about the
    weights and the cache each chip holds: HBM bytes counted by memory space (`hlo.hlo_counts`). The
    compiler's own "bytes accessed" counts its prefetches of weights into on-chip memory as HBM traffic
    three times (3.9x here)."""
    cfg = ModelConfig(vocab_size=8192, num_layers=2, d_model=1024, num_heads=8, num_kv_heads=4, d_ff=4096,
                      max_seq_len=2048, position="rope", norm="rmsnorm", mlp="swiglu")  # fmt: skip
    mesh = devices.target_mesh(TPU, {"data": 1, "fsdp": 1, "tensor": 4})
    with devices.traced_for("tpu"):
        decode = plan.inference_programs(cfg, mesh, 1, 2048, 1, "bfloat16")[1]
    held = sum(decode.parts.values())  # per chip: bfloat16 weights and the cache
    assert 0.9 * held < decode.costs.bytes < 1.2 * held, (decode.costs.bytes, held)


@needs_libtpu
def test_int8_weights_compile_for_a_tpu_slice_as_int8_products(small_cfg, tpu_mesh):
    """`--quantize int8` (serve.quantize's weights): the TPU compiler keeps every matrix product of the
    attention and the MLP in int8 (q, k, v, o, gate, up, down: 7 a layer), in the prefill and the decode
    step, and in the engine's prefill call and decode chunk (`--engine`), and the planner says so."""
    with devices.traced_for("tpu"):
        programs = plan.inference_programs(small_cfg.model, tpu_mesh, 1, 128, 32, "bfloat16", quantize="int8")
    # (one slot: the decode step's products have one row, which libtpu computes as a multiply and an int32 sum)
    assert [p.name for p in programs] == ["prefill (32 tokens x 1 slots)", "decode step (1 slots)"]
    for program in programs:
        assert program.costs.int8_products >= 7 * small_cfg.model.num_layers, program
        assert "parameters (int8 + bfloat16)" in program.parts
    lines = plan.roofline_lines(small_cfg, programs[1], TPU, 4)  # (the line --quantize adds)
    assert f"int8 by int8 in the compiled program: {programs[1].costs.int8_products}" in lines[-1]
    # the engine's own steps (`--engine`): its prefill call and decode chunk over the paged cache
    serve = dataclasses.replace(small_cfg.serve, slots=8, num_pages=64, prefill_chunk=256, grammar_states=16)
    with devices.traced_for("tpu"):
        engine = plan.engine_programs(dataclasses.replace(small_cfg, serve=serve), tpu_mesh, "bfloat16", "int8")
    assert [p.name.split(" (")[0] for p in engine] == ["engine prefill", "engine decode chunk"]
    for program in engine:
        assert not program.oom and program.costs.int8_products >= 7 * small_cfg.model.num_layers, program


@needs_libtpu
def test_the_engines_decode_chunk_runs_the_tpu_paged_kernel_lowered_by_mosaic(small_cfg):
    """With a bfloat16 page pool, the engine's decode chunk reads the pages with the TPU Pallas paged-attention
    kernel (`kernels.paged_tpu`), lowered by Mosaic: a custom call per layer, on one chip and on a data x
    tensor mesh of 4 (inside shard_map), for v5e and v6e; its prefill call keeps attention's XLA loop. A
    float32 pool keeps the loop in both."""
    chip = lambda target: jax.sharding.Mesh(
        np.array(devices.compile_devices(target)[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor")
    )  # fmt: skip
    one, v6e = chip(TPU), chip(catalog.get("tpu-v6e-4"))
    four = devices.target_mesh(TPU, {"data": 2, "fsdp": 1, "tensor": 2})
    serve = dataclasses.replace(small_cfg.serve, slots=8, num_pages=64, prefill_chunk=256, grammar_states=16)
    cfg = dataclasses.replace(small_cfg, model=dataclasses.replace(small_cfg.model, d_model=256, num_heads=2))
    assert (cfg.model.head_size, cfg.model.kv_heads) == (128, 2)  # heads Mosaic lowers it for; 1 a device
    calls = {}
    for name, dtype, mesh in (("v5e", "bfloat16", one), ("v5e", "float32", one), ("v5e", "bfloat16", four),
                              ("v6e", "bfloat16", v6e)):  # fmt: skip
        run = dataclasses.replace(cfg, serve=dataclasses.replace(serve, cache_dtype=dtype))
        with devices.traced_for("tpu"):
            prefill, chunk = plan.engine_programs(run, mesh, "bfloat16")
        calls[name, dtype, mesh.size] = [p.costs.kernels.get("tpu_custom_call", 0) for p in (prefill, chunk)]
    layers = cfg.model.num_layers
    assert calls == {("v5e", "bfloat16", 1): [0, layers], ("v5e", "float32", 1): [0, 0],
                     ("v5e", "bfloat16", 4): [0, layers], ("v6e", "bfloat16", 1): [0, layers]}  # fmt: skip
    assert "multiple of 128, got 64" in kernels.paged_tpu.unfit(small_cfg.model, "tpu", 16, bfloat16=True)


@needs_libtpu
def test_a_matrix_product_counts_its_flops_exactly():
    (device,) = devices.compile_devices(catalog.get("tpu-v5e-4"))[:1]
    x = jax.ShapeDtypeStruct((256, 512), jax.numpy.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
    w = jax.ShapeDtypeStruct((512, 384), jax.numpy.bfloat16, sharding=x.sharding)
    costs = roofline.costs_of(jax.jit(lambda a, b: a @ b).lower(x, w).compile())
    assert costs.flops == 2 * 256 * 512 * 384
    est = roofline.estimate(costs, TPU.chip)
    assert est.compute == pytest.approx(costs.flops / 197e12) and est.seconds >= est.memory
