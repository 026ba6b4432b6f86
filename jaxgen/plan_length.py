"""The longest sequence that fits (`python -m jaxgen.plan --max-seq`): the search over lengths and its table.

    found = search_longest(peak_at, capacity, granule, start, top)     # peak_at: T -> bytes per device
    rows, compiled = max_seq_table(cfg, meshes, remats, capacities, top, probe, granule)
    print(format_max_seq(rows, chunk, dtype, compiled, headroom))

The programs whose peaks are searched come from `jaxgen.plan` (`probe_fn`, `seq_granule`), passed in: this
module compiles nothing itself, and its search is tested on memory curves given as formulas.
"""

from __future__ import annotations

import dataclasses

REMATS = ("none", "full", "dots", "dots_no_batch", "offload_dots")  # model.remat's values
MAX_SEQ_TOP = 2**20  # the longest length --max-seq tries unless told: a million tokens


@dataclasses.dataclass
class Longest:
    """The answer of one search: the longest length that fits (0: not even one granule) and its peak."""

    length: int
    peak: float  # bytes per device at `length` (0.0 when nothing fits)
    capped: bool = False  # still fits at the largest length tried: the real limit is further


def search_longest(peak_at, capacity: float, granule: int, start: int, top: int) -> Longest:
    """The largest multiple of `granule` in [granule, top] whose `peak_at(T)` (bytes per device; each
    call a compiled program, so the caller memoizes) is <= `capacity`, assuming peak grows with T.

    Up: doubling from `start`, or a jump to where the line through the last two probes meets the capacity
    when that is further (memory is close to linear in T). Then bisection between the longest that fits
    and the shortest that does not, at the secant point (rounded to the granule, kept inside) checked with
    its neighbour, falling back to the midpoint: a handful of probes when the memory is near linear."""
    up = lambda t: -(-t // granule) * granule
    down = lambda t: max(t // granule * granule, granule)
    fit, over = {}, {}  # length -> peak

    def probe(t: int) -> bool:
        peak = peak_at(t)
        (fit if peak <= capacity else over)[t] = peak
        return peak <= capacity

    t = min(up(max(start, granule)), down(top))
    while probe(t):  # up until something does not fit
        if t >= down(top):
            return Longest(t, fit[t], capped=True)
        t = min(max(2 * t, _secant(fit, capacity, granule, up)), down(top))
    if not fit:  # the start is too long: halve down to one granule
        while t > granule and not fit:  # or to where the line through the two shortest meets the capacity
            line = _secant(dict(sorted(over.items())[:2]), capacity, granule, down) if len(over) > 1 else t
            t = down(min(t // 2, max(line, granule)))
            probe(t)
        if not fit:
            return Longest(0, 0.0)
    lo, hi, halve = max(fit), min(over), False
    while hi - lo > granule:
        line = _secant({lo: fit[lo], hi: over[hi]}, capacity, granule, down)
        t = down((lo + hi) // 2) if halve or not line else min(max(line, lo + granule), hi - granule)
        step = granule if probe(t) else -granule
        if lo < t + step < hi:  # the guess's neighbour: when the guess was good, this ends the search
            probe(t + step)
        width, (lo, hi) = hi - lo, (max(fit), min(over))
        halve = hi - lo > width // 2  # the secant crept (a curved peak): bisect once
    return Longest(lo, fit[lo])


def _secant(points: dict, capacity: float, granule: int, rounding) -> int:
    """Where the line through the two longest probes meets `capacity`, rounded to the granule (0 when
    there is no rising line)."""
    if len(points) < 2:
        return 0
    (t0, p0), (t1, p1) = sorted(points.items())[-2:]
    if p1 <= p0:
        return 0
    return rounding(int(t0 + (capacity - p0) * (t1 - t0) / (p1 - p0)))


def at_length(cfg, t: int, rows: int):
    """`cfg` with sequences of `t` tokens, `rows` of them a step (the model's positions stretched to t)."""
    model = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, t))
    return dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, seq_len=t),
        training=dataclasses.replace(cfg.training, batch_size=rows),
    )  # fmt: skip


def max_seq_table(cfg, meshes: list[dict], remats: list[str], capacities: dict[str, float], top: int, probe,
                  granule, prefill: bool = True, log=None) -> tuple[list[dict], int]:  # fmt: skip
    """One row per (device, mesh, remat): the longest train and prefill lengths and their peaks, for devices of
    `capacities` (name -> usable bytes). `probe(cfg, mesh, program)` ("train" or "prefill") -> a memoized
    T -> peak bytes per device with a `compiles` count (`plan.probe_fn`); `granule(cfg, mesh)` -> the step of
    the lengths (`plan.seq_granule`). Probes are shared across devices (the same program whatever the
    capacity) and the prefill across remat policies. Returns (rows, programs compiled); a row's prefill is
    None without `prefill`."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    if cfg.model.position == "learned":  # no positions beyond the table
        top = min(top, cfg.model.max_seq_len)
    rows, compiled = [], 0
    for sizes in meshes:
        mesh = make_mesh(MeshConfig(**sizes))
        prefill = probe(cfg, mesh, "prefill") if prefill else None
        for remat in remats:
            run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))
            train, step = probe(run, mesh, "train"), granule(run, mesh)
            for device, capacity in capacities.items():
                if log:
                    log(f"{device}, mesh {mesh_name(sizes)}, remat {remat}:")
                found = [
                    search_longest(f, capacity, step, cfg.data.seq_len, top) if f else None for f in (train, prefill)
                ]
                rows.append({"device": device, "mesh": mesh_name(sizes), "remat": remat, "train": found[0],
                             "prefill": found[1]})  # fmt: skip
            compiled += train.compiles[0]
        compiled += prefill.compiles[0] if prefill else 0
    return rows, compiled


def mesh_name(sizes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "data=1"


def format_max_seq(rows: list[dict], chunk: int, dtype: str, compiled: int, headroom: float) -> str:
    def cell(found: Longest | None) -> tuple[str, str]:
        if found is None:
            return "not searched", ""
        if not found.length:
            return "nothing fits", ""
        return (">= " if found.capped else "") + f"{found.length:,}", size_text(found.peak).strip()

    lines = [
        "| device | mesh | model.remat | longest train sequence | per device | longest prefill | per device |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        train, prefill = cell(r["train"]), cell(r["prefill"])
        lines.append(f"| {r['device']} | {r['mesh']} | {r['remat']} | {' | '.join(train)} | {' | '.join(prefill)} |")
    lines.append(
        f"\nRows per step: data x fsdp (one sequence per batch shard). Prefill: one T-token prompt a row into a "
        f"{dtype} cache of its length; on a context mesh the whole prompt at once (the Generator's), else in "
        f"chunks of {chunk} tokens (the engine's). {compiled} programs compiled; usable memory {headroom:.0%} "
        "of each device's."
    )
    return "\n".join(lines)


def size_text(n: float) -> str:
    """Bytes in GB, or MB below one GB (tiny configs)."""
    return f"{n / 1e9:7.2f} GB" if n >= 1e9 else f"{n / 1e6:7.1f} MB"
