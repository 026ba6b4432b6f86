"""jaxgen against Hugging Face transformers (PyTorch, CPU), the same weights, in one process run.

    python bench/vs_transformers.py [--configs gpt2-124m llama-small] [--new-tokens 128] [--out DIR]

For each config, random jaxgen weights are exported with `jaxgen.hf.save_pretrained` and loaded by
transformers, so both sides run the very same float32 model. Measured, best of a few repeats each, the
two sides taking turns:
- prefill: batch 1, 128-token prompt: from tokens to the next token's logits with the KV cache built
  (jaxgen's prefill program; transformers' forward with use_cache=True and logits_to_keep=1);
- decode tokens/s at each batch: 32-token prompts, 128 new tokens, greedy, no early stop; the time of
  the 127 steps after the first token (a full run minus a one-token run), so prefill is not counted;
- training tokens/s: batch 8 x 256, AdamW with clipping, forward + backward + update.
Prints each pair and the ratio jaxgen / transformers, and writes a bar chart of the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from train_throughput import synthetic_batch  # bench/ is on the path when run as a script

from jaxgen import hf, model
from jaxgen.config import MeshConfig, load_config
from jaxgen.inference.decode import bucket
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.step import create_train_state, make_train_step, put_batch

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"prefill": 1.0, "decode b=1": 1.5, "decode b=8": 1.3, "decode b=32": 1.3, "train": 1.0}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class JaxSide:
    def __init__(self, cfg, params, batches):
        self.gen = Generator(params, cfg, Tokenizer.byte_level(), max_batch=max(batches), chunk_steps=128)

    def generate(self, prompts, new_tokens):
        sc = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        return self.gen.generate(prompts, sc)

    def prefill(self, prompt):
        n = len(prompt)
        tokens, positions = np.asarray([prompt], np.int32), np.arange(n, dtype=np.int32)[None]
        one = np.zeros((1,), np.int32)
        cache, logits = self.gen.prefill(tokens, positions, one, one + n, cache_len=bucket(n + 128))
        return jax.block_until_ready((cache, logits))


class TorchSide:
    """A transformers model on `device`; each call returns once the device is done (timed from the host)."""

    def __init__(self, model, device: str = "cpu"):
        self.model, self.device = model.eval(), device
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    @classmethod
    def from_folder(cls, folder):
        return cls(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))

    @torch.no_grad()
    def prefill(self, prompt):
        ids = torch.tensor([prompt], device=self.device)
        return self.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.cpu()

    @torch.no_grad()
    def generate(self, prompts, new_tokens, **options):
        """Greedy, exactly new_tokens per prompt; options go to `generate` (a streamer, cache_implementation)."""
        ids = torch.tensor(prompts, device=self.device)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, **options,
        ).cpu()  # fmt: skip
        assert out.shape[1] == ids.shape[1] + new_tokens
        return out


def bench_generation(sides, prompt_rng, batches, new_tokens, repeats) -> list[dict]:
    """Each measure of every side, the sides' repeats interleaved (ours, theirs, ours, ...) so that a
    slow spell of a noisy machine falls on both rather than on whichever side ran then. Best of
    `repeats` each; returns one dict per side."""
    prompt = prompt_rng.integers(0, 256, 128).tolist()
    for side in sides:
        side.prefill(prompt)  # warm up / compile
    out = [{"prefill": t} for t in _best_interleaved([lambda s=s: s.prefill(prompt) for s in sides], repeats + 2)]
    for b in batches:
        prompts = prompt_rng.integers(0, 256, (b, 32)).tolist()
        for side in sides:  # warm up / compile both programs
            side.generate(prompts, new_tokens)
            side.generate(prompts, 1)
        full = _best_interleaved([lambda s=s, p=prompts: s.generate(p, new_tokens) for s in sides], max(1, repeats - 1))
        one = _best_interleaved([lambda s=s, p=prompts: s.generate(p, 1) for s in sides], repeats)
        for o, f, n in zip(out, full, one, strict=True):
            o[f"decode b={b}"] = b * (new_tokens - 1) / (f - n)  # tokens/s
    return out


def _best_interleaved(fns, repeats: int) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], _best(fn, 1))
    return best


def bench_train_jax(cfg, batch, seq, steps) -> float:
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
    mesh = make_mesh(cfg.mesh)
    state = create_train_state(cfg, mesh)
    step = make_train_step(cfg, mesh, state)
    data = put_batch(synthetic_batch(batch, seq, cfg.model.vocab_size), mesh)
    state, m = step(state, data)  # compile
    jax.block_until_ready(m)
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m)
        best = min(best, time.perf_counter() - t0)
    return batch * seq / best


def bench_train_torch(m, batch, seq, steps, vocab, autocast: torch.dtype | None = None) -> float:
    """Tokens/s of an AdamW step with clipping on model `m` (on its own device), best of `steps` after one;
    autocast: the dtype the forward computes in (None: the weights')."""
    m.train()
    m.config.use_cache = False
    device = next(m.parameters()).device
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = synthetic_batch(batch, seq, vocab)
    inputs, targets = (torch.from_numpy(data[k]).long().to(device) for k in ("inputs", "targets"))

    def step():
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = m(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # waits for the device

    step()  # warm up
    return batch * seq / _best(step, steps)


def bench_config(name, args) -> dict[str, tuple[float, float]]:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"training.batch_size={args.train_batch}"])
    params = model.init_params(cfg.model, jax.random.key(0))
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, params, cfg.model, Tokenizer.byte_level())
        sides = [JaxSide(cfg.model, params, args.batches), TorchSide.from_folder(folder)]
        ours, theirs = bench_generation(sides, np.random.default_rng(0), args.batches, args.new_tokens, args.repeats)
        del sides  # free both models before the training measure
        for key in ours:
            results[key] = (ours[key], theirs[key])
        if args.train_steps:
            ours_t = bench_train_jax(cfg, args.train_batch, args.train_seq, args.train_steps)
            theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            theirs_t = bench_train_torch(
                theirs, args.train_batch, args.train_seq, args.train_steps, cfg.model.vocab_size
            )
            results["train"] = (ours_t, theirs_t)
    return results


