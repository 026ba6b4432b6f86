"""Run metrics: a JSONL line per step, TensorBoard event files, and the loss-curve PNG."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class MetricsWriter:
    """Appends records to `metrics.jsonl` and scalars to TensorBoard under `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: str | Path):
        from tensorboardX import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = self.path.open("a")
        self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, int | float):
                self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        self.tb.close()


def _plain(v):
    if isinstance(v, np.generic | np.ndarray | jax.Array):
        v = np.asarray(v).item()
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_loss(run_dir: str | Path) -> Path:
    """Writes `<run_dir>/loss.png`: training loss per step and held-out loss at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _latest_per_step(read_metrics(run_dir))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, alpha=0.8, label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", lw=2, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"{Path(run_dir).name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
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
