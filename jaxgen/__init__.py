"""jaxgen: train and run decoder-only language models in JAX with pure, jitted functions.

The package is laid out by concern; imports only point down this list:
    config, sharding, tokenizer   configs, the axis glossary and mesh rules, tokenizers
    chat_template                 chat templates in jinja2's sandbox (the server's prompts, chat SFT data)
    executables                   compiled programs kept on disk, loaded at the next start without tracing
    runtime                       process-wide JAX settings for the command lines (the compilation caches)
    distributed                   joining other processes (jax.distributed), what only process 0 does
    model/                        the network and its KV caches
    hf/                           Hugging Face folders: config mapping, import, export
    training/                     the train step, the run loop, checkpoints, metrics, data
    inference/                    sampling, the decode core, Generator, beam search, the engine, LLM
    serving/                      the HTTP server and the batch job
    rl/                           reinforcement learning: policy-gradient objectives over sampled completions
    plan_length                   the longest sequence that fits: the search and its table (`--max-seq`)
    plan                          `python -m jaxgen.plan`: per-device memory of a config on a mesh
    precompile                    `python -m jaxgen.precompile`: a deployment's programs compiled ahead
    targets/                      compiling for TPU and GPU without one: targets, their compilers, a roofline
    evaluation/                   the lm-evaluation-harness model, `python -m jaxgen.evaluation`

`jaxgen.LLM(folder)` is the Python front door (load once, then generate / stream / score on the serving
engine); `Generator` is the static-batch tool beneath it; `jaxgen.generate(run_dir_or_params, prompts,
sampling)` is the one-call form. docs/ has a page per area.
"""

from jaxgen.inference.generator import Completion, Generator, generate
from jaxgen.inference.llm import LLM, RequestOutput
from jaxgen.inference.sampling import SamplingConfig

__all__ = ["LLM", "Completion", "Generator", "RequestOutput", "SamplingConfig", "generate"]
