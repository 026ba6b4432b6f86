"""jaxgen: train and run decoder-only language models in JAX with pure, jitted functions.

`jaxgen.generate(run_dir_or_params, prompts, sampling)` is the one-call entry point; `Generator`
keeps compiled programs between calls.
"""

from jaxgen.generate import Completion, Generator
from jaxgen.generate import generate as generate  # the function; `jaxgen.generate` the module stays importable
from jaxgen.sampling import SamplingConfig

__all__ = ["Completion", "Generator", "SamplingConfig", "generate"]
