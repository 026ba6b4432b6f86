"""cuDNN's fused flash attention for whole sequences, through `jax.nn.dot_product_attention` (NVIDIA
GPUs, bf16/fp16): causal by index, segments and padding as a mask, the window as cuDNN's own."""

from __future__ import annotations

import jax

from jaxgen.config import ModelConfig
from jaxgen.model.kernels.masks import by_window, segments


def unfit(cfg: ModelConfig, backend: str) -> str | None:
    """Why cuDNN's fused attention cannot run this config, or None."""
    if backend not in ("gpu", "cuda"):
        return f"it needs an NVIDIA GPU, the backend is {backend}"
    if cfg.dtype not in ("bfloat16", "float16"):
        return f"it needs model.dtype bfloat16, got {cfg.dtype}"
    if cfg.head_size > 128 or cfg.head_size % 8:
        return f"it needs a head size <= 128 and a multiple of 8, got {cfg.head_size}"
    if cfg.attn_softcap is not None:
        return "it has no attention-logit soft cap"
    if not _cudnn_installed():
        return "cuDNN is not installed (the CUDA wheels of jax[cuda12] bring it)"
    return None


def _cudnn_installed() -> bool:
    """Whether jax finds the cuDNN library (absent where only the CUDA plugin is installed, to compile
    for a GPU this machine lacks: `jaxgen.targets`)."""
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    try:
        check_cudnn_version()
    except RuntimeError:
        return False
    return True


def mask(positions_bt, segment_ids_bt):
    """(B, 1, T, T) bool: same packed segment, padding apart. cuDNN takes it as a bias; it is built once
    per forward pass and shared by every layer (2 bytes x T^2 per sequence as a bias: 134 MB at 8192),
    still no per-head (T, T) scores."""
    seg = segments(positions_bt, segment_ids_bt)
    return (seg[:, :, None] == seg[:, None, :])[:, None]


def attention(q_btnh, k_btkh, v_btkh, mask_b1tt, window, cfg: ModelConfig, *, scale: float):
    """cuDNN flash attention (B, T, N, H), causal by index, segments and padding as `mask`, the window as
    cuDNN's sliding window; `scale` multiplies q . k (`attention.logit_scale`)."""

    def run(w):
        return jax.nn.dot_product_attention(
            q_btnh, k_btkh, v_btkh, mask=mask_b1tt, scale=scale, is_causal=True,
            local_window_size=None if w is None else (w - 1, 0), implementation="cudnn",
        )  # fmt: skip

    return by_window(run, window, cfg)
