"""Kernels behind the attention seam, and which one runs where (and, when the one asked for cannot, why).

    masks.py      what the fused sequence kernels share: masks by index, a static window per layer
    cudnn.py      cuDNN's fused flash attention for whole sequences (`jax.nn.dot_product_attention`; GPU)
    splash.py     the Pallas splash kernel for whole sequences (TPU; elsewhere in interpret mode)
    paged_gpu.py  the GPU Pallas paged-attention kernel for a decode step over the engine's page pool
    paged_tpu.py  the TPU Pallas paged-attention kernel for the same step (bfloat16 pools)
    cpu.py        XLA:CPU-only tuning of cached attention's decode step (products as sums, 64-slot parts)

`choose(cfg)` and `fit_length` pick the whole-sequence implementation (`model.attention_impl`);
`cache_layout(cfg)` how the contiguous cache holds a layer's slots (`model.cache_layout`);
`pads_one_row()` whether a one-row matrix product runs as two rows (XLA:GPU's batch-1 decode);
`decode_kernel(cfg, cache, T)` says whether a cached call runs the fused decode kernel its cache names
(`Cache.decode_kernel`, a key of `DECODE_KERNELS`: the one registration a decode kernel needs) or
attention's XLA block loop (`model.decode_impl`). A reason a kernel cannot run is logged once.

This package imports nothing else of `jaxgen.model`: each kernel is told the logit scale and is handed
its cache's arrays as float views (`Cache.decode_inputs`): the model imports the kernels, never the
other way round.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax

from jaxgen.config import ModelConfig
from jaxgen.model.kernels import cpu, cudnn, paged_gpu, paged_tpu, splash
from jaxgen.sharding import axis_size, context_size

log = logging.getLogger(__name__)

# name -> module with unfit(cfg, backend, **facts) and attention
DECODE_KERNELS = {"paged_gpu": paged_gpu, "paged_tpu": paged_tpu}

cudnn_unfit, cudnn_mask, cudnn_attention = cudnn.unfit, cudnn.mask, cudnn.attention
splash_unfit, splash_attention = splash.unfit, splash.attention
paged_unfit = paged_gpu.unfit

__all__ = [
    "DECODE_KERNELS",
    "DecodeKernel",
    "cache_layout",
    "choose",
    "cpu",
    "cudnn_attention",
    "cudnn_mask",
    "cudnn_unfit",
    "decode_attention",
    "decode_kernel",
    "fit_length",
    "pads_one_row",
    "paged_kernel",
    "paged_unfit",
    "splash_attention",
    "splash_unfit",
]


class DecodeKernel(NamedTuple):
    """A cache's claim on a fused decode kernel (`Cache.decode_kernel`): which one, and the facts about the
    cache that kernel's `unfit` checks (its keyword arguments; paged_gpu: page_size, quantized)."""

    name: str  # a key of DECODE_KERNELS, or "paged": the backend's paged kernel (`paged_kernel`)
    facts: dict


def choose(cfg: ModelConfig, backend: str | None = None) -> str:
    """The implementation that runs for `cfg.attention_impl` on `backend` (default: jax's):
    dense, blockwise, cudnn or splash; ring or allgather (jaxgen.model.context) under a mesh with a
    context axis, where auto means ring (without one they mean blockwise). A fused kernel whose
    constraints do not hold falls back to blockwise, with the reason logged once. A deterministic model
    runs blockwise everywhere: that path is its tiled fold (attention.tiled_attention)."""
    if cfg.deterministic:
        return "blockwise"
    backend = backend or jax.default_backend()
    impl = cfg.attention_impl
    if impl in ("ring", "allgather") or (impl == "auto" and context_size() > 1):
        return "blockwise" if context_size() == 1 else ("ring" if impl == "auto" else impl)
    if impl in ("dense", "blockwise"):
        return impl
    if impl == "auto":
        impl = {"tpu": "splash", "gpu": "cudnn"}.get(backend, "blockwise")
        if impl == "blockwise":
            return impl
    reason = splash.unfit(cfg, backend) if impl == "splash" else cudnn.unfit(cfg, backend)
    if reason:
        _warn_once(f"model.attention_impl={cfg.attention_impl}: {impl} cannot run ({reason}); using blockwise")
        return "blockwise"
    return impl


