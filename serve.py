"""Run a trained model.

    python serve.py generate --checkpoint DIR (--prompt TEXT | --input F.jsonl --output F.jsonl)
    python serve.py http --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

DIR is a run folder written by train.py or a local Hugging Face model folder. Both commands run on the
serving engine (continuous batching over a paged KV cache, prefix caching).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="run folder written by train.py (its latest checkpoint), or a local Hugging Face model folder "
        "(config.json, *.safetensors, tokenizer.json)",
    )
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0, help="KV-cache page pool size in GB (default 1)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share pages of common prompt prefixes")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Generate text with a jaxgen run folder (written by train.py) or a Hugging Face model folder."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate for one prompt or a JSONL file of requests",
        description="Generate for --prompt, or for every line of --input (JSONL: id, prompt, optional sampling "
        "fields) into --output. Rerunning the same command resumes: ids already in --output are skipped.",
    )
    _engine_args(g)
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; prints the completion")
    what.add_argument("--input", type=Path, help="JSONL requests")
    g.add_argument("--output", type=Path, help="JSONL results (required with --input)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    h = sub.add_parser(
        "http",
        help="an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
        epilog="example:\n  python serve.py http --checkpoint runs/default --port 8000\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"prompt": "def ", "max_tokens": 32}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _engine_args(h)
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--api-key", default=os.environ.get("JAXGEN_API_KEY"), help="require this bearer key")
    h.add_argument("--model-name", help="the model id clients use (default: the folder's name)")
    h.add_argument("--max-body-bytes", type=int, default=4_000_000, help="larger request bodies get 413 (default 4 MB)")
    h.add_argument("--max-queue", type=int, default=1024, help="queued requests beyond this get 429 (default 1024)")
    h.add_argument("--request-timeout", type=float, default=0.0, help="cancel requests running longer, in s (0 = off)")
    h.add_argument(
        "--shutdown-grace", type=float, default=10.0,
        help="on SIGTERM, seconds running requests get to finish before their streams are ended (default 10)",
    )  # fmt: skip
    return parser


def _serve_config(args):
    from jaxgen.config import ConfigError, ServeConfig

    limits = {}
    if args.command == "http":
        limits = dict(
            max_body_bytes=args.max_body_bytes, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
            shutdown_grace_s=args.shutdown_grace,
        )  # fmt: skip
    try:
        return ServeConfig(
            slots=args.slots, kv_memory_gb=args.kv_memory_gb, page_size=args.page_size,
            prefix_caching=not args.no_prefix_caching, **limits,
        )  # fmt: skip
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.input is not None and args.output is None:
        parser.error("--input needs --output")
    serve_cfg = _serve_config(args)
    from jaxgen.inference.sampling import SamplingConfig, SamplingError

    if args.command == "generate":
        try:
            defaults = SamplingConfig(
                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed,
            )  # fmt: skip
        except SamplingError as e:
            parser.error(str(e))
    from jaxgen.inference.engine import Engine
    from jaxgen.runtime import enable_compilation_cache
    from jaxgen.training.checkpoint import load_model

    enable_compilation_cache()
    try:
        cfg, tokenizer, params = load_model(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    engine = Engine(params, cfg, tokenizer, serve_cfg)
    if args.command == "http":
        return _http(engine, args)
    if args.prompt is not None:
        return _one_prompt(engine, args.prompt, defaults)
    from jaxgen.serving.batch_job import run_job

    summary = run_job(engine, args.input, args.output, defaults)
    print(json.dumps(summary))
    return 0


def _one_prompt(engine, prompt: str, defaults) -> int:
    from jaxgen.inference.sampling import SamplingError
    from jaxgen.inference.textstream import TextDeltas

    hold = max((len(s) for s in defaults.stop), default=1) - 1
    deltas = TextDeltas(engine.tokenizer, hold)  # exact text: no half characters, no half stop strings

    def show(seq):
        print(deltas.update(seq.text, final=bool(seq.finish_reason)), end="", flush=True)

    try:
        (seq,) = engine.submit(prompt, defaults, on_update=show)
    except SamplingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(prompt, end="", flush=True)
    engine.run_until_idle()
    print()
    if seq.error:
        print(f"error: {seq.error}", file=sys.stderr)
        return 1
    return 0


def _http(engine, args) -> int:
    from jaxgen.serving.server import create_app, serve_forever

    name = args.model_name or Path(args.checkpoint).resolve().name
    app = create_app(engine, name, args.api_key)
    serve_forever(engine, app, args.host, args.port, grace_s=engine.serve.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
