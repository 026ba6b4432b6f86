"""The Generator's decode loop compiled for an NVIDIA H200 (sm_90) without a GPU: the CUDA plugin compiles
for the target config in jaxgen/targets/specs/ under jax's cpu platform (`targets.gpu`, run as a
subprocess: the plugin registers only in a process that starts its backends so). Where the plugin is not
installed (`pip install '.[gpu-compile]'`), the test is skipped, saying so."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgen.targets import gpu as gpu_target

ROOT = Path(__file__).resolve().parent.parent
MAX_KERNELS_PER_LAYER = 20  # what a layer of the tiny model launches at batch 1: see the test's docstring


@pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))
def test_flat_layout_runs_no_cond_per_layer_and_blocks_one_per_block():
    """The tiny model's decode step (batch 1, 128 slots) compiled for sm_90, at 1 and 2 layers: with the
    flat layout (what `model.cache_layout=auto` takes on a GPU) a layer adds no conditional and at most
    MAX_KERNELS_PER_LAYER kernels (two cache writes, two attention products, the softmax's max and sum,
    its normalisation, and the norms, projections, rotary embedding and MLP around them, where XLA:GPU
    runs each batch-1 product of such tiny matrices as two kernels, a multiply and a reduction); with
    the blocks layout (XLA:CPU's; N = 2 blocks of 64) a layer adds 3N - 1 = 5 (a write per block, a skip
    per block but the first)."""
    cmd = [sys.executable, "-m", "jaxgen.targets.gpu", "--slots", "128"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    flat, blocks = counts["flat"], counts["blocks"]
    assert counts["device"].startswith("NVIDIA H200")
    assert flat["conditional"] == 0 and 0 < flat["kernels"] <= MAX_KERNELS_PER_LAYER, flat
    # once a step whatever the depth: the sampler's sort, and the penalties' counts and the alternatives, each
    # skipped when no row asks (a value-dependent choice, `decode.record`)
    assert flat["step"]["conditional"] <= 3, flat
    assert blocks["conditional"] == 5, blocks


@pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))
def test_a_bfloat16_model_given_float32_weights_casts_none_in_the_decode_step():
    """The tiny model in bfloat16 given its float32 master weights (what `targets.gpu` draws): the Generator
    holds them in bfloat16 (`model.decode_params`), so a layer launches what the float32 model's does.
    Before, the loop cast each weight at every step: 24 kernels a layer at 128 slots."""
    cmd = [sys.executable, "-m", "jaxgen.targets.gpu", "--slots", "128", "--layouts", "flat"]
    out = subprocess.run([*cmd, "--set", "model.dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    flat = json.loads(out.stdout.strip().splitlines()[-1])["flat"]
    assert flat["conditional"] == 0 and 0 < flat["kernels"] <= MAX_KERNELS_PER_LAYER, flat


@pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))
def test_the_engines_paged_decode_step_runs_no_cond_per_layer():
    """The serving engine's decode chunk (paged cache, 64 slots live, bfloat16 pages) compiled for sm_90: a
    layer adds no conditional and at most 15 kernels (issue 50's goal), the paged attention one Pallas kernel."""
    cmd = [
        sys.executable,
        "-m",
        "jaxgen.targets.gpu",
        "--slots",
        "128",
        "--rows",
        "64",
        "--layouts",
        "flat",
        "--engine",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    engine = json.loads(out.stdout.strip().splitlines()[-1])["engine"]
    assert engine["conditional"] == 0 and 0 < engine["kernels"] <= 15, engine
    assert engine["step"].get("custom-call", 0) == 1, engine  # one layer: its paged attention kernel


# a decode step at batch 1 on 8 GPUs, tensor parallel (a vocabulary-sharded embedding), printing its collectives,
# the HBM bytes counted from its kernels and the bytes each GPU holds
_BATCH_ONE_PROBE = """
import json, jax
jax.config.update("jax_platforms", "cpu")
from jaxgen import plan
from jaxgen.config import ModelConfig
from jaxgen.targets import catalog, devices
cfg = ModelConfig(vocab_size=8192, num_layers=1, d_model=512, num_heads=8, num_kv_heads=8, d_ff=1024,
                  max_seq_len=256, position="rope", norm="rmsnorm", mlp="swiglu")
mesh = devices.target_mesh(catalog.get("h100x8"), {"data": 1, "fsdp": 1, "tensor": 8})
with devices.traced_for("gpu"):
    decode = plan.inference_programs(cfg, mesh, 1, 256, 1, "bfloat16")[1]
held = sum(decode.parts.values())
print(json.dumps({"collectives": decode.costs.collectives, "held": held, "bytes": decode.costs.bytes}))
"""


@functools.cache
def _batch_one() -> dict:
    cmd = [sys.executable, "-c", _BATCH_ONE_PROBE]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))
def test_decoding_one_token_on_a_tensor_mesh_gathers_no_embedding_table():
    """XLA:GPU makes the lookup of one token's row a dynamic-slice, and its partitioner then gathered the
    vocabulary-sharded table whole on every GPU, every step (Llama 3.2 1B on 8 GPUs: 525 MB a step);
    `transformer._embed` looks one token up as two rows, which it partitions as a lookup per shard and a
    sum: no all-gather, a few kilobytes sent."""
    got = _batch_one()
    assert "all-gather" not in got["collectives"], got
    assert sum(got["collectives"].values()) < 0.01 * got["held"], got


@pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))
def test_decoding_at_batch_one_reads_each_weight_once():
    """XLA:GPU turns a one-row product into a multiply and a sum, and wrote the weight-sized multiply to memory
    first; `kernels.pads_one_row` makes each such product two rows, a gemm reading its weight once: the step
    moves no more than 1.3x what a GPU holds (weights, cache). With `kernels.pads_one_row` answering False it
    moved 2.9x (the CUDA plugin of jax 0.10.2, checked by hand)."""
    got = _batch_one()
    assert got["bytes"] <= 1.3 * got["held"], got
