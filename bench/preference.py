"""Preference tuning's cost: a DPO step against an SFT step of the same tokens, and the cached reference
against holding a reference model.

    python bench/preference.py [--config llama-small] [--layers 4] [--pairs 4] [--seq 256] [--steps 5]

The DPO step reads 2P rows of T tokens, each holding one pair packed (the chosen and the rejected answer
of T / 2 tokens each, a quarter of each the prompt; the reference's scores from the batch); the SFT step
the same 2P rows as plain sequences. Step times are the median of `--steps` calls, the two steps alternating in one
process (this machine is noisy: compare the ratio). Memory: XLA's buffer assignment of each compiled step
(temporaries; arguments and outputs are the same state). The reference: the bytes a second model held in
memory would take, against the cache's 8 bytes per pair (two float32 scores).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import MeshConfig, load_config
from jaxgen.sharding import make_mesh
from jaxgen.training.preference import preference_step
from jaxgen.training.step import create_train_state, make_train_step, put_batch

ROOT = Path(__file__).resolve().parent.parent


def _rows(n: int, t: int, vocab: int, rng) -> dict:
    seq = rng.integers(1, vocab, size=(n, t + 1)).astype(np.int32)
    mask = np.ones((n, t), np.int32)
    mask[:, : t // 4] = 0  # a quarter of each row is the prompt
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "loss_mask": mask, "segment_ids": np.ones((n, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()}  # fmt: skip


def _step(cfg, batch, fn=None):
    mesh = make_mesh(cfg.mesh)
    state = create_train_state(cfg, mesh)
    shapes = {k: v.shape for k, v in batch.items()}
    step = make_train_step(cfg, mesh, state, fn=fn, shapes=shapes)
    data = put_batch(batch, mesh)
    with jax.set_mesh(mesh):
        compiled = step.jitted.lower(state, data).compile()
    temps = compiled.memory_analysis().temp_size_in_bytes
    return compiled, state, data, temps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama-small")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    p, t = args.pairs, args.seq
    base = [f"model.num_layers={args.layers}", f"data.seq_len={t}", f"model.max_seq_len={max(t, 256)}"]
    sft = load_config(ROOT / "configs" / f"{args.config}.yaml", [*base, f"training.batch_size={2 * p}"])
    dpo = load_config(ROOT / "configs" / f"{args.config}.yaml", [*base, f"training.batch_size={2 * p}",
                      "data.source=preference", "data.paths=[pairs.jsonl]", "training.objective=dpo"])  # fmt: skip
    sft, dpo = (dataclasses.replace(c, mesh=MeshConfig(data=1)) for c in (sft, dpo))
    rows = _rows(2 * p, t, sft.model.vocab_size, np.random.default_rng(0))
    half = np.arange(t) >= t // 2  # the rejected answer's half of each row
    segments = np.where(half, 2, 1)[None].repeat(2 * p, 0).astype(np.int32)
    positions = np.where(half, np.arange(t) - t // 2, np.arange(t))[None].repeat(2 * p, 0).astype(np.int32)
    trained = (np.arange(t) % (t // 2)) >= t // 8  # a quarter of each answer's half is its prompt
    answer = np.where(trained, half.astype(np.int32), -1)[None].repeat(2 * p, 0).astype(np.int32)
    pairs = rows | {"segment_ids": segments, "positions": positions, "loss_mask": (answer >= 0).astype(np.int32),
                    "answer": answer, "pairs": np.ones((2 * p, 1), np.float32),
                    "reference": np.full((2 * p, 1, 2), -100.0, np.float32)}  # fmt: skip
    runs = {"sft": _step(sft, rows), "dpo": _step(dpo, pairs, preference_step)}
    times = {name: [] for name in runs}
    states = {name: r[1] for name, r in runs.items()}
    for _ in range(args.steps + 1):  # the first call of each: warm-up, not counted
        for name, (compiled, _, data, _) in runs.items():
            t0 = time.perf_counter()
            states[name], m = compiled(states[name], data)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    print(f"{args.config}, {args.layers} layers, {2 * p} rows x {t} tokens (DPO: a pair a row), float32, "
          f"{jax.devices()[0].device_kind}")  # fmt: skip
    print(f"{'step':<6} {'time (s)':>10} {'temporaries (MB)':>18}")
    for name in runs:
        print(f"{name:<6} {median[name]:>10.3f} {runs[name][3] / 2**20:>18.1f}")
    print(f"dpo / sft: time {median['dpo'] / median['sft']:.2f}x, temporaries {runs['dpo'][3] / runs['sft'][3]:.2f}x")
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: model.init_params(sft.model, jax.random.key(0)))))  # fmt: skip
    print(f"reference: a model held beside the policy {params / 2**20:.1f} MB; the cache 8 bytes a pair "
          f"({8 * 10**6 / 2**20:.1f} MB for a million pairs), on disk, read into host memory")  # fmt: skip


if __name__ == "__main__":
    main()
