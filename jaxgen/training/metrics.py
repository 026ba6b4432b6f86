"""Run metrics: a JSONL line per step, TensorBoard event files, and the loss-curve PNG."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class MetricsWriter:
    """Appends records to `metrics.jsonl` and scalars to TensorBoard under `<run_dir>/tensorboard`.

    Every line is valid JSON: a non-finite value is written as null, and its spelling ("nan", "inf",
    "-inf") goes under "nonfinite", e.g. {"loss": null, ..., "nonfinite": {"loss": "nan"}}.
    """

    def __init__(self, run_dir: str | Path):
        from tensorboardX import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = self.path.open("a")
        if self.file.tell() and _last_byte(self.path) != b"\n":
            self.file.write("\n")  # a line cut short by a crash or a full disk stays on its own
        self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        nonfinite = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        line = {k: None if k in nonfinite else v for k, v in record.items()}
        if nonfinite:
            line["nonfinite"] = nonfinite
        self.file.write(json.dumps(line, allow_nan=False) + "\n")
        self.file.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, int | float):
                self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        self.tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abandon()

    def _abandon(self) -> None:
        """Closes what still closes after an error, which is the one to report (a full disk fails a close too)."""
        with contextlib.suppress(Exception):
            self.file.close()
        for writer in (self.tb.all_writers or {}).values():
            events = writer.event_writer
            with contextlib.suppress(Exception):
                events.close()
            with contextlib.suppress(Exception):  # else tensorboardX retries at exit and prints a traceback
                events._worker.stop()
                events._closed = True


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def _plain(v):
    if isinstance(v, np.generic | np.ndarray | jax.Array):
        v = np.asarray(v).item()
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of `metrics.jsonl`; a line cut short by a crash is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict) and "step" in r]


def plot_loss(run_dir: str | Path) -> Path:
    """Writes `<run_dir>/loss.png`: training loss per step and held-out loss at each evaluation."""
    records = _latest_per_step(read_metrics(run_dir))
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]  # null: non-finite
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]

    def draw(ax):
        if train:
            ax.plot(*zip(*train, strict=True), lw=1, alpha=0.8, label="train loss")
        if evals:
            ax.plot(*zip(*evals, strict=True), "o-", lw=2, label="held-out loss")

    return save_plot(Path(run_dir) / "loss.png", draw, "loss", "step", "cross-entropy (nats / token)")


def save_plot(out: Path, draw, what: str, xlabel: str, ylabel: str) -> Path:
    """A run's line plot at `out` (`<run folder>/<name>.png`): `draw(ax)` adds the lines, titled with the
    run folder's name and `what`, with a grid and a legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{out.parent.name}: {what}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _latest_per_step(records: list[dict]) -> list[dict]:
    """A resumed run may repeat steps after the last checkpoint; the later record wins."""
    by_key = {}
    for r in records:
        by_key[(r["step"], "eval_loss" in r)] = r
    return sorted(by_key.values(), key=lambda r: r["step"])


def measure_matmul_flops(n: int = 1024, repeats: int = 10, dtype=jnp.float32) -> float:
    """This machine's float32 matrix-multiply rate in FLOP/s (the denominator of MFU)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
