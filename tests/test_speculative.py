"""Speculative decoding (n-gram drafts, a draft model): the output equals plain decoding, greedy and sampled."""

import dataclasses
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingConfig, model
from jaxgen.config import ModelConfig
from jaxgen.inference import speculative
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.inference.sampling import SamplingError
from jaxgen.tokenizer import Tokenizer

CONFIGS = {
    "llama": ModelConfig(
        vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128,
        mlp="swiglu", norm="rmsnorm", position="rope",
    ),
    "gpt2": ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, d_ff=128, max_seq_len=128),
}  # fmt: skip
# the contiguous cache as accelerators lay it out (kernels.cache_layout): verification's writes of W + 1
# tokens by one dropping scatter, no cond
CONFIGS["llama-flat"] = dataclasses.replace(CONFIGS["llama"], cache_layout="flat")
# copy-heavy prompts (drafts find matches), ragged, one near the end of the context
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat; the cat sat on", "x" * 110]


def _same(a, b):
    assert (a.tokens, a.finish_reason, a.text) == (b.tokens, b.finish_reason, b.text)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def _mixed(a: int, b: int, c: int) -> list[SamplingConfig]:
    """Greedy; sampled with top-k, a repetition penalty and n=2; sampled with a frequency penalty and a
    stop sequence: `a`, `b` and `c` new tokens."""
    return [
        SamplingConfig(temperature=0.0, max_new_tokens=a, ignore_eos=True),
        SamplingConfig(temperature=0.9, top_k=50, seed=11, max_new_tokens=b, repetition_penalty=1.2, n=2),
        SamplingConfig(temperature=0.7, seed=3, max_new_tokens=c, frequency_penalty=0.3, stop_token_sequences=[[120]]),
    ]  # fmt: skip


@functools.cache
def _generator(name: str) -> Generator:
    """One Generator per config for the module: its compiled programs are shared by the tests."""
    cfg = CONFIGS[name]
    params = model.init_params(cfg, jax.random.key(1))
    return Generator(params, cfg, Tokenizer.byte_level(), GeneratorConfig(max_batch=8, chunk_steps=8, spec_gate=False))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_and_sampled_output_equals_plain_decoding(name):
    """Ragged rows with different windows (0 = off), greedy and sampled with penalties, a stop sequence
    and the context's end: token for token what plain decoding gives with the same seeds."""
    gen = _generator(name)
    plain = _mixed(24, 24, 40)
    spec = [dataclasses.replace(c, num_speculative_tokens=k) for c, k in zip(plain, (4, 3, 2), strict=True)]
    before = dict(gen.speculation)
    want = gen.generate(PROMPTS, plain)
    got = gen.generate(PROMPTS, spec)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    assert want[3].finish_reason == "length" and len(want[3].tokens) < 40  # the context ended it
    assert gen.speculation["proposed"] > before["proposed"]  # drafts were fed (random weights keep few)
    off = gen.generate(PROMPTS[:2], [spec[0], plain[1]])  # a batch mixing speculating and plain rows
    for a, b in zip(off, gen.generate(PROMPTS[:2], plain[:2]), strict=True):
        _same(a, b)


@pytest.mark.parametrize("rows", [1, 2])  # XLA:CPU has copied buffers at batch 1 only (see kvcache.num_blocks)
def test_the_speculating_loop_updates_the_cache_in_place(rows):
    """The compiled loop never copies a cache buffer (a lax.cond around the target's pass did, 4 times a step)."""
    gen = _generator("llama")
    captured = {}
    real = gen._spec_loop

    def spy(params, state, spec, **kw):
        captured.update(state=jax.tree.map(lambda x: x, state), spec=jax.tree.map(lambda x: x, spec), kw=kw)
        return real(params, state, spec, **kw)

    gen._spec_loop = spy
    try:
        gen.generate(PROMPTS[:rows], SamplingConfig(temperature=0.0, max_new_tokens=6, num_speculative_tokens=4))
    finally:
        gen._spec_loop = real
    statics = ("cfg", "w", "draft_cfg", "rule")
    loop = jax.jit(speculative.speculative_loop, static_argnames=statics, donate_argnums=(1, 2))
    text = loop.lower(gen.params, captured["state"], captured["spec"], **captured["kw"]).compile().as_text()
    shape = "f32[" + ",".join(map(str, captured["state"].cache.k[0][0].shape)) + "]"  # each layer's and block's buffer
    writes = [line for line in text.splitlines() if f"= {shape}" in line and re.search("scatter|dynamic-update", line)]
    copies = [line for line in text.splitlines() if re.search(rf"= {re.escape(shape)}\S* copy\(", line)]
    assert len(writes) >= 2 and not copies


