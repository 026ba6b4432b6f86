"""Run a trained model: `python serve.py generate --checkpoint RUN_DIR (--prompt TEXT | --input F --output F)`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
    g.add_argument(
        "--checkpoint",
        required=True,
        help="run folder written by train.py (its latest checkpoint), or a local Hugging Face model folder "
        "(config.json, *.safetensors, tokenizer.json)",
    )
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; prints the completion")
    what.add_argument("--input", type=Path, help="JSONL requests")
    g.add_argument("--output", type=Path, help="JSONL results (required with --input)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=16, help="requests per batch (default 16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.input is not None and args.output is None:
        parser.error("--input needs --output")
    from jaxgen.sampling import SamplingConfig, SamplingError

    try:
        defaults = SamplingConfig(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed,
        )  # fmt: skip
    except SamplingError as e:
        parser.error(str(e))
    from jaxgen.batch_job import run_job
    from jaxgen.checkpoint import load_model
    from jaxgen.generate import Generator
    from jaxgen.runtime import enable_compilation_cache

    enable_compilation_cache()
    try:
        cfg, tokenizer, params = load_model(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    gen = Generator(params, cfg, tokenizer, max_batch=max(args.batch_size, 1))
    if args.prompt is not None:
        try:
            print(args.prompt, end="", flush=True)
            shown = 0
            for update in gen.stream([args.prompt], defaults):
                text = update[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
            print()
        except SamplingError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    summary = run_job(gen, args.input, args.output, defaults, batch_size=args.batch_size)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
