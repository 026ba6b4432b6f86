"""jaxgen.LLM, the front door: loaded once, generate on the engine, exact streams, score via Generator."""

import numpy as np
import pytest

import jaxgen
from jaxgen import LLM, RequestOutput, SamplingConfig
from jaxgen.config import ConfigError
from jaxgen.inference import loading as checkpoint
from jaxgen.inference.sampling import SamplingError

PROMPTS = ["def fib(", "import os\n"]
CONFIGS = [
    SamplingConfig(temperature=0, max_new_tokens=12),
    SamplingConfig(temperature=0.9, top_k=40, seed=7, n=2, max_new_tokens=12),
]


@pytest.fixture(scope="module")
def llm(tiny_run):
    return LLM(tiny_run, slots=4, num_pages=64)


def test_generate_equals_jaxgen_generate(llm, tiny_run):
    outs = llm.generate(PROMPTS, CONFIGS)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS]
    assert [len(o.outputs) for o in outs] == [1, 2]
    reference = jaxgen.generate(tiny_run, PROMPTS, CONFIGS)  # Generator: a static batch, another decode path
    got = [c for o in outs for c in o.outputs]
    assert len(got) == len(reference) == 3
    for a, b in zip(got, reference, strict=True):
        assert (a.prompt_index, a.sample_index, a.tokens, a.text, a.finish_reason) == (
            b.prompt_index, b.sample_index, b.tokens, b.text, b.finish_reason,
        )  # fmt: skip
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert got[1].tokens != got[2].tokens  # the two samples differ
    (single,) = llm.generate(PROMPTS[0], CONFIGS[0])  # one prompt: a list of one
    assert single.outputs[0].tokens == got[0].tokens


def test_stream_deltas_join_to_the_generated_text(llm):
    sampling = SamplingConfig(temperature=0.9, seed=3, max_new_tokens=40, stop=["\n\n"])
    it = llm.stream("class ", sampling)
    deltas = []
    while True:
        try:
            deltas.append(next(it))
        except StopIteration as end:
            completion = end.value
            break
    (out,) = llm.generate("class ", sampling)
    assert "".join(deltas) == completion.text == out.outputs[0].text
    assert len(deltas) > 1 and completion.tokens == out.outputs[0].tokens
    with pytest.raises(SamplingError, match="n=2 is not allowed in stream"):
        llm.stream("class ", SamplingConfig(n=2))

    early = llm.stream("class ", sampling)
    next(early)
    early.close()  # cancels the request: its slot and pages are free again
    llm.engine.run_until_idle()
    assert llm.engine.idle()  # no slot or queue entry left


def test_score_equals_generator_score(llm, tiny_run):
    from jaxgen.inference.generator import Generator

    cfg, tokenizer, params = checkpoint.load_model(tiny_run)
    prompts, continuations = ["x = ", "def f("], ["1\n", "a, b):"]
    expected = Generator(params, cfg, tokenizer).score(prompts, continuations)
    got = llm.score(prompts, continuations)
    for a, b in zip(got, expected, strict=True):
        assert a["tokens"] == b["tokens"]
        np.testing.assert_allclose(a["token_logprobs"], b["token_logprobs"], rtol=1e-6, atol=1e-6)


def test_loaded_once_compiled_once_and_a_bad_request_leaves_nothing_queued(llm, tiny_run, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("LLM loaded the model again")

    monkeypatch.setattr(checkpoint, "load_model", load_model)
    engine = llm.engine
    llm.generate(PROMPTS, CONFIGS)
    compiled = engine.compilations
    again = llm.generate(["while ", "for i in"], [SamplingConfig(temperature=0.5, seed=1, max_new_tokens=9)] * 2)
    assert llm.engine is engine and engine.compilations == compiled  # new prompts and values: nothing compiles
    assert all(len(o.outputs[0].tokens) <= 9 for o in again)

    too_many = SamplingConfig(logprobs=llm.serve.max_logprobs + 1)
    with pytest.raises(SamplingError, match="logprobs"):
        llm.generate(PROMPTS, [CONFIGS[0], too_many])
    (out,) = llm.generate(PROMPTS[:1], CONFIGS[0])  # the first prompt of the failed call did not stay queued
    assert len(out.outputs) == 1 and engine.idle() and engine.queue_length() == 0

    with pytest.raises(ConfigError, match="unknown serve setting slot; allowed: slots, page_size"):
        LLM(tiny_run, slot=4)  # refused before anything loads (load_model would raise)


def test_the_engine_runs_on_the_serve_configs_devices_not_on_every_one(llm, tiny_run):
    """A folder's weights and the page pool on serve.data_parallel x tensor_parallel devices (one here), not
    on the training default of every device (8 in the tests: the pool held 8 times over); params handed
    in from a mesh are moved to the engine's device too."""
    import jax

    def devices(tree):
        return {d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}

    assert len(devices(llm.params)) == len(devices(llm.engine.state)) == 1
    cfg, tok, spread = checkpoint.load_run(tiny_run)  # the training default: every device on data
    assert len(devices(spread)) == jax.device_count() > 1
    again = LLM(spread, cfg=cfg.model, tokenizer=tok, slots=2, num_pages=8)
    assert len(devices(again.params)) == len(devices(again.engine.state)) == 1
