"""Will these serving settings work with this model? Checked before the engine allocates or compiles anything.

    check_serving(cfg, serve, draft_cfg=None, mesh=None)   ConfigError naming the setting, or nothing
    check_deterministic(cfg, serve, draft, mesh)            the same for what deterministic mode cannot keep

A setting that loads and then fails every request (top alternatives beyond the vocabulary, a page pool of
fewer than two pages), and sizes whose buffers do not fit in memory (slots, the page pool, a decode chunk's
output columns), are refused with one line: the setting, its value, the bytes it needs and what is there.
The byte counts are the engine's own buffers (`steps.init_state`, `steps.init_spec`, `PageTables`), counted
from their shapes: nothing is traced, so a value of 10**12 costs nothing to refuse.
"""

from __future__ import annotations

import os

from jaxgen.config import ConfigError, ModelConfig, ServeConfig
from jaxgen.inference.decode import MAX_STOPS
from jaxgen.inference.sampling import MAX_SPECULATIVE, MAX_STOP_SEQUENCE
from jaxgen.inference.structured.pool import table_rows
from jaxgen.model.lora import bank_bytes
from jaxgen.model.paged import page_bytes

HEADROOM = 0.9  # of the memory found, what the engine's buffers may take: the weights, XLA's temporaries


def check_serving(cfg: ModelConfig, serve: ServeConfig, draft_cfg: ModelConfig | None = None, mesh=None) -> None:
    """ConfigError for settings this model cannot serve with, before anything is allocated (see the module):
    `check_settings`, then the engine's buffers against the memory of `mesh`'s devices (or this machine's)."""
    pages, per_page = check_settings(cfg, serve, draft_cfg)
    needs = planned_bytes(cfg, serve, pages, per_page)
    available, where = memory_available(mesh)
    total = sum(needs.values())
    if total > HEADROOM * available:
        key = max(needs, key=needs.get)
        value = getattr(serve, key.split(".")[1])
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in needs.items())
        raise ConfigError(
            f"{key}={value!r} is not allowed: the engine's buffers would take {_gb(total)} ({parts}) and "
            f"{where} has {_gb(available)} ({HEADROOM:.0%} of it usable); lower {key}"
        )


def check_settings(cfg: ModelConfig, serve: ServeConfig, draft_cfg: ModelConfig | None = None) -> tuple[int, int]:
    """ConfigError for serving settings this model cannot take whatever the memory (what the planner checks:
    fitting is its question); else (pages in the pool, bytes a page)."""
    if serve.max_logprobs > cfg.vocab_size:
        raise ConfigError(
            f"serve.max_logprobs={serve.max_logprobs} is not allowed: at most the model's vocabulary of "
            f"{cfg.vocab_size} tokens (the top alternatives are drawn from it)"
        )
    per_page = page_bytes(cfg, serve.page_size, serve.cache_dtype)
    if draft_cfg is not None:
        per_page += page_bytes(draft_cfg, serve.page_size, serve.cache_dtype)
    pages = serve.num_pages or int(serve.kv_memory_gb * 2**30 // per_page)
    if pages < 2:
        raise ConfigError(
            f"serve.kv_memory_gb={serve.kv_memory_gb} is not allowed: it holds {pages} pages of {per_page} bytes "
            f"(serve.page_size={serve.page_size} tokens) and the page pool needs at least 2: at least "
            f"{2 * per_page / 2**30:.3g} GB"
        )
    return pages, per_page


def check_deterministic(cfg: ModelConfig, serve: ServeConfig, draft, mesh) -> None:
    """ConfigError, before anything compiles, for serving settings deterministic mode cannot keep bitwise (the
    RL loop asks it of its trainer's mesh too)."""
    if not cfg.deterministic:
        return
    why = "with model.deterministic=true"
    split = {} if mesh is None else {a: n for a, n in mesh.shape.items() if a != "data" and n > 1}
    refused = [
        (serve.page_size % cfg.attention_block != 0, "serve.page_size", serve.page_size,
         f"a multiple of model.attention_block={cfg.attention_block} (key blocks align to pages)"),
        (serve.cache_dtype != cfg.dtype, "serve.cache_dtype", serve.cache_dtype,
         f"model.dtype={cfg.dtype} (the keys and values as the training forward computes them)"),
        (serve.quantize != "none", "serve.quantize", serve.quantize, "none"),
        (draft is not None, "draft", "a draft model", "none (speculative decoding)"),
        (serve.max_loras > 0, "serve.max_loras", serve.max_loras, "0 (no adapters)"),
        (bool(split), f"mesh.{next(iter(split), '')}", next(iter(split.values()), 0),
         "1: data parallel only (rows split over devices: each device's tiles are a one-device run's; products "
         "split over devices sum in another order)"),
    ]  # fmt: skip
    for bad, field, value, allowed in refused:
        if bad:
            raise ConfigError(f"{field}={value} is not allowed {why}: {allowed}")


def planned_bytes(cfg: ModelConfig, serve: ServeConfig, pages: int, per_page: int) -> dict[str, int]:
    """{the setting that sizes it: bytes} of the engine's buffers, on every device together."""
    pool_key = "serve.num_pages" if serve.num_pages else "serve.kv_memory_gb"
    v, context = cfg.vocab_size, cfg.max_seq_len
    max_pages = -(-context // serve.page_size)
    columns = serve.chunk_steps + MAX_SPECULATIVE + 1  # `steps.chunk_columns`
    per_slot = (
        13 * v  # logits, counts, logit_bias (float32, int32) and seen (bool) of the vocabulary
        + 3 * 4 * max_pages  # the page table row on the device and its two host copies
        + 4 * (context + MAX_SPECULATIVE + 1)  # the n-gram history (`steps.history_size`)
        + 4 * (MAX_STOPS + 1) * MAX_STOP_SEQUENCE + 64  # stop windows, positions, sampling settings
    )  # fmt: skip
    chunk = serve.slots * columns * (8 + 8 * serve.max_logprobs)  # tokens, logprobs, top ids and logprobs
    needs = {pool_key: pages * per_page, "serve.slots": serve.slots * per_slot, "serve.chunk_steps": chunk}
    needs["serve.grammar_states"] = 4 * v * table_rows(serve.grammar_states, v)  # structured output's table
    if serve.max_loras:  # the LoRA bank (multi-LoRA serving)
        needs["serve.max_loras"] = bank_bytes(cfg, serve.max_loras, serve.max_lora_rank)
    return needs


def memory_available(mesh=None) -> tuple[int, str]:
    """(bytes, where): free memory of the engine's devices (all of them: its buffers are split over them), or
    this machine's memory on the CPU, where XLA reports none."""
    import jax

    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return free * len(devices), f"{len(devices)} x {devices[0].device_kind} (free memory)"
    return host_memory(), "this machine"


def host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gb(n: float) -> str:
    return f"{n / 2**30:.3g} GB" if n >= 2**30 else f"{n / 2**20:.3g} MB"
