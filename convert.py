"""Export a jaxgen run to a Hugging Face model folder, or a LoRA run's adapters to a PEFT adapter folder:
`python convert.py RUN_DIR OUT_DIR [--step N] [--merge-lora]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Export a jaxgen checkpoint (trained or fine-tuned with train.py) to a Hugging Face model folder: config.json,
generation_config.json, float32 safetensors and the tokenizer. transformers loads it with
AutoModelForCausalLM.from_pretrained(OUT_DIR). GPT-2 style models export as gpt2; rope + rmsnorm ones as llama,
mistral (sliding window), qwen2 (q/k/v biases), gemma (geglu) or the family they were imported from.

A LoRA run (model.lora.rank > 0) holds adapters only. By default its adapters are written as a PEFT adapter
folder (adapter_config.json, adapter_model.safetensors; base_model_name_or_path is the run's
training.init_from), which peft.PeftModel.from_pretrained(base_model, OUT_DIR) loads onto the base. With
--merge-lora the adapters are merged into the base (W + A B alpha / rank, float32) and the merged model is
exported as a Hugging Face model folder."""

EPILOG = """\
examples:
  python convert.py runs/default hf/default
  python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf/default')"
  python convert.py runs/lora adapters/lora                 # a LoRA run: a PEFT adapter folder
  python convert.py runs/lora hf/lora-merged --merge-lora   # a LoRA run merged into its base"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="run folder written by train.py")
    parser.add_argument("out_dir", type=Path, help="folder to write (created; its old weight files are replaced)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--merge-lora", action="store_true", help="LoRA runs: merge the adapters into the base and export the model"
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=2.0, help="split weights into files of at most this size (default 2)"
    )
    args = parser.parse_args(argv)
    if args.max_shard_gb <= 0:
        parser.error(f"--max-shard-gb {args.max_shard_gb} is not allowed: a size > 0")
    if args.out_dir.resolve() == args.run_dir.resolve():
        parser.error("out_dir must differ from run_dir")
    try:
        what = _convert(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError, HFError and CheckpointError among them
        print(f"error: {e}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in args.out_dir.iterdir())
    print(f"wrote {args.out_dir} ({what}): {', '.join(files)}")
    return 0


def _convert(args) -> str:
    """Writes args.out_dir; returns what it holds ("llama", "PEFT adapter for llama")."""
    from jaxgen import hf
    from jaxgen.config import load_config
    from jaxgen.inference.loading import load_lora_run, load_run

    saved = load_config(args.run_dir / "config.yaml") if (args.run_dir / "config.yaml").exists() else None
    is_lora = saved is not None and saved.model.lora.rank > 0
    if args.merge_lora and not is_lora:
        raise ValueError(f"--merge-lora: {args.run_dir} is not a LoRA run (no model.lora.rank > 0); drop the flag")
    if is_lora and not args.merge_lora:
        if saved.training.init_from is None:
            raise ValueError(
                f"{args.run_dir} is a LoRA run on a base drawn from training.seed (no training.init_from): no Hugging "
                "Face model is its base, so a PEFT adapter would fit nothing; export it merged with --merge-lora"
            )
        cfg, _, _, adapters = load_lora_run(args.run_dir, step=args.step)
        family = hf.family_of(cfg.model)
        hf.write_peft_adapter(args.out_dir, adapters, cfg.model, base_model_name_or_path=cfg.training.init_from)
        return f"PEFT adapter for {family}"
    cfg, tokenizer, params = load_run(args.run_dir, step=args.step)  # a LoRA run's adapters merged in
    family = hf.family_of(cfg.model)
    hf.save_pretrained(args.out_dir, params, cfg.model, tokenizer, max_shard_bytes=int(args.max_shard_gb * 2**30))
    return family


if __name__ == "__main__":
    sys.exit(main())
