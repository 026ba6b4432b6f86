"""XLA:CPU's compile time against run time under backend flags: what tests/conftest.py's choice of
`--xla_backend_optimization_level=1` rests on. Each setting runs in a process of its own (XLA reads XLA_FLAGS
once), on two workloads of the test suite's kind:

- engine: a tiny Llama (2 layers, d 64) through `LLM` with n-gram speculation and plain decoding (the programs
  the engine tests compile), then the same requests three times more (its run time);
- train: configs/rl-calculator.yaml's model (2 layers, d 128), a train step on 32 x 160 tokens, then 10 steps.

    python bench/xla_cpu_flags.py                 # the table: compile seconds and run seconds per setting
    python bench/xla_cpu_flags.py --one "FLAGS"   # one setting, one JSON line (what the table runs)

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
SETTINGS = ("", "--xla_backend_optimization_level=1", "--xla_backend_optimization_level=0")


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
    parser.add_argument("--one", metavar="FLAGS", help="measure one XLA_FLAGS setting in this process")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure()))
        return
    rows = []
    for flags in SETTINGS:
        env = os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run([sys.executable, __file__, "--one", flags], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"XLA_FLAGS={flags!r} failed:\n{done.stderr[-2000:]}")
        rows.append((flags or "(XLA's defaults)", json.loads(done.stdout.strip().splitlines()[-1])))
    keys = list(rows[0][1])
    print("| XLA_FLAGS | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for flags, got in rows:
        print(f"| {flags} | " + " | ".join(f"{got[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