def test_a_trained_model_keeps_drafts_and_takes_fewer_target_steps(tiny_run):
    """The tiny trained run continuing repetitive code: drafts are kept, so the rows take fewer target
    steps than tokens, and the output is still plain decoding's."""
    from jaxgen.inference.loading import load_model

    cfg, tok, params = load_model(tiny_run)
    gen = Generator(params, cfg, tok, GeneratorConfig(max_batch=2, chunk_steps=32, spec_gate=False))
    prompts = ["    x = 1\n    x = 1\n    x = 1\n", "import os\nimport os\nimport"]
    plain = SamplingConfig(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    want = gen.generate(prompts, plain)
    got = gen.generate(prompts, dataclasses.replace(plain, num_speculative_tokens=4))
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    stats = gen.speculation_stats()
    assert stats["accepted"] > 0 and stats["tokens_per_step"] > 1.0, stats


def test_serve_generate_speculates_with_a_draft_and_prints_plain_greedy_output(tiny_run, capsys):
    """`serve.py generate --draft DIR --num-speculative-tokens 4` (the run as its own draft: greedy drafts are
    kept but where a row ends) prints plain decoding's text; --draft without the number is refused."""
    import serve
    from jaxgen.serving import cli

    engines = []
    build = cli._engine
    argv = ["generate", "--checkpoint", str(tiny_run), "--prompt", "    x = 1\n    x = 1\n", "--temperature", "0",
            "--max-new-tokens", "24", "--slots", "2"]  # fmt: skip
    texts = []
    with mock.patch.object(cli, "_engine", lambda *a: engines.append(build(*a)) or engines[-1]):
        for extra in ([], ["--draft", str(tiny_run), "--num-speculative-tokens", "4"]):
            assert serve.main([*argv, *extra]) == 0
            texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len(argv[4])
    plain, drafted = (e.stats.snapshot() for e in engines)
    assert plain["spec_draft_tokens"] == 0 and drafted["spec_draft_tokens"] > 0
    assert drafted["spec_accepted_tokens"] >= drafted["spec_draft_tokens"] - 4, drafted  # the draft is the target
    with pytest.raises(SystemExit) as refused:
        serve.main([*argv, "--draft", str(tiny_run)])
    assert refused.value.code == 2 and "drafts only with --num-speculative-tokens N > 0" in capsys.readouterr().err


def test_many_seeds_sample_what_plain_decoding_samples():
    """The target distribution is kept: over 16 seeds every sampled token equals plain decoding's."""
    cfg = CONFIGS["llama"]
    params = model.init_params(cfg, jax.random.key(2))
    gen = Generator(params, cfg, Tokenizer.byte_level(), GeneratorConfig(max_batch=16, chunk_steps=16, spec_gate=False))
    base = SamplingConfig(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=0, n=16)
    want = gen.generate(["abababababababab"], base)
    got = gen.generate(["abababababababab"], dataclasses.replace(base, num_speculative_tokens=8))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert len({tuple(c.tokens) for c in want}) > 8  # the samples really differ


DRAFT = ModelConfig(vocab_size=257, num_layers=1, d_model=32, num_heads=2, d_ff=64, max_seq_len=128)


def test_a_draft_model_gives_plain_decodings_output():
    """A smaller random draft model (a different architecture): ragged rows, greedy and sampled with
    penalties, a stop sequence, the context's end; its guesses are checked, so the output is plain
    decoding's whatever it proposes."""
    cfg = CONFIGS["llama"]
    params = model.init_params(cfg, jax.random.key(1))
    draft = (model.init_params(DRAFT, jax.random.key(2)), DRAFT)
    gen = Generator(
        params, cfg, Tokenizer.byte_level(), GeneratorConfig(max_batch=8, chunk_steps=8, spec_gate=False), draft=draft
    )
    plain = _mixed(24, 24, 40)
    spec = [dataclasses.replace(c, num_speculative_tokens=4) for c in plain]
    want, got = gen.generate(PROMPTS, plain), gen.generate(PROMPTS, spec)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    assert gen.speculation["proposed"] > 0


def test_the_target_as_its_own_draft_keeps_every_greedy_draft():
    """The draft model's cache stays in step with the target's: drafting with the target itself, every
    greedy draft is kept except where a row ends (at most one short step per row)."""
    gen = _generator("gpt2")
    gen = Generator(gen.params, gen.cfg, gen.tokenizer, gen.config, draft=(gen.params, gen.cfg))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    want = gen.generate(PROMPTS, greedy)
    for k in (2, 8):
        before = dict(gen.speculation)
        got = gen.generate(PROMPTS, dataclasses.replace(greedy, num_speculative_tokens=k))
        assert [c.tokens for c in got] == [c.tokens for c in want]
        d = {name: gen.speculation[name] - before[name] for name in before}
        assert d["accepted"] >= d["proposed"] - len(PROMPTS) * k, d
        assert d["tokens"] / d["target_steps"] > k / 2, d


def test_a_draft_model_must_share_the_tokens_and_the_context():
    cfg = CONFIGS["gpt2"]
    params = model.init_params(cfg, jax.random.key(0))
    small = dataclasses.replace(DRAFT, vocab_size=300)
    with pytest.raises(ValueError, match="the draft model's vocab_size=300 differs from the target's 257"):
        Generator(params, cfg, Tokenizer.byte_level(), draft=(None, small))
    short = dataclasses.replace(DRAFT, max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len=64 is shorter than the target's 128"):
        Generator(params, cfg, Tokenizer.byte_level(), draft=(None, short))


def test_speculative_samples_follow_the_target_distribution(tiny_run):
    """A chi-square test, as for the samplers: 3000 seeded two-token samples with n-gram drafts (the
    second token is the first one a draft is checked for); its frequencies against the exact marginal
    sum_a p(a) p(b | a), computed with the model's forward pass over every first token."""
    from jaxgen.inference.loading import load_model

    cfg, tok, params = load_model(tiny_run)
    prompt = tok.encode("import os\nimport os\nimport", special=False)
    n = 3000
    gen = Generator(params, cfg, tok, GeneratorConfig(max_batch=512, chunk_steps=2, spec_gate=False))
    configs = [SamplingConfig(temperature=1.0, max_new_tokens=2, ignore_eos=True, seed=i, num_speculative_tokens=2)
               for i in range(n)]  # fmt: skip
    before = dict(gen.speculation)
    second = np.array([c.tokens[1] for c in gen.generate([prompt] * n, configs)])
    assert gen.speculation["accepted"] > before["accepted"]  # drafts were checked and some kept

    v = cfg.vocab_size
    first = jax.nn.softmax(model.forward(params, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cfg=cfg)[0])
    tokens = jnp.asarray([[*prompt, a] for a in range(v)])
    logits, _ = model.forward(params, tokens, jnp.broadcast_to(jnp.arange(len(prompt) + 1), tokens.shape), cfg=cfg)
    expected = np.asarray(first[0, -1] @ jax.nn.softmax(logits[:, -1]), np.float64) * n  # (V,)
    observed = np.bincount(second, minlength=v).astype(np.float64)
    big = expected >= 5  # the rest in one bin
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3  # p = 0.001 (Wilson-Hilferty)
    assert df > 5 and chi2 <= critical, (chi2, critical, df)


def test_window_values_do_not_recompile():
    gen = _generator("llama")
    c = SamplingConfig(temperature=0.0, max_new_tokens=8, num_speculative_tokens=3)
    gen.generate(PROMPTS[:2], c)
    before = gen.compilations
    gen.generate(PROMPTS[:2], [dataclasses.replace(c, num_speculative_tokens=k) for k in (4, 1)])
    assert gen.compilations == before  # 1..4 share the window W = 4: per-row values are an array
    assert speculative.window([0, 0]) == 0 and speculative.window([1, 3]) == 4 and speculative.window([5]) == 8
    stats = gen.speculation_stats()
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["tokens_per_step"] >= 1


def test_ngram_drafts_copy_what_followed_the_latest_match():
    history = jnp.asarray(
        [[5, 6, 7, 8, 5, 6, 7, 1, 5, 6, -1, -1], [1, 2, 3, 4, 9, -1, -1, -1, -1, -1, -1, -1]], jnp.int32
    )
    drafts, real = speculative.ngram_drafts(history, jnp.asarray([10, 5], jnp.int32), 3)
    # row 0 ends "5 6": the latest earlier "5 6" is at 4-5, followed by 7 1 5
    assert drafts[0].tolist() == [7, 1, 5] and int(real[0]) == 3
    assert int(real[1]) == 0  # "9" never occurred before: no drafts
    drafts, real = speculative.ngram_drafts(history, jnp.asarray([9, 5], jnp.int32), 4)
    # row 0 ends "7 1 5"... "1 5" never before, "5" last at 4: 6 7 1 5 (up to what is known)
    assert drafts[0].tolist() == [6, 7, 1, 5] and int(real[0]) == 4


def test_bad_window_says_what_is_allowed():
    with pytest.raises(SamplingError, match=r"num_speculative_tokens=9 is not allowed: an integer in \[0, 8\]"):
        SamplingConfig(num_speculative_tokens=9)


def test_the_engine_speculates_with_plain_decodings_output_under_preemption():
    """The serving engine with n-gram drafts over its paged cache (a rejected draft's key needs no undo:
    keys sit at their position), continuous batching and a pool too small for every row, so sequences
    are preempted and recomputed: each output equals the Generator's plain decoding."""
    gen = _generator("llama")
    plain = _mixed(40, 32, 40)
    spec = [dataclasses.replace(c, num_speculative_tokens=k) for c, k in zip(plain, (8, 3, 0), strict=True)]
    llm = LLM(gen.params, cfg=gen.cfg, tokenizer=gen.tokenizer, slots=4, num_pages=9, chunk_steps=8, spec_gate=False)
    got = [c for out in llm.generate(PROMPTS * 2, spec * 2) for c in out.outputs]
    want = gen.generate(PROMPTS * 2, plain * 2)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    m = llm.engine.metrics()
    assert m["requests_preempted"] > 0 and m["spec_draft_tokens"] > 0, m
    assert llm.engine.pool.in_use() == 0


def test_the_engine_reports_acceptance_in_its_metrics(tiny_run):
    """The trained tiny run on repetitive code through the engine: drafts are kept, and /metrics (the
    engine's Prometheus registry) exports the acceptance rate and tokens per target step."""
    from prometheus_client import generate_latest

    llm = LLM(tiny_run, slots=2, num_pages=32, chunk_steps=16, spec_gate=False)
    prompts = ["    x = 1\n    x = 1\n    x = 1\n", "import os\nimport os\nimport"]
    plain = SamplingConfig(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    want = llm.generate(prompts, plain)
    got = llm.generate(prompts, dataclasses.replace(plain, num_speculative_tokens=4))
    for a, b in zip(got, want, strict=True):
        _same(a.outputs[0], b.outputs[0])
    m = llm.engine.metrics()
    assert m["spec_accepted_tokens"] > 0 and m["spec_tokens_per_step"] > 1.0, m
    text = generate_latest(llm.engine.stats.registry).decode()
    assert f"jaxgen_spec_acceptance_rate {m['spec_acceptance_rate']}" in text
    assert "jaxgen_spec_tokens_per_step" in text and "jaxgen_spec_accepted_tokens_total" in text


def test_the_engine_with_a_draft_model_gives_plain_decodings_output_under_preemption():
    """The serving engine with a random draft model (its own page pool on the target's page tables):
    continuous batching, prefix-cache hits and a pool too small for every row, so sequences are
    preempted and recomputed, draft pages included; each output equals the Generator's plain decoding."""
    gen = _generator("llama")
    draft = (model.init_params(DRAFT, jax.random.key(2)), DRAFT)
    plain = _mixed(40, 32, 40)
    spec = [dataclasses.replace(c, num_speculative_tokens=k) for c, k in zip(plain, (8, 3, 0), strict=True)]
    llm = LLM(
        gen.params,
        cfg=gen.cfg,
        tokenizer=gen.tokenizer,
        draft=draft,
        slots=4,
        num_pages=9,
        chunk_steps=8,
        spec_gate=False,
    )
    got = [c for out in llm.generate(PROMPTS * 2, spec * 2) for c in out.outputs]
    want = gen.generate(PROMPTS * 2, plain * 2)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    m = llm.engine.metrics()
    assert m["requests_preempted"] > 0 and m["prefix_cache_hit_tokens"] > 0 and m["spec_draft_tokens"] > 0, m
    assert llm.engine.pool.in_use() == 0


def test_the_engine_with_the_target_as_its_draft_keeps_every_greedy_draft():
    """The draft pool stays in step with the target's pages: drafting with the target itself, greedy
    drafts are kept (but where a row ends) after a preemption and on prefix pages that an earlier,
    non-speculating request filled (the draft model prefills every sequence)."""
    gen = _generator("gpt2")
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    llm = LLM(gen.params, cfg=gen.cfg, tokenizer=gen.tokenizer, draft=(gen.params, gen.cfg), slots=3, num_pages=14,
              chunk_steps=8, overlap=False, spec_gate=False)  # fmt: skip  # no lag: its reserve lets the pool preempt
    want = [o.outputs[0].tokens for o in llm.generate(PROMPTS, greedy)]  # plain: fills the prefix cache
    assert want == [c.tokens for c in gen.generate(PROMPTS, greedy)]
    k = 4
    got = llm.generate(PROMPTS, dataclasses.replace(greedy, num_speculative_tokens=k))
    assert [o.outputs[0].tokens for o in got] == want
    m = llm.engine.metrics()
    assert m["prefix_cache_hit_tokens"] > 0 and m["requests_preempted"] > 0, m
    assert m["spec_accepted_tokens"] >= m["spec_draft_tokens"] - (1 + m["requests_preempted"]) * len(PROMPTS) * k, m
    assert m["spec_tokens_per_step"] > k / 2, m


def test_a_draft_model_from_a_folder_must_share_the_tokenizer(tiny_run):
    """LLM(run, draft=run) loads the draft from a folder (serve.draft); another tokenizer is refused
    with the count of tokens that differ, and a shorter context by the engine's check."""
    from jaxgen.inference.loading import load_draft
    from jaxgen.tokenizer import train_bpe

    llm = LLM(tiny_run, draft=tiny_run, slots=2, num_pages=32)
    assert llm.serve.draft == str(tiny_run) and llm.engine.draft_cfg == llm.cfg
    c = SamplingConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    want = llm.generate("import os\nimport", c)[0].outputs[0].tokens
    got = llm.generate("import os\nimport", dataclasses.replace(c, num_speculative_tokens=4))[0].outputs[0]
    assert got.tokens == want and llm.engine.metrics()["spec_accepted_tokens"] > 0
    other = train_bpe(["def f(x):\n    return x\n"] * 20, 300)
    with pytest.raises(ValueError, match=r"has another tokenizer than the target's \(\d+ tokens differ"):
        load_draft(tiny_run, other)
    short = dataclasses.replace(llm.cfg, max_seq_len=llm.cfg.max_seq_len // 2)
    with pytest.raises(ValueError, match=r"the draft model's max_seq_len=.* is shorter than the target's"):
        LLM(llm.params, cfg=llm.cfg, tokenizer=llm.tokenizer, draft=(llm.params, short), num_pages=8)


def test_the_gate_speculates_while_it_pays_and_probes_the_other_side():
    """spec_gate's rule on given figures: speculation first, then plain once, then whichever is faster
    (speculation on ties within KEEP), the other side once every PROBE_EVERY chunks; per batch bucket."""
    from jaxgen.inference import spec_gate

    gate = spec_gate.SpecGate()
    assert gate.choose(3)  # nothing measured at 4 rows: speculate
    gate.observe(3, True, tokens=400, seconds=1.0)
    assert not gate.choose(4)  # plain measured next
    gate.observe(4, False, tokens=1000, seconds=1.0)
    picks = [gate.choose(4) for _ in range(2 * spec_gate.PROBE_EVERY)]
    assert picks.count(True) == 2 and gate.skipped == 1 + picks.count(False)  # probes only: 400 < 0.95 x 1000
    assert gate.choose(1)  # another batch size has figures of its own
    gate.observe(1, True, tokens=960, seconds=1.0)
    gate.choose(1)
    gate.observe(1, False, tokens=1000, seconds=1.0)
    assert spec_gate.pays(960, 1000) and gate.choose(1)  # within KEEP: speculation stays on
    assert spec_gate.bucket(5) == 8 and spec_gate.bucket(1) == 1


def test_a_generators_group_runs_plainly_where_its_gate_says_speculation_does_not_pay():
    """The Generator's gate learns plain decoding's rate from plain requests' chunks; a group that asks for
    drafts where speculation measured slower runs the plain requests' programs from its prefill on: nothing
    compiles, nothing speculates, and the output is plain decoding's."""
    from jaxgen.inference import spec_gate

    gen = _generator("llama")
    gated = Generator(gen.params, gen.cfg, gen.tokenizer, dataclasses.replace(gen.config, spec_gate=True))
    plain = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    want = gated.generate(PROMPTS[:2], plain)  # compiles
    gated.generate(PROMPTS[:2], plain)
    rates = gated.gate.rates[spec_gate.bucket(2)]
    assert rates.plain is not None and rates.spec is None, rates  # plain's figure, from plain requests
    rates.spec = rates.plain / 10  # as if a speculating group had measured ten times slower
    compiled = gated.compilations
    got = gated.generate(PROMPTS[:2], dataclasses.replace(plain, num_speculative_tokens=4))
    assert gated.compilations == compiled and gated.speculation["target_steps"] == 0
    assert gated.gate.skipped == 1
    for a, b in zip(got, want, strict=True):
        _same(a, b)


def test_chunks_the_gate_runs_plain_keep_the_output_and_the_ngram_history():
    """An engine whose gate alternates speculative and plain chunks: the output is plain decoding's, and
    the n-gram history takes the plain chunks' tokens (drafts found after them are kept)."""
    from jaxgen.inference import spec_gate

    class Alternating(spec_gate.SpecGate):
        def choose(self, rows):
            speculate = self.skipped * 2 == sum(r.chunks for r in self.rates.values())
            self.rates.setdefault(0, spec_gate._Rates()).chunks += 1
            self.skipped += not speculate
            return speculate

    gen = _generator("llama")
    plain = SamplingConfig(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    llm = LLM(gen.params, cfg=gen.cfg, tokenizer=gen.tokenizer, slots=2, num_pages=32, chunk_steps=4, overlap=False)
    llm.engine.runner.gate = Alternating()
    prompts = PROMPTS[:2]
    want = gen.generate(prompts, plain)
    got = llm.generate(prompts, dataclasses.replace(plain, num_speculative_tokens=4))
    for a, b in zip(got, want, strict=True):
        _same(a.outputs[0], b)
    m = llm.engine.metrics()
    assert llm.engine.runner.gate.skipped > 0 and m["spec_accepted_tokens"] > 0, m


# --- the standard rule: exact in distribution ------------------------------------------------------------

SMALL = ModelConfig(vocab_size=16, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32)


def _sharpened(tree, factor: float):
    return jax.tree.map(lambda p: p * factor if p.ndim > 1 else p, tree)


def _reference(params, prompt: list[int], temperature: float, top_k: int):
    """Plain sampling's exact distributions from full forward passes (numpy truncation, not jaxgen's):
    token 0's (V,), token 1's after each token 0 (V, V), token 2's after each pair (V, V, V)."""
    v = SMALL.vocab_size
    forward = jax.jit(lambda x: model.forward(params, x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape),
                                              cfg=SMALL)[0][:, -1])  # fmt: skip

    def next_probs(seqs):
        logits = np.asarray(forward(jnp.asarray(seqs)), np.float64) / temperature
        if top_k:
            logits = np.where(logits >= np.sort(logits, -1)[:, -top_k][:, None], logits, -np.inf)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1 = next_probs([[*prompt, a] for a in range(v)])
    p2 = next_probs([[*prompt, a, b] for a in range(v) for b in range(v)]).reshape(v, v, v)
    return next_probs([prompt])[0], p1, p2


def _chi_square_p(observed, expected_p) -> float:
    """Pearson's test of draws (ints) against probabilities; cells expected under 5 draws pooled."""
    from scipy import stats

    counts = np.bincount(observed, minlength=len(expected_p))
    e = expected_p * len(observed)
    small = e < 5
    o, e = np.append(counts[~small], counts[small].sum()), np.append(e[~small], e[small].sum())
    return float(stats.chi2.sf(((o - e) ** 2 / np.maximum(e, 1e-12)).sum(), len(o) - 1))


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_the_standard_rule_is_exact_in_distribution(drafter):
    """spec_rule="standard" (drafts drawn from the drafter's q, kept with probability min(1, p/q), the
    residual max(0, p - q) after a rejection): 3000 samples of three tokens pass a chi-square test
    against plain sampling's exact distribution (tokens 0 and 1 jointly, token 2's marginal) while many
    drafts are kept and many rejected; greedy rows stay token for token. (Drawing from p instead of the
    residual after a rejection fails them with p < 1e-10.)"""
    from jaxgen.model import eagle

    params = _sharpened(model.init_params(SMALL, jax.random.key(0)), 3.0)  # peaked: p and q differ
    if drafter == "head":
        head = eagle.new_head(SMALL, jax.random.key(1))
        draft, temperature, top_k = head.replace(params=_sharpened(head.params, 4.0)), 1.0, 0
    else:
        draft, temperature, top_k = (params, SMALL), 0.7, 6  # greedy point masses: kept with probability p(d)
    gen = Generator(params, SMALL, Tokenizer.byte_level(), max_batch=256, draft=draft, spec_rule="standard")
    prompt, n = [3, 1, 4, 1, 5], 3000
    settings = [SamplingConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, seed=i, ignore_eos=True,
                               num_speculative_tokens=2) for i in range(n)]  # fmt: skip
    settings += [dataclasses.replace(settings[0], temperature=0.0)] * 4  # greedy rows in the same batches
    # and sampled rows without drafts: plain decoding's tokens (their draws take its keys)
    settings += [dataclasses.replace(settings[0], seed=5 + i, num_speculative_tokens=0) for i in range(4)]
    got = np.asarray([c.tokens for c in gen.generate([prompt] * len(settings), settings)])
    stats = gen.speculation_stats()
    assert min(stats["accepted"], stats["proposed"] - stats["accepted"]) > 400, stats  # both paths ran often

    p0, p1, p2 = _reference(params, prompt, temperature, top_k)
    joint01 = p0[:, None] * p1
    sampled, v = got[:n], SMALL.vocab_size
    for observed, expected in (
        (sampled[:, 0], p0),
        (sampled[:, 0] * v + sampled[:, 1], joint01.ravel()),
        (sampled[:, 2], (joint01[:, :, None] * p2).sum((0, 1))),
    ):
        assert _chi_square_p(observed, expected) > 1e-3
    t0 = int(np.argmax(p0))
    t1 = int(np.argmax(p1[t0]))
    assert got[n : n + 4].tolist() == [[t0, t1, int(np.argmax(p2[t0, t1]))]] * 4  # greedy: token for token
    plain = [c.tokens for c in gen.generate([prompt] * 4, settings[n + 4 :])]  # no row drafts: the plain loop
    assert got[n + 4 :].tolist() == plain


def test_the_engines_standard_rule_samples_as_the_generators_under_preemption():
    """serve.spec_rule="standard": a random draft model's drafts over the engine's paged cache, continuous
    batching and a pool too small for every row, so sequences are preempted, some with a residual draw pending,
    and recomputed (with a decode chunk in flight, and without), and again with the engine put to sleep mid-run:
    each output equals the Generator's under the same rule token for token (the same keys for the drafts' tests
    and the residual draws; the rule is exact in distribution by the chi-square test above). Without the kept
    residual (or with the one a chunk in flight left) the outputs differ. New weights drop what is kept."""
    gen = _generator("llama")
    draft = (model.init_params(DRAFT, jax.random.key(2)), DRAFT)
    config = dataclasses.replace(gen.config, spec_rule="standard")
    standard = Generator(gen.params, gen.cfg, gen.tokenizer, config, draft=draft)
    settings = [dataclasses.replace(c, num_speculative_tokens=4) for c in _mixed(40, 32, 40)] * 2
    want = standard.generate(PROMPTS * 2, settings)
    for overlap, chunk_steps in ((False, 8), (True, 2)):  # (with overlap, short chunks: preempted after tokens)
        llm = LLM(gen.params, cfg=gen.cfg, tokenizer=gen.tokenizer, draft=draft, slots=4, num_pages=9,
                  chunk_steps=chunk_steps, spec_rule="standard", overlap=overlap)  # fmt: skip
        runner = llm.engine.runner
        kept, keep = [], runner.keep_residuals

        def spy(preempted, keep=keep, kept=kept):
            keep(preempted)
            kept.extend(r.residual is not None for r, _ in preempted)

        runner.keep_residuals = spy
        got = [c for out in llm.generate(PROMPTS * 2, settings) for c in out.outputs]
        for a, b in zip(got, want, strict=True):
            _same(a, b)
        m = llm.engine.metrics()
        assert m["requests_preempted"] > 0 and any(kept), (m, kept)  # a residual draw was pending at one
        assert m["spec_accepted_tokens"] < m["spec_draft_tokens"], m  # drafts were rejected: residual draws ran
        # asleep mid-run (every sequence preempted, the page pool freed) and woken: the same output again
        engine, kept[:] = llm.engine, []
        requests = [
            r for i, (p, c) in enumerate(zip(PROMPTS * 2, settings)) for r in engine.submit(p, c, prompt_index=i)
        ]
        for _ in range(3):
            engine.step()
        engine.sleep()
        engine.wake_up()
        engine.run_until_idle()
        for r, b in zip(requests, want, strict=True):
            _same(r.result(), b)
        assert any(kept), kept
        assert engine.pool.in_use() == 0
    # new weights mid-run: no residual of the old model's drafts is kept (the sequences go on with the new one's)
    requests = [r for i, (p, c) in enumerate(zip(PROMPTS * 2, settings)) for r in engine.submit(p, c, prompt_index=i)]
    for _ in range(3):
        engine.step()
    engine.sleep()  # (as above: the preempted sequences keep their pending residuals, and wait)
    engine.wake_up()
    assert any(r.residual is not None for r in requests)
    engine.update_params(gen.params)
    assert all(r.residual is None for r in requests), [r.residual is not None for r in requests]
    engine.run_until_idle()
    assert all(r.result().finish_reason in ("stop", "length") for r in requests)


def test_the_engines_standard_rule_with_an_eagle_head_samples_as_the_generators():
    """An EAGLE head's drafts drawn from its own distribution (the standard rule's q, not a point mass), in the
    engine's paged head cache and the Generator's contiguous one: the same tokens, row for row."""
    from jaxgen.model import eagle

    params = _sharpened(model.init_params(SMALL, jax.random.key(0)), 3.0)
    head = eagle.new_head(SMALL, jax.random.key(1))
    head = head.replace(params=_sharpened(head.params, 4.0))
    settings = [SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=k, seed=i, ignore_eos=True,
                               num_speculative_tokens=4) for i, k in enumerate([0, 6] * 4)]  # fmt: skip
    prompts = [[3, 1, 4, 1, 5]] * len(settings)
    gen = Generator(params, SMALL, Tokenizer.byte_level(), max_batch=8, draft=head, spec_rule="standard")
    want = [c.tokens for c in gen.generate(prompts, settings)]
    llm = LLM(params, cfg=SMALL, tokenizer=Tokenizer.byte_level(), draft=head, slots=8, num_pages=40, page_size=4,
              spec_rule="standard")  # fmt: skip
    assert [o.outputs[0].tokens for o in llm.generate(prompts, settings)] == want
    m = llm.engine.metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"], m


def test_a_spec_rule_that_does_not_exist_is_refused():
    with pytest.raises(SamplingError, match=r"spec_rule='exactly' is not allowed: 'exact', 'standard'"):
        GeneratorConfig(spec_rule="exactly")
