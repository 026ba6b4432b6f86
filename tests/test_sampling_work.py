"""A decode step does the alternatives' and penalties' work only when some row asks (value-dependent
branches): the other rows' outputs do not change, the asking rows' equal the Generator's, nothing
recompiles when the settings change."""

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128)
SERVE = ServeConfig(slots=4, page_size=16, num_pages=40, chunk_steps=4, prefill_chunk=32, max_logprobs=3)
PROMPTS = [list(range(10, 30)), list(range(50, 62)), list(range(100, 125)), list(range(3, 20))]
PLAIN = SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
ASKING = [
    SamplingConfig(max_new_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingConfig(
        max_new_tokens=10,
        temperature=0.8,
        seed=3,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        ignore_eos=True,
    ),
]


@pytest.fixture(scope="module")
def params():
    p = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, p)  # sharper logits: no near-ties in argmax


@pytest.fixture(scope="module")
def engine(params):
    return Engine(params, CFG, Tokenizer.byte_level(), SERVE)


@pytest.fixture(scope="module")
def gen(params):
    return Generator(params, CFG, Tokenizer.byte_level(), max_batch=4)


@pytest.mark.parametrize("asking", ASKING, ids=["logprobs", "penalties"])
def test_a_row_asking_changes_no_other_row_and_nothing_recompiles(engine, gen, asking):
    plain = engine.generate(PROMPTS, PLAIN)  # no row asks: the branches skip the work
    engine.pool.clear_cache()  # the same prompts again prefill whole: the same prefill calls (shapes) as above
    compiled = engine.compilations
    mixed = engine.generate(PROMPTS, [PLAIN, PLAIN, PLAIN, asking])  # the last row asks
    assert engine.compilations == compiled  # settings are values: the same programs ran
    for a, b in zip(plain[:3], mixed[:3], strict=True):
        assert a.tokens == b.tokens  # the same tokens; log-probabilities to float32 rounding (the batch's
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)  # fusion may change the last bit)
    ref = gen.generate([PROMPTS[3]], asking)[0]
    got = mixed[3]
    assert got.tokens == ref.tokens  # penalties applied from counts kept up to date
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
    if asking.logprobs:
        for g, r in zip(got.top_logprobs, ref.top_logprobs, strict=True):
            assert list(g) == list(r)
            np.testing.assert_allclose(list(g.values()), list(r.values()), atol=1e-5)
    else:
        assert plain[3].tokens != got.tokens  # the penalties and the draw did change this row
