"""Export a jaxgen run to a Hugging Face model folder: `python convert.py RUN_DIR OUT_DIR [--step N]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Export a jaxgen checkpoint (trained or fine-tuned with train.py) to a Hugging Face model "
        "folder: config.json, generation_config.json, float32 safetensors and the tokenizer. transformers loads it "
        "with AutoModelForCausalLM.from_pretrained(OUT_DIR). GPT-2 style models export as gpt2; rope + rmsnorm ones "
        "as llama, mistral (sliding window), qwen2 (q/k/v biases) or gemma (geglu).",
        epilog="example:\n  python convert.py runs/default hf/default\n"
        "  python -c \"import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf/default')\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="run folder written by train.py")
    parser.add_argument("out_dir", type=Path, help="folder to write (created; its old weight files are replaced)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--max-shard-gb", type=float, default=2.0, help="split weights into files of at most this size (default 2)"
    )
    args = parser.parse_args(argv)
    if args.max_shard_gb <= 0:
        parser.error(f"--max-shard-gb {args.max_shard_gb} is not allowed: a size > 0")
    if args.out_dir.resolve() == args.run_dir.resolve():
        parser.error("out_dir must differ from run_dir")

    from jaxgen import hf
    from jaxgen.inference.loading import load_run

    try:
        cfg, tokenizer, params = load_run(args.run_dir, step=args.step)
        family = hf.family_of(cfg.model)
        hf.save_pretrained(args.out_dir, params, cfg.model, tokenizer, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in args.out_dir.iterdir())
    print(f"wrote {args.out_dir} ({family}): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
