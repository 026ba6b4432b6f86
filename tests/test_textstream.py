"""Exact streaming and one stop-string rule, with a BPE tokenizer whose tokens split multi-byte characters
(and join several characters): Generator and Engine must end rows the same way."""

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.textstream import REPLACEMENT, TextDeltas
from jaxgen.tokenizer import EOS_TOKEN, Tokenizer

TEXT = ["日本語のテキストです。", "emoji 😀🎉 and accents: héllo wörld, naïve café", "def f(x):\n    return x * 2\n"]


@pytest.fixture(scope="module")
def bpe():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    return Tokenizer(tok)


def _splits_characters(tokenizer, ids) -> bool:
    return any(tokenizer.decode([t]).endswith(REPLACEMENT) for t in ids)


def test_the_bpe_tokenizer_splits_characters_and_joins_them(bpe):
    ids = bpe.encode("".join(TEXT))
    assert _splits_characters(bpe, ids)  # some token holds part of a character
    assert any(len(bpe.decode([t])) > 1 and REPLACEMENT not in bpe.decode([t]) for t in ids)  # some hold several


@pytest.mark.parametrize("hold", [0, 3])
def test_deltas_concatenate_to_the_final_text_whatever_the_chunks(bpe, hold):
    rng = np.random.default_rng(0)
    vocab = bpe.tok.get_vocab_size()
    mid_character = 0
    for trial in range(200):
        ids = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() if trial % 2 else bpe.encode(TEXT[trial % 3])
        stream, sent = TextDeltas(bpe, hold), []
        cuts = sorted(set(rng.integers(1, len(ids) + 1, 5).tolist()) | {len(ids)})
        for k in cuts:
            partial = bpe.decode(ids[:k])
            mid_character += partial.endswith(REPLACEMENT) and k < len(ids)
            sent.append(stream.update(partial, final=k == len(ids)))
            _, end = stream.new_tokens(ids[:k], final=k == len(ids))
            assert len(bpe.decode(ids[:end])) <= len("".join(sent)) or k == len(ids)
        assert "".join(sent) == bpe.decode(ids)
        assert stream.tokens_sent == len(ids)
    assert mid_character > 10  # the chunks really did end inside characters


@pytest.fixture(scope="module")
def engines(bpe):
    vocab = bpe.tok.get_vocab_size()
    cfg = ModelConfig(
        vocab_size=vocab, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128
    )
    params = jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, model.init_params(cfg, jax.random.key(3)))
    serve = ServeConfig(slots=4, num_pages=64, chunk_steps=4, prefill_chunk=64)
    return Generator(params, cfg, bpe, chunk_steps=4), Engine(params, cfg, bpe, serve)


def test_generator_and_engine_cut_a_stop_string_inside_a_token_the_same_way(bpe, engines):
    """The stop string starts inside a multi-character token: the text is cut at the character, the
    tokens keep the one that runs into it; Generator and Engine agree."""
    gen, engine = engines
    base = SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    (free,) = gen.generate(["def f("], base)
    prefixes = [bpe.decode(free.tokens[:k]) for k in range(len(free.tokens) + 1)]
    inside = [  # (token i, a character offset strictly inside it) where the 2 characters there first occur
        (i, c) for i in range(len(free.tokens)) for c in range(len(prefixes[i]) + 1, len(prefixes[i + 1]))
        if not prefixes[i + 1].endswith(REPLACEMENT) and REPLACEMENT not in free.text[c : c + 2]
        and free.text.find(free.text[c : c + 2]) == c
    ]  # fmt: skip
    assert inside, f"no multi-character token to cut inside in {free.text!r}"
    i, c = inside[0]
    stop = SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True, stop=(free.text[c : c + 2],))
    (g,) = gen.generate(["def f("], stop)
    (e,) = engine.generate(["def f("], stop)
    assert g.text == e.text == free.text[:c]
    keep = next(k for k, p in enumerate(prefixes) if len(p) >= c)  # the tokens that cover the kept text
    assert keep == i + 1 and g.tokens == e.tokens == free.tokens[:keep]
    assert g.finish_reason == e.finish_reason == "stop"
    np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-4)
