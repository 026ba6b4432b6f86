"""LoRA: train step time and memory of full fine-tuning vs LoRA over a float32, bfloat16, int8 or nf4 base,
measured here and planned for real models; serving throughput of mixed adapters vs the base alone.

    python bench/lora.py                                   # all three tables
    python bench/lora.py --skip plan serve --config tiny   # one table, quickly
    python bench/lora.py --skip train serve --plan-models llama-3.1-8b --variants bfloat16 int8 nf4

train: one config (default llama-small), batch x seq tokens, float32, best of --steps steps. Memory is what
the step holds on this machine: its state (parameters or adapters, AdamW moments), the frozen base, and
XLA's temporaries for the compiled step.
plan: `python -m jaxgen.plan`'s per-device figures (programs compiled for fake devices, nothing allocated)
for Llama 3.2 1B and 3.1 8B on one device, model.remat=full, judged against an H100 80GB and a TPU v5p.
serve: the engine's decode tokens/s with 4 adapters mixed in one batch vs the base alone at the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> model.lora overrides
    "full fine-tune": [],
    "LoRA (float32 base)": ["model.lora.rank=16"],
    "LoRA (bfloat16 base)": ["model.lora.rank=16", "model.lora.base_dtype=bfloat16"],
    "LoRA (int8 base)": ["model.lora.rank=16", "model.lora.base_dtype=int8"],
    "LoRA (nf4 base)": ["model.lora.rank=16", "model.lora.base_dtype=nf4"],
}
ALL_TARGETS = "model.lora.targets=[q,k,v,o,gate,up,down]"


def _bytes(tree) -> float:
    return float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def bench_train(config: str, batch: int, seq: int, steps: int, overrides: list[str]) -> dict:
    from jaxgen.config import MeshConfig, load_config
    from jaxgen.sharding import make_mesh
    from jaxgen.training.step import create_base, create_train_state, make_train_step, put_batch

    sizes = [f"training.batch_size={batch}", f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 256)}"]
    cfg = load_config(ROOT / "configs" / f"{config}.yaml", sizes + overrides)
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
    mesh = make_mesh(cfg.mesh)
    state, base = create_train_state(cfg, mesh), create_base(cfg, mesh)
    step = make_train_step(cfg, mesh, state, base)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg.model.vocab_size, size=(batch, seq + 1)).astype(np.int32)
    ones = np.ones((batch, seq), np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    data = {"inputs": seqs[:, :-1], "targets": seqs[:, 1:], "positions": positions}
    data = put_batch(data | {"segment_ids": ones, "loss_mask": ones}, mesh)
    args = (state, data) if base is None else (state, data, base)
    with jax.set_mesh(mesh):
        temps = step.jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes
    state_bytes, base_bytes = _bytes((state.params, state.opt_state)), _bytes(base) if base is not None else 0.0
    times, losses = [], []
    for _ in range(steps + 1):  # the first call compiles
        t0 = time.perf_counter()
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
    best = min(times[1:])  # noise on a shared machine only adds time
    return {"step_s": best, "tokens_per_s": batch * seq / best, "state": state_bytes, "base": base_bytes,
            "temps": float(temps), "loss": (losses[0], losses[-1])}  # fmt: skip


def _variants(args) -> list:
    """(name, overrides) of the variants `--variants` picks (words of their names), all by default."""
    return [(n, o) for n, o in VARIANTS.items() if not args.variants or any(w in n for w in args.variants)]


def print_train(args) -> None:
    print(f"\ntrain: {args.config}, batch {args.batch} x {args.seq} tokens, float32 compute, best of {args.steps} "
          f"steps, targets q k v o gate up down, rank 16")  # fmt: skip
    header = f"{'variant':<22}{'step s':>8}{'tokens/s':>10}{'x full':>8}{'state MB':>10}{'base MB':>9}{'temps MB':>10}"
    print(header + f"{'loss first -> last':>22}")
    full = None
    for name, overrides in _variants(args):
        r = bench_train(args.config, args.batch, args.seq, args.steps, overrides + ([ALL_TARGETS] if overrides else []))
        full = full or r["tokens_per_s"]
        first, last = r["loss"]
        print(f"{name:<22}{r['step_s']:>8.3f}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / full:>8.2f}"
              f"{r['state'] / 1e6:>10.1f}{r['base'] / 1e6:>9.1f}{r['temps'] / 1e6:>10.1f}"
              f"{first:>12.3f} -> {last:.3f}", flush=True)  # fmt: skip


def print_plan(args) -> None:
    from jaxgen import plan
    from jaxgen.config import MeshConfig, load_config
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=1))
    devices = ["h100-80gb", "v5p"]
    print(f"\nplan: one device, model.remat=full, training.batch_size={args.plan_batch}, data.seq_len={args.plan_seq}; "
          "per-device GB (parameters or base + adapters + moments + gradients + XLA:CPU temporaries)")  # fmt: skip
    columns = "".join(f"{d:>11}" for d in devices)
    print(f"{'model':<14}{'variant':<22}{'state GB':>9}{'temps GB':>9}{'peak GB':>9}{columns}")
    for config in args.plan_models:
        for name, overrides in _variants(args):
            extra = ["model.remat=full", f"training.batch_size={args.plan_batch}", f"data.seq_len={args.plan_seq}"]
            extra += overrides + ([ALL_TARGETS] if overrides else [])
            cfg = load_config(ROOT / "configs" / f"{config}.yaml", extra)
            p = plan.train_program(cfg, mesh)
            state = sum(p.parts.values())
            fits = [p.peak <= plan.DEVICES[d][0] * plan.HEADROOM for d in devices]
            verdicts = "".join(f"{'fits' if ok else 'no':>11}" for ok in fits)
            print(f"{config:<14}{name:<22}{state / 1e9:>9.2f}{p.temporaries / 1e9:>9.2f}{p.peak / 1e9:>9.2f}{verdicts}",
                  flush=True)  # fmt: skip


def bench_serve(config: str, batch: int, adapters: int, new_tokens: int = 128, repeats: int = 2) -> float:
    """Decode tokens/s of `batch` greedy sequences (32-token prompts) on the engine: with `adapters` random
    rank-16 LoRA adapters on every target, the rows spread over them (0: the base model, serve.max_loras=0)."""
    from jaxgen import model
    from jaxgen.config import LoraConfig, ServeConfig, load_config
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.model import lora
    from jaxgen.tokenizer import Tokenizer

    cfg = load_config(ROOT / "configs" / f"{config}.yaml").model
    params = jax.jit(lambda key: model.init_params(cfg, key))(jax.random.key(0))
    serve = ServeConfig(slots=batch, num_pages=batch * (160 // 16 + 2) + 1, chunk_steps=16, max_loras=adapters)
    engine = Engine(params, cfg, Tokenizer.byte_level(), serve)
    specs = lora.lora_specs(dataclasses.replace(cfg, lora=LoraConfig(rank=16, targets=lora.bank_targets(cfg))))
    rng = np.random.default_rng(0)
    for i in range(adapters):
        weights = {t: {k: rng.normal(0, 0.02, s.shape).astype(np.float32) for k, s in pair.items()}
                   for t, pair in specs.items()}  # fmt: skip
        engine.load_lora(f"lora{i}", weights, 1.0)
    names = [f"lora{i % adapters}" if adapters else None for i in range(batch)]
    prompts = [rng.integers(0, min(cfg.vocab_size, 256), 32).tolist() for _ in range(batch)]
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = math.inf
    for _ in range(repeats + 1):  # the first run compiles
        t0 = time.perf_counter()
        engine.generate(prompts, sampling, lora=names)
        best = min(best, time.perf_counter() - t0)
    return batch * new_tokens / best


def print_serve(args) -> None:
    print(f"\nserve: {args.config}, 4 rank-16 adapters on every target mixed in one batch vs the base alone")
    print(f"{'batch':>6}{'base tok/s':>12}{'4 adapters':>12}{'ratio':>8}")
    for batch in args.serve_batches:
        base, mixed = bench_serve(args.config, batch, 0), bench_serve(args.config, batch, 4)
        print(f"{batch:>6}{base:>12.0f}{mixed:>12.0f}{mixed / base:>8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama-small", help="the train table's config (configs/NAME.yaml)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per variant (the best is reported)")
    parser.add_argument("--plan-batch", type=int, default=1)
    parser.add_argument("--plan-seq", type=int, default=2048)
    parser.add_argument("--plan-models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"], help="configs/NAME")
    parser.add_argument("--variants", nargs="*", default=[], help="only these (a word of the name: full, nf4, ...)")
    parser.add_argument("--serve-batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "plan", "serve"])
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {math.prod([len(jax.devices())])} device(s)")
    if "train" not in args.skip:
        print_train(args)
    if "plan" not in args.skip:
        print_plan(args)
    if "serve" not in args.skip:
        print_serve(args)


if __name__ == "__main__":
    main()
