"""Process-wide JAX settings for the command lines (never applied on library import)."""

from __future__ import annotations

import os

import jax


def enable_compilation_cache() -> None:
    """XLA's persistent compilation cache, so a resumed or repeated run skips most compiling.

    Location: $JAXGEN_XLA_CACHE, default ~/.cache/jaxgen/xla; set it to an empty string to disable.
    """
    path = os.environ.get("JAXGEN_XLA_CACHE", "~/.cache/jaxgen/xla")
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
