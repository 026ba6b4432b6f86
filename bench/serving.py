"""Serving: the engine (continuous batching, paged cache) against static batches through `generate`,
and the engine with and without prefix caching on prompts that share a system prompt.

    python bench/serving.py [--config llama-small] [--layers 4] [--requests 256] [--slots 16]

The workload: `--requests` requests, all arriving at once, with prompt lengths 16-512 and output
lengths 8-256, both log-normally skewed towards short (fixed seed); greedy decoding with no early stop,
so both systems produce exactly the same tokens. Static batching runs them in arrival order, `--slots`
at a time, through `Generator.stream` (each batch runs until its longest request is done). The shared-
prefix variant puts the same 256-token system prompt in front of every prompt.

The HTTP row sends the plain workload through `serve.py http`'s app (uvicorn in a thread, as served):
one streaming /v1/completions request per prompt, all at once, each from its own connection; its gap to
the engine row is what the server costs (parsing, tokens to text, events, the event loop).

Reported per run: output tokens/s over the whole run, and p50/p99 of the time to first token (from the
common arrival time) and of the time per output token after the first. Compilation is excluded: every
system runs a warm-up first (static batching: the whole workload once, since its shapes vary per batch).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import ServeConfig, load_config
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, seed: int, prefix: int = 0):
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(64), 0.9, n), 16, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(40), 0.9, n), 8, 256).astype(int)
    system = rng.integers(0, 256, prefix).tolist()
    prompts = [system + rng.integers(0, 256, int(k)).tolist() for k in prompt_lens]
    configs = [SamplingConfig(max_new_tokens=int(m), temperature=0.0, ignore_eos=True) for m in output_lens]
    return prompts, configs


def run_engine(engine: Engine, prompts, configs) -> dict:
    t0 = time.perf_counter()
    requests = [engine.submit(p, c)[0] for p, c in zip(prompts, configs, strict=True)]
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    ttft = [r.t_first - t0 for r in requests]
    tpot = [(r.t_done - r.t_first) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1]
    return _summary(sum(len(r.tokens) for r in requests), wall, ttft, tpot)


def run_http(engine: Engine, prompts, configs) -> dict:
    """The workload through the HTTP server: streaming completions with token-id prompts (logprobs=0, so
    each event lists its tokens even while their text is an incomplete UTF-8 sequence)."""
    import httpx
    import uvicorn

    from jaxgen.serving.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "bench"), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    engine.start()
    thread.start()
    while not server.started:
        time.sleep(0.05)

    async def one(client, prompt, cfg, t0):
        body = {"prompt": prompt, "max_tokens": cfg.max_new_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}  # fmt: skip
        first = last = None
        tokens = 0
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                got = (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("tokens") or []
                if got:
                    last = time.perf_counter()
                    first = first or last
                    tokens += len(got)
        return tokens, first - t0, (last - first) / max(tokens - 1, 1)

    async def all_at_once():
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            t0 = time.perf_counter()
            out = await asyncio.gather(*(one(client, p, c, t0) for p, c in zip(prompts, configs, strict=True)))
            return out, time.perf_counter() - t0

    try:
        out, wall = asyncio.run(all_at_once())
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()
    return _summary(sum(o[0] for o in out), wall, [o[1] for o in out], [o[2] for o in out if o[0] > 1])


def run_static(gen: Generator, prompts, configs, batch: int) -> dict:
    t0 = time.perf_counter()
    ttft, tpot, tokens = [], [], 0
    for start in range(0, len(prompts), batch):
        first: dict[int, float] = {}
        done: dict[int, float] = {}
        for update in gen.stream(prompts[start : start + batch], configs[start : start + batch]):
            now = time.perf_counter()
            for c in update:
                if c.tokens and c.prompt_index not in first:
                    first[c.prompt_index] = now
                if c.finish_reason and c.prompt_index not in done:
                    done[c.prompt_index] = now
                    tokens += len(c.tokens)
                    if len(c.tokens) > 1:
                        tpot.append((now - first[c.prompt_index]) / (len(c.tokens) - 1))
        ttft += [t - t0 for t in first.values()]
    return _summary(tokens, time.perf_counter() - t0, ttft, tpot)


def _summary(tokens, wall, ttft, tpot) -> dict:
    p = np.percentile
    return {
        "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "ttft_p50": p(ttft, 50), "ttft_p99": p(ttft, 99), "tpot_p50": p(tpot, 50), "tpot_p99": p(tpot, 99),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama-small")
    parser.add_argument("--layers", type=int, default=4, help="model depth (default 4, to keep the run short)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--slots", type=int, default=16, help="engine slots = static batch size")
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-http", action="store_true", help="skip the row through the HTTP server")
    args = parser.parse_args()
    overrides = [f"model.num_layers={args.layers}", "model.max_seq_len=1024"]
    cfg = load_config(ROOT / "configs" / f"{args.config}.yaml", overrides).model
    params = model.init_params(cfg, jax.random.key(0))
    tok = Tokenizer.byte_level()
    serve = ServeConfig(slots=args.slots, chunk_steps=args.chunk_steps, kv_memory_gb=0.5)
    print(f"{args.config} with {args.layers} layers, float32; {args.requests} requests; {args.slots} slots")
    prompts, configs = workload(args.requests, args.seed)
    shared_prompts, shared_configs = workload(args.requests, args.seed, prefix=256)
    warm_p, warm_c = workload(24, args.seed + 1)

    results = {}
    header = f"{'run':<42}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"

    def show(name):
        r = results[name]
        print(
            f"{name:<42}{r['tokens']:>8}{r['wall_s']:>8.1f}{r['tok_s']:>8.1f}{r['ttft_p50']:>9.2f}s{r['ttft_p99']:>7.2f}s"
            f"{r['tpot_p50'] * 1e3:>8.1f}ms{r['tpot_p99'] * 1e3:>6.0f}ms",
            flush=True,
        )

    print(header, flush=True)
    engine = Engine(params, cfg, tok, serve)
    engine.generate(warm_p + shared_prompts[:2], warm_c + shared_configs[:2])  # compile
    results["engine"] = run_engine(engine, prompts, configs)
    show("engine")
    if not args.no_http:
        engine.pool.clear_cache()  # the engine row's prompts are cached: start both rows cold
        results["engine behind HTTP (streaming clients)"] = run_http(engine, prompts, configs)
        show("engine behind HTTP (streaming clients)")
    gen = Generator(params, cfg, tok, max_batch=args.slots, chunk_steps=args.chunk_steps)
    run_static(gen, prompts, configs, args.slots)  # compile every batch's shapes
    results["static batches (generate)"] = run_static(gen, prompts, configs, args.slots)
    show("static batches (generate)")
    engine.pool.clear_cache()
    results["shared prefix: engine, prefix caching"] = run_engine(engine, shared_prompts, shared_configs)
    show("shared prefix: engine, prefix caching")
    plain = Engine(params, cfg, tok, dataclasses.replace(serve, prefix_caching=False))
    plain.generate(warm_p + shared_prompts[:2], warm_c + shared_configs[:2])
    results["shared prefix: engine, no prefix caching"] = run_engine(plain, shared_prompts, shared_configs)
    show("shared prefix: engine, no prefix caching")

    ratio = results["engine"]["tok_s"] / results["static batches (generate)"]["tok_s"]
    ttft = results["shared prefix: engine, no prefix caching"]["ttft_p50"]
    ttft /= results["shared prefix: engine, prefix caching"]["ttft_p50"]
    if not args.no_http:
        http = results["engine behind HTTP (streaming clients)"]["tok_s"] / results["engine"]["tok_s"]
        print(f"\nthrough HTTP / engine alone throughput: {http:.2f}x")
    print(f"engine / static batching throughput: {ratio:.2f}x (target 1.7x)")
    print(f"time to first token p50, no prefix caching / prefix caching: {ttft:.2f}x (target >= 2x)")
    print(f"engine compilations: {engine.compilations}; generate compilations: {gen.compilations}")


if __name__ == "__main__":
    main()
