"""Run a trained model.

    python serve.py generate --checkpoint DIR (--prompt TEXT | --input F.jsonl --output F.jsonl)
    python serve.py http --checkpoint DIR [--config configs/serve.yaml] [key=value ...] [--port 8000] [--api-key KEY]

DIR is a run folder written by train.py or a local Hugging Face model folder. Both commands run on the
serving engine (continuous batching over a paged KV cache, prefix caching). Settings: the defaults, then
--config, then dotted key=value overrides, then explicit flags; later wins. The command line itself is
`jaxgen.serving.cli`.
"""

from __future__ import annotations

import sys

from jaxgen.serving.cli import command_config, main, parse_args
from jaxgen.serving.cli import parser as _parser

__all__ = ["_parser", "command_config", "main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
