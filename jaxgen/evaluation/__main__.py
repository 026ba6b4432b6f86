"""`python -m jaxgen.evaluation ...`: lm-eval's own command line with the "jaxgen" model registered.

lm-eval (0.4.13) finds models only in its own package, with no plugin entry point, so a bare `lm_eval
--model jaxgen` cannot see jaxgen's. This runs the same command line after importing jaxgen's model:

    python -m jaxgen.evaluation --model jaxgen --model_args checkpoint=runs/tiny --tasks TASK ...

A model that does not load (no such folder, no checkpoint yet, a broken config) ends it with one line, and
so does a task whose data cannot be downloaded (offline): tasks over local files need no network.
"""

import sys

from lm_eval.__main__ import cli_evaluate

import jaxgen.evaluation.harness  # noqa: F401  (registers the model "jaxgen")


def main() -> int:
    sys.argv[0] = "python -m jaxgen.evaluation"
    try:
        cli_evaluate()
    except (FileNotFoundError, ValueError) as e:  # what load_model raises for a folder it cannot use
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConnectionError as e:  # datasets' "Couldn't reach 'Rowan/hellaswag' on the Hub", after its retries
        print(f"error: a task's data could not be downloaded ({e}); without network, evaluate a task over a local "
              "file (--include_path FOLDER: docs/evaluation.md, section Local tasks)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