def cache_layout(cfg: ModelConfig, backend: str | None = None) -> str:
    """How the contiguous cache (`jaxgen.model.kvcache.KVCache`) holds a layer's slots on `backend`
    (default: jax's), for `cfg.cache_layout`: "blocks" (up to MAX_BLOCKS buffers, each written and read
    under a `lax.cond`, so a step touches the blocks in use only) or "flat" (one buffer, written without a
    cond and read in one masked pass). auto: blocks on XLA:CPU, where they were measured faster (a bf16
    cache updated in place, products over the blocks in use only: docs/performance.md, "KV cache
    layout"); flat on GPU and TPU, where every cond is a dependent launch (3N - 1 per layer with N blocks)
    and reading the whole layer in one pass costs little. The one place this choice is made."""
    if cfg.cache_layout != "auto":
        return cfg.cache_layout
    return "blocks" if (backend or jax.default_backend()) == "cpu" else "flat"


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def fit_length(impl: str, t: int, cfg: ModelConfig) -> str:
    """`impl` for a sequence of `t` tokens, or blockwise (said once) where the kernel cannot take that
    length: splash tiles T by blocks that are multiples of 128; cuDNN needs an even T."""
    reason = None
    block = min(cfg.attention_block, t)
    if impl == "splash" and (t % block or block % 128):
        reason = f"splash needs T a multiple of a block that is a multiple of 128; T={t}, block={block}"
    if impl == "cudnn" and t % 2:
        reason = f"cuDNN needs an even T, got {t}"
    if reason:
        _warn_once(f"{reason}; using blockwise for this length")
        return "blockwise"
    return impl


def pads_one_row(backend: str | None = None) -> bool:
    """Whether a matrix product of one row (decoding at batch 1) runs as a product of two rows, the row and
    zeros, on `backend` (default: jax's). On a GPU: XLA:GPU turns a vector-matrix product into a multiply and
    a sum, and writes the weight-sized multiply to memory before summing it (the whole weight read twice and
    written once) where the vector comes out of a norm, an activation or attention, which is nearly every
    product of a decode step; two rows make it a gemm that reads the weight once (docs/accelerators.md,
    "Decode against the HBM floor"). Not under an fsdp axis: XLA:GPU 0.10.2's partitioner fails on the
    padded product over fsdp=8, and a batch-1 step there gathers each weight anyway. Elsewhere one row stays
    one row (XLA:CPU and TPU read a weight once either way)."""
    return (backend or jax.default_backend()) == "gpu" and axis_size("fsdp") == 1


def paged_kernel(backend: str | None = None) -> str:
    """The fused decode kernel a paged cache names on `backend` (default: jax's): TPU's own on a TPU, else
    the GPU one (which decode_impl=pallas runs in interpret mode off a GPU)."""
    return "paged_tpu" if (backend or jax.default_backend()) == "tpu" else "paged_gpu"


def decode_kernel(cfg: ModelConfig, cache, num_queries: int, backend: str | None = None) -> str | None:
    """The fused decode kernel this cached attention call runs (a key of DECODE_KERNELS), or None for
    attention's XLA block loop: a decode step (one query per row) over a cache that names a kernel
    (`cache.decode_kernel`; the paged cache names "paged": `paged_kernel(backend)`), with `model.decode_impl`
    pallas, or auto on the kernel's backend, and the kernel's constraints met (with pallas, a reason it cannot
    run is logged once; auto falls back to the loop without a word)."""
    claim = cache.decode_kernel
    if claim is None or num_queries != 1 or cfg.decode_impl == "xla":
        return None
    backend = backend or jax.default_backend()
    name = paged_kernel(backend) if claim.name == "paged" else claim.name
    reason = DECODE_KERNELS[name].unfit(cfg, backend, **claim.facts)
    if reason and cfg.decode_impl == "pallas":
        _warn_once(f"model.decode_impl=pallas: the {name} kernel cannot run ({reason}); using the XLA loop")
    return None if reason else name


def decode_attention(name: str, q_btnh, inputs, q_pos_bt, *, scale: float, softcap: float | None):
    """Kernel `name`'s attention of one query per row (B, 1, N, H) over `inputs` (what the cache hands it:
    `Cache.decode_inputs`): (B, 1, N, H)."""
    return DECODE_KERNELS[name].attention(q_btnh, inputs, q_pos_bt, scale=scale, softcap=softcap)
