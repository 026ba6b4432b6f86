"""Evaluation with EleutherAI's lm-evaluation-harness (`lm-eval`, an optional dependency: `pip install jaxgen[eval]`).

harness.py     `JaxgenLM`, registered with lm-eval as the model "jaxgen": a run folder or an HF folder in-process
__main__.py    `python -m jaxgen.evaluation --model jaxgen --model_args checkpoint=DIR --tasks ...` (lm-eval's
               own command line, with the jaxgen model registered first)

Through the server instead: `serve.py http` and lm-eval's `local-completions` model (docs/evaluation.md).
"""
