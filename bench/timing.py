"""The one timing rule of the benchmarks that time jitted calls: compile and warm once, then the best of N."""

from __future__ import annotations

import time

import jax


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn() (after one untimed call). Noise on a shared machine only
    adds time, so the best call is the fairest figure."""
    jax.block_until_ready(fn())  # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)
