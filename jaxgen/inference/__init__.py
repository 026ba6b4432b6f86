"""Inference: sampling, the decode loop, Generator, beam search and the continuous-batching engine.

sampling.py    per-request settings (the one validation every door shares) and the sampling function
generator.py   the decode core (DecodeState, the while_loop, finishing a row) and Generator
beam.py        beam search
engine.py      the serving engine: slots, scheduler, chunked prefill, continuous batching
pages.py       host bookkeeping of the paged cache: free pages, reference counts, prefix cache
textstream.py  exact text deltas for streaming
"""

from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Completion, Generator, generate
from jaxgen.inference.llm import LLM, RequestOutput
from jaxgen.inference.sampling import SamplingConfig, SamplingError

__all__ = ["LLM", "Completion", "Engine", "Generator", "RequestOutput", "SamplingConfig", "SamplingError", "generate"]
