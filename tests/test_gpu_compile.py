"""The Generator's decode loop compiled for an NVIDIA H200 (sm_90) without a GPU: the CUDA plugin compiles
for the target config in bench/gpu_specs/ under JAX_PLATFORMS=cpu (`kernels.gpu_target`). Where the plugin
is not installed (`pip install '.[gpu-compile]'`), these tests are skipped, saying so."""

import dataclasses
import functools
from pathlib import Path

import jax
import pytest

from jaxgen import model
from jaxgen.config import load_config
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model.kernels import gpu_target
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "bench" / "gpu_specs" / "h200.txtpb"
MAX_KERNELS_PER_LAYER = 20  # see test_flat_layout_runs_no_cond_per_layer for what a layer's kernels are

pytestmark = pytest.mark.skipif(gpu_target.unavailable() is not None, reason=str(gpu_target.unavailable()))


@functools.cache
def _step_ops(layout: str, layers: int):
    """The operations of one step of the tiny model's decode loop (batch 1, 128 slots) compiled for sm_90."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    cfg = dataclasses.replace(cfg, num_layers=layers, cache_layout=layout)
    gen = Generator(model.init_params(cfg, jax.random.key(0)), cfg, Tokenizer.byte_level(), max_batch=1, chunk_steps=8)
    device = gpu_target.cuda_device(SPEC.read_text())
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    return gpu_target.loop_ops(gpu_target.decode_loop_text(gen, [[1, 2, 3]], greedy, device))


def test_flat_layout_runs_no_cond_per_layer():
    """The flat layout (what `model.cache_layout=auto` takes on a GPU): a second layer adds no
    conditional and at most MAX_KERNELS_PER_LAYER kernels to a step. (A layer's kernels, tiny model at
    batch 1: two cache writes, two attention products, the softmax's max and sum, the normalisation, and
    the norms, projections, rotary embedding and MLP around them, where XLA:GPU runs each batch-1 product
    of these tiny matrices as two kernels, a multiply and a reduction.)"""
    one, two = _step_ops("flat", 1), _step_ops("flat", 2)
    assert two["conditional"] == one["conditional"] <= 1, (one, two)  # the sampler's, once a step
    assert 0 < two["total"] - one["total"] <= MAX_KERNELS_PER_LAYER, (one, two)


def test_blocks_layout_runs_conds_per_block():
    """The blocks layout (XLA:CPU's) at 128 slots (N = 2 blocks): a layer adds 3N - 1 = 5 conditionals to
    a step (a write per block, a skip per block but the first), which the flat layout does not."""
    one, flat = _step_ops("blocks", 1), _step_ops("flat", 1)
    assert one["conditional"] - flat["conditional"] == 5, (one, flat)
