"""XLA:CPU's compile time against run time under backend flags and jaxgen's CPU decode products: what
tests/conftest.py's settings rest on. Each setting runs in a process of its own (XLA reads XLA_FLAGS once), on
two workloads of the test suite's kind:

- engine: a tiny Llama (2 layers, d 64) through `LLM` with n-gram speculation and plain decoding (the programs
  the engine tests compile), then the same requests three times more (its run time);
- train: configs/rl-calculator.yaml's model (2 layers, d 128), a train step on 32 x 160 tokens, then 10 steps.

    python bench/xla_cpu_flags.py           # the table: compile seconds and run seconds per setting
    python bench/xla_cpu_flags.py --one     # the setting in this process's environment, one JSON line

Compile seconds are jax's backend_compile events (summed: the engine compiles some programs in threads)."""

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LEVEL1 = "--xla_backend_optimization_level=1"
SETTINGS = (
    {},
    {"XLA_FLAGS": _LEVEL1},
    {"XLA_FLAGS": "--xla_backend_optimization_level=0"},
    {"XLA_FLAGS": f"{_LEVEL1} --xla_cpu_use_fusion_emitters=false"},
    {"XLA_FLAGS": f"{_LEVEL1} --xla_cpu_use_fusion_emitters=false", "JAXGEN_CPU_DECODE_SUMS": "0"},  # the tests'
)


def measure() -> dict:
    from jaxgen.runtime import quiet_libtpu_off_tpu

    quiet_libtpu_off_tpu()
    import jax
    import numpy as np

    from jaxgen import LLM, SamplingConfig, model
    from jaxgen.config import ModelConfig, load_config
    from jaxgen.sharding import make_mesh
    from jaxgen.tokenizer import Tokenizer
    from jaxgen.training import step as st

    compiled = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: (
            compiled.update({"s": seconds}) if event.endswith("backend_compile_duration") else None
        )
    )
    out = {}
    cfg = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128,
                      mlp="swiglu", norm="rmsnorm", position="rope")  # fmt: skip
    params = model.init_params(cfg, jax.random.key(1))
    compiled.clear()
    llm = LLM(params, cfg=cfg, tokenizer=Tokenizer.byte_level(), slots=4, num_pages=9, chunk_steps=8, spec_gate=False)
    prompts = ["abcabcabcabcabc", "the cat sat on the mat; the cat sat on"] * 2
    plain = [SamplingConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True),
             SamplingConfig(temperature=0.9, top_k=50, seed=11, max_new_tokens=32, n=2)] * 2  # fmt: skip
    spec = [dataclasses.replace(c, num_speculative_tokens=4) for c in plain]
    llm.generate(prompts, spec)
    llm.generate(prompts, plain)
    out["engine compile s"] = compiled["s"]
    t = time.perf_counter()
    for _ in range(3):
        llm.generate(prompts, spec)
        llm.generate(prompts, plain)
    out["engine run s (x3)"] = time.perf_counter() - t

    tc = load_config(ROOT / "configs" / "rl-calculator.yaml", ["mesh.data=1"])
    mesh = make_mesh(tc.mesh, jax.devices()[:1])
    state = st.create_train_state(tc, mesh)
    step = st.make_train_step(tc, mesh, state)
    b, s = tc.training.batch_size, tc.data.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tc.model.vocab_size, (b, s + 1)).astype(np.int32)
    positions = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions,
             "segment_ids": np.ones((b, s), np.int32), "loss_mask": np.ones((b, s), np.float32)}  # fmt: skip
    batch = st.put_batch(batch, mesh)
    compiled.clear()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    out["train compile s"] = compiled["s"]
    t = time.perf_counter()
    for _ in range(10):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    out["train step s"] = (time.perf_counter() - t) / 10
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", action="store_true", help="measure the setting of this process's environment")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure()))
        return
    rows = []
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXGEN_CPU_DECODE_SUMS")}
        env |= setting | {"JAX_PLATFORMS": "cpu"}
        label = " ".join(f"{k}={v}" for k, v in setting.items()) or "(the defaults)"
        done = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{label} failed:\n{done.stderr[-2000:]}")
        rows.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
    keys = list(rows[0][1])
    print("| setting | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for flags, got in rows:
        print(f"| {flags} | " + " | ".join(f"{got[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
