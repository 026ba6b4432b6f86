"""The engine's programs compiled at start, before it is ready (issue 45), so that no request waits for one.

    precompile(engine, progress=True)       # before engine.start(): serve.py http does it (serve.precompile)

A program is compiled for each set of static settings and shapes its step is called with; the settings a
request may ask for are arrays, so what a request reaches is: the prefill call at each (rows, columns) a step
can make (`scheduler.call_shapes`: rows 1, 4, 16, ... up to the slots, columns 16, 32, ... up to the bucket of
serve.prefill_chunk, within the step's padded budget), run once each on padding rows that change nothing; a
prompt-scored chunk of each column bucket; the decode chunk, and the speculative one at each draft window (2,
4, 8) (and the plain chunk of speculating rows, `spec_gate`); and the small programs that start and stop a
slot. These run through the engine itself, by a tiny request whose prompt (token ids) has the chunk's length:
the same host code and the same argument types as a real request, so exactly the same programs. Structured
output's grammar table has serve.grammar_states rows from the start (the decode programs above are compiled
with it), and the program that pushes it to the device runs once here: constraints within those states compile
nothing; one beyond them grows the table and compiles the decode programs again (counted after ready in
/metrics). With a LoRA bank (serve.max_loras), its write runs once (zeros into an empty slot), so loading an
adapter compiles nothing. The warm-up's requests are not counted in the engine's statistics, and the pages
they leave in the prefix cache are dropped.

With a store of executables in use (`jaxgen.executables`: the command lines' default), the prefill calls and
the prompt-scored ones are compiled, or loaded, from their arguments' shapes in threads and never run (running
them took most of a warm start: llama-small's scored chunks of up to 256 tokens), and only the other warm-up
requests run.
"""

from __future__ import annotations

import functools
import logging
import os

from jaxgen import executables
from jaxgen.inference.decode import bucket
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.scheduler import call_shape, call_shapes

log = logging.getLogger(__name__)
WINDOWS = (2, 4, 8)  # speculative.window's draft windows


def scored_sizes(engine) -> list[int]:
    """The prompt length that reaches each column bucket of a prompt-scored chunk."""
    longest = min(engine.serve.prefill_chunk, engine.cfg.max_seq_len - 2)  # a chunk, and room for a token after it
    sizes, c = [], 16
    while c < bucket(longest):
        sizes.append(c)
        c *= 2
    return [*sizes, min(c, longest)]  # the last bucket, reached by the longest chunk


def warm_up_requests(engine, scored: bool = True) -> list[tuple[list[int], SamplingConfig]]:
    """(prompt ids, settings) of one request per program a request can reach (see the module docstring);
    without the prompt-scored ones when not `scored` (compiled ahead instead)."""
    cfg = engine.cfg
    plain = SamplingConfig(max_new_tokens=1, temperature=0.0)
    score = SamplingConfig(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    wide = SamplingConfig(max_new_tokens=1, temperature=0.0, repetition_penalty=1.1)  # `steps.set_wide`
    todo = [(16, plain), (16, wide)] + [(n, score) for n in (scored_sizes(engine) if scored else ())]
    todo += [(16, SamplingConfig(max_new_tokens=2, temperature=0.0, num_speculative_tokens=w)) for w in WINDOWS]
    # distinct first tokens: no prompt reuses another's pages (a prefix hit would shorten its chunk)
    ids = min(cfg.vocab_size - 1, 200)  # ids 1..200: bytes for a byte tokenizer, any model's tokens
    return [([1 + (i + j) % ids for j in range(n)], s) for i, (n, s) in enumerate(todo)]


def precompile(engine, progress: bool = False, workers: int = min(4, os.cpu_count() or 1)) -> int:
    """Runs `warm_up_requests` through `engine` (not started: its thread would run them too) and returns the
    programs traced. A request the engine refuses (a pool too small for the longest bucket) is skipped, with a
    line in the log. With a store of executables in use (`jaxgen.executables.in_use`), the prefill calls are
    compiled or loaded in `workers` threads and not run (XLA compiles without the GIL; tracing takes turns);
    without one, each is run once on padding rows, which is what makes jit compile it."""
    if engine.running:
        raise RuntimeError("precompile(engine) runs before engine.start()")
    from tqdm import tqdm

    before = engine.compilations
    engine.stats.muted = True  # the warm-up is not traffic
    engine.runner.gate = None  # every speculative window's chunk runs (`compile_unspeculated` sets a new gate)
    longest = min(engine.serve.prefill_chunk, engine.cfg.max_seq_len - 2)
    shapes = call_shapes(engine.serve.prefill_chunk, engine.serve.slots, longest)
    bar = functools.partial(tqdm, desc="precompile prefill", unit="shape", disable=not progress)
    try:
        ahead = executables.in_use()  # the plain and the prompt-scored prefill calls compiled, not run
        if ahead:
            scored = [call_shape([n], engine.serve.slots)[1] for n in scored_sizes(engine)]
            with bar(total=len(shapes) + len(scored)) as b:
                engine.compile_prefill_ahead(shapes, workers, done=lambda: b.update(1), scored_columns=scored)
        else:
            for rows, columns in bar(shapes):
                engine.compile_prefill(rows, columns)
        with engine.lock:
            engine.runner.compile_grammar()
            engine.runner.compile_bank()
        todo = warm_up_requests(engine, scored=not ahead)
        for ids, sampling in tqdm(todo, desc="precompile", unit="request", disable=not progress):
            try:
                engine.submit(ids, sampling)
            except ValueError as e:  # SamplingError, PageError
                log.info("precompile: a %d-token prompt skipped: %s", len(ids), e)
                continue
            engine.run_until_idle()
    finally:
        engine.stats.muted = False
    with engine.lock:
        engine.pool.clear_cache()
        engine.runner.compile_unspeculated()  # after the warm-up: the gate starts with no figures
    return engine.compilations - before
