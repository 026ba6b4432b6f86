"""Beam search at the edge of the context: prompts whose bucket reaches max_seq_len, and prompts that
run out of positions before max_new_tokens. Width 1 must match greedy decoding token for token."""

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.beam import beam_search
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

# Learned positions: one past max_seq_len would be clipped silently, so an overrun changes tokens.
# A vocabulary of bytes only: the tokenizer's end-of-text id (256) is never produced, so nothing ends early.
CFG = ModelConfig(vocab_size=256, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_seq_len=64, position="learned")


@pytest.fixture(scope="module")
def gen():
    params = model.init_params(CFG, jax.random.key(0))
    params = jax.tree.map(lambda p: p * 8 if p.ndim >= 2 else p, params)  # peaked logits: decisive argmax
    return Generator(params, CFG, Tokenizer.byte_level(), max_batch=8)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).tolist()


def _assert_width_one_is_greedy(gen, prompts, max_new):
    greedy = gen.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))
    beams = beam_search(gen, prompts, width=1, max_new_tokens=max_new, length_penalty=0.0)
    for g, hyps in zip(greedy, beams, strict=True):
        assert g.finish_reason == "length"
        assert hyps[0].tokens == g.tokens
        np.testing.assert_allclose(hyps[0].logprob, sum(g.logprobs), rtol=1e-4)
    return greedy


def test_prompt_bucket_at_the_context_length_still_decodes(gen):
    """A 40-token prompt pads to 64 = max_seq_len: the cache must hold the padding plus the new tokens."""
    greedy = _assert_width_one_is_greedy(gen, [_prompt(40, 0)], max_new=8)
    assert len(greedy[0].tokens) == 8


def test_running_out_of_positions_ends_like_greedy(gen):
    """A 60-token prompt has 4 positions left: beam search stops there, as greedy does, even though a
    cache sized for max_new_tokens=32 would hold more; a short prompt in the same batch is unaffected."""
    greedy = _assert_width_one_is_greedy(gen, [_prompt(60, 1), _prompt(10, 2)], max_new=32)
    assert [len(g.tokens) for g in greedy] == [CFG.max_seq_len - 60, 32]


def test_wider_beams_respect_the_context_length(gen):
    hyps = beam_search(gen, [_prompt(60, 3), _prompt(40, 4)], width=3, max_new_tokens=16, length_penalty=1.0)
    assert [len(h) for h in hyps] == [3, 3]
    assert all(1 <= len(h.tokens) <= CFG.max_seq_len - 60 for h in hyps[0])
    assert all(1 <= len(h.tokens) <= 16 for h in hyps[1]) and len(hyps[1][0].tokens) > 0