def _ratio(key, pair) -> float:
    ours, theirs = pair
    return theirs / ours if key == "prefill" else ours / theirs  # prefill is a latency: lower is better


def print_table(name, results) -> None:
    print(f"\n{name}")
    print(f"{'measure':<14}{'jaxgen':>14}{'transformers':>15}{'ratio':>8}{'target':>8}")
    for key, pair in results.items():
        unit = "ms" if key == "prefill" else "tok/s"
        a, b = (pair[0] * 1e3, pair[1] * 1e3) if key == "prefill" else pair
        r = _ratio(key, pair)
        flag = "" if r >= TARGETS[key] else "  (missed)"
        print(f"{key:<14}{a:>10.1f} {unit:<5}{b:>9.1f} {unit:<5}{r:>7.2f}x{TARGETS[key]:>7.1f}x{flag}", flush=True)


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(next(iter(all_results.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(all_results)
    for j, (name, results) in enumerate(all_results.items()):
        xs = np.arange(len(keys)) + j * width
        ax.bar(xs, [_ratio(k, results[k]) for k in keys], width, label=name)
    for i, k in enumerate(keys):
        ax.hlines(TARGETS[k], i - width / 2, i + width * (len(all_results) - 0.5), colors="k", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(np.arange(len(keys)) + width * (len(all_results) - 1) / 2, keys)
    ax.set_ylabel("jaxgen / transformers (higher is better)")
    ax.set_title(f"jaxgen vs transformers, float32, CPU ({torch.get_num_threads()} threads); dashed: target")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nchart: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["gpt2-124m", "llama-small"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-seq", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=3, help="timed training steps per side; 0 skips")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "vs_transformers.png")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    print(f"threads: torch {torch.get_num_threads()}, XLA:CPU all {os.cpu_count()} cores; float32")
    print(f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    all_results = {}
    for name in args.configs:
        all_results[name] = bench_config(name, args)
        print_table(name, all_results[name])
    plot(all_results, args.out)


if __name__ == "__main__":
    main()
