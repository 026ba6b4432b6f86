"""jaxgen: train and run decoder-only language models in JAX with pure, jitted functions.

The package is laid out by concern; imports only point down this list:
    config, sharding, tokenizer   configs, the axis glossary and mesh rules, tokenizers
    distributed                   joining other processes (jax.distributed), what only process 0 does
    model/                        the network and its KV caches
    hf/                           Hugging Face folders: config mapping, import, export
    training/                     the train step, the run loop, checkpoints, metrics, data
    inference/                    sampling, the decode core, Generator, beam search, the engine
    serving/                      the HTTP server and the batch job

`jaxgen.generate(run_dir_or_params, prompts, sampling)` is the one-call entry point; `Generator`
keeps compiled programs between calls.
"""

from jaxgen.inference.generator import Completion, Generator, generate
from jaxgen.inference.llm import LLM, RequestOutput
from jaxgen.inference.sampling import SamplingConfig

__all__ = ["LLM", "Completion", "Generator", "RequestOutput", "SamplingConfig", "generate"]
