"""`python -m jaxgen.evaluation ...`: lm-eval's own command line with the "jaxgen" model registered.

lm-eval (0.4.13) finds models only in its own package, with no plugin entry point, so a bare `lm_eval
--model jaxgen` cannot see jaxgen's. This runs the same command line after importing jaxgen's model:

    python -m jaxgen.evaluation --model jaxgen --model_args checkpoint=runs/tiny --tasks TASK ...
"""

import sys

from lm_eval.__main__ import cli_evaluate

import jaxgen.evaluation.harness  # noqa: F401  (registers the model "jaxgen")

if __name__ == "__main__":
    sys.argv[0] = "python -m jaxgen.evaluation"
    cli_evaluate()
