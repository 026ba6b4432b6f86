"""Inference: sampling, the decode loop, Generator, beam search and the continuous-batching engine.

errors.py      SamplingError, the error every request setting raises (a leaf: sampling and structured share it)
sampling.py    per-request settings (the one validation every door shares) and the sampling function
decode.py      the decode core: DecodeState, prefill, the while_loop, recording tokens, finishing a row
generator.py   Generator: static batches through the decode core, the tool beneath LLM
llm.py         LLM, the Python front door: a model loaded once, generate / stream / score on the engine
loading.py     loading for inference: run and Hugging Face folders, int8 weights, the draft model
beam.py        beam search
speculative.py speculative decoding, n-gram, draft-model or EAGLE-head drafts (the speculating loop of Generator
               and engine)
spec_gate.py   when speculation pays: the engine's per-chunk choice from measured tokens/s per batch size
structured/    structured output: JSON schema, regex, choice, grammar as token automata whose tables live on the device
scoring.py     log-probabilities of known tokens (score, prompt logprobs), the head run in blocks
engine/        the serving engine: core.py (API, thread; schedule -> execute -> update), runner.py (the device
               state, runs a plan), lora.py (adapters in the bank)
budget.py      the settings checked against the model and the memory before the engine allocates anything
scheduler.py   the engine's decisions and bookkeeping, no JAX: admission, the prefill budget, pages, preemption
               (StepPlan), and each step's outputs taken (StepOutput -> Update: tokens, stop strings, finishes)
steps.py       the engine's device steps: pure jitted functions of the decode state, donated
sequence.py    a sequence in the engine (Sequence), its Status, the engine's errors
pages.py       the paged cache's host side: free pages, reference counts, prefix cache, the page policy
adapters.py    multi-LoRA serving's host side: adapter names -> slots of the engine's bank, PEFT folders read
stats.py       the engine's statistics in a prometheus_client registry (counters, gauges, histograms, compilations)
precompile.py  every program a request can reach compiled at start, before the engine is ready
textstream.py  exact text deltas for streaming
"""

from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Completion, Generator, generate
from jaxgen.inference.llm import LLM, RequestOutput
from jaxgen.inference.sampling import SamplingConfig, SamplingError

__all__ = ["LLM", "Completion", "Engine", "Generator", "RequestOutput", "SamplingConfig", "SamplingError", "generate"]
