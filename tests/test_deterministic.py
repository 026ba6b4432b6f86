"""Deterministic mode (`ModelConfig.deterministic`): the engine's log-probabilities equal the training
forward's bitwise, and a request's tokens do not depend on what else runs.

One tiny float32 model, one engine with a small page pool (a busy batch preempts) and small prefill chunks
(long prompts prefill in several chunks), as tests/test_rl_engine.py's parity test; there the two agree
to ~1e-6, here to the bit. The same engine without the flag shows the comparison can fail."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ConfigError, MeshConfig, ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.rl.objectives import token_logprobs
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer

# post-norms (OLMo 2) and a final softcap (Gemma 2): each broke the bits once (see docs/rl.md)
CFG = ModelConfig(
    vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128,
    norm_placement="post", qk_norm="head", final_softcap=30.0, attention_block=8, deterministic=True,
)  # fmt: skip
# 8 slots: without the flag the engine lays its weights out output-major (model.decode_params)
SERVE = ServeConfig(slots=8, page_size=8, num_pages=26, chunk_steps=4, prefill_chunk=32)
T = 128  # the reference forward's padded length (one compiled shape)
PROMPT_LENS = (5, 23, 40, 61)  # ragged; 40 and 61 prefill in two chunks of at most 32
TEMPS = (0.7, 1.0, 0.85, 1.0)


@pytest.fixture(scope="module")
def params():
    p = model.init_params(CFG, jax.random.key(1))
    return jax.tree.map(lambda w: w * 5.0 if w.ndim > 1 else w, p)  # logits within about +-4


@pytest.fixture(scope="module")
def engine(params):
    return Engine(params, CFG, Tokenizer.byte_level(), SERVE)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, k).tolist() for k in PROMPT_LENS]


@functools.partial(jax.jit, static_argnames="cfg")
def _logprobs(params, tokens, positions, temperature, cfg):
    return token_logprobs(params, tokens, positions, cfg=cfg, temperature=temperature)[0]


def _engine_and_training(engine, params, cfg) -> tuple[np.ndarray, np.ndarray, int]:
    """The processed log-probabilities of a ragged, preempting, chunk-prefilled batch of 12 sequences as
    the engine reported them and as the training forward recomputes them (flat, in the same order), and
    the preemptions it took."""
    requests = []
    for i, (p, t) in enumerate(zip(_prompts(3), TEMPS, strict=True)):
        sc = SamplingConfig(max_new_tokens=40, temperature=t, n=3, seed=i, logprobs_mode="processed")
        requests += engine.submit(p, sc, prompt_index=i)
    preempted = engine.metrics()["requests_preempted"]
    engine.run_until_idle()
    ours, ref = [], []
    for t in sorted(set(TEMPS)):
        rows = [r for r in requests if TEMPS[r.prompt_index] == t]
        tokens = np.zeros((len(rows), T), np.int32)
        positions = np.full((len(rows), T), -1, np.int32)
        for i, r in enumerate(rows):
            seq = r.prompt + r.result().tokens
            tokens[i, : len(seq)], positions[i, : len(seq)] = seq, np.arange(len(seq))
        lp = np.asarray(_logprobs(params, tokens, positions, np.float32(t), cfg=cfg))
        for r, row in zip(rows, lp, strict=True):
            n = len(r.tokens)
            assert n > 0
            ours.append(np.asarray(r.logprobs, np.float32))
            ref.append(row[len(r.prompt) - 1 : len(r.prompt) - 1 + n])
    return np.concatenate(ours), np.concatenate(ref), engine.metrics()["requests_preempted"] - preempted


def test_engine_logprobs_equal_the_training_forwards_bitwise(engine, params):
    ours, ref, preempted = _engine_and_training(engine, params, CFG)
    assert preempted > 0  # the small pool preempted some: they were recomputed on readmission
    assert ours.size > 300 and np.isfinite(ours).all()
    differ = int((ours != ref).sum())
    assert differ == 0, f"{differ} of {ours.size} differ, max {np.abs(ours - ref).max()}"


def test_in_bfloat16_with_a_bfloat16_pool_too(params):
    """A bfloat16 model (its float32 weights held in bfloat16, its pages bfloat16): the engine's log-probabilities
    equal the bfloat16 training forward's bitwise. (The same engine without the flag differed in all 433 of
    them, by up to 0.1, when this was written.)"""
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    engine = Engine(params, cfg, Tokenizer.byte_level(), dataclasses.replace(SERVE, cache_dtype="bfloat16"))
    ours, ref, preempted = _engine_and_training(engine, params, cfg)
    assert preempted > 0 and ours.size > 300 and np.isfinite(ours).all()
    differ = int((ours != ref).sum())
    assert differ == 0, f"{differ} of {ours.size} differ, max {np.abs(ours - ref).max()}"


def test_an_engine_on_a_data_parallel_mesh_keeps_the_bits_and_a_tensor_mesh_is_refused(params):
    """Rows split over two devices: each device's tiles are a one-device run's, so the engine's log-probabilities
    equal the one-device training forward's bitwise. On a tensor-parallel mesh a product's halves are summed
    in another order (348 of 393 differed by up to 3e-5 when this was written): refused before compiling."""
    mesh = make_mesh(MeshConfig(data=2), jax.devices()[:2])
    placed = jax.device_put(params, model.param_shardings(CFG, mesh))
    engine = Engine(placed, CFG, Tokenizer.byte_level(), SERVE, mesh=mesh)
    ours, ref, preempted = _engine_and_training(engine, params, CFG)
    assert preempted > 0 and ours.size > 300
    differ = int((ours != ref).sum())
    assert differ == 0, f"{differ} of {ours.size} differ, max {np.abs(ours - ref).max()}"
    tensor = make_mesh(MeshConfig(data=1, tensor=2), jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"mesh.tensor=2 is not allowed with model.deterministic=true: 1: data"):
        Engine(params, CFG, Tokenizer.byte_level(), SERVE, mesh=tensor)


def _alone_and_in_a_full_batch(one_slot, engine):
    """One request's completion on an engine of one slot, and on `engine` behind and beside others (another
    slot, other batch-mates, a decode step of 8 rows, its prompt's prefix cached)."""
    prompt = _prompts(5)[2]  # 40 tokens: two prefill chunks
    sc = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=11, logprobs_mode="processed")
    alone = one_slot.generate([prompt], sc)[0]
    others = [SamplingConfig(max_new_tokens=24, temperature=0.9, seed=i) for i in range(8)]
    batch = engine.generate([*_prompts(6), prompt, *_prompts(7)], [*others[:4], sc, *others[4:]])
    return alone, batch[4]


def test_a_rows_tokens_are_the_same_alone_and_in_a_full_batch(engine, params):
    one_slot = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, slots=1))
    alone, together = _alone_and_in_a_full_batch(one_slot, engine)
    assert together.tokens == alone.tokens and len(alone.tokens) == 24
    assert np.array_equal(np.asarray(together.logprobs), np.asarray(alone.logprobs))


def test_without_the_flag_neither_holds(params, capsys):
    cfg = dataclasses.replace(CFG, deterministic=False)
    engine = Engine(params, cfg, Tokenizer.byte_level(), SERVE)
    ours, ref, _ = _engine_and_training(engine, params, cfg)
    one_slot = Engine(params, cfg, Tokenizer.byte_level(), dataclasses.replace(SERVE, slots=1))
    alone, together = _alone_and_in_a_full_batch(one_slot, engine)
    a, b = np.asarray(alone.logprobs), np.asarray(together.logprobs)
    differ, n = int((ours != ref).sum()), min(a.size, b.size)
    with capsys.disabled():
        print(f"\ndeterministic=False: engine against training: {differ} of {ours.size} log-probabilities differ, "
              f"max {np.abs(ours - ref).max():.2e}; alone against a full batch: {int((a[:n] != b[:n]).sum())} of "
              f"{n}, max {np.abs(a[:n] - b[:n]).max():.2e}")  # fmt: skip
    assert differ > 0 and np.abs(ours - ref).max() < 1e-4  # close, not bitwise
    assert not np.array_equal(a, b)  # (the tokens drawn may well agree: the draws are keyed per request)


def test_settings_that_would_break_it_are_refused_before_compiling(params):
    with pytest.raises(ConfigError, match=r"model.num_experts"):
        dataclasses.replace(CFG, num_experts=4)
    with pytest.raises(ConfigError, match=r"model.attention_impl"):
        dataclasses.replace(CFG, attention_impl="dense")
    with pytest.raises(ConfigError, match=r"serve.page_size=12.*multiple of model.attention_block=8"):
        Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, page_size=12))
    with pytest.raises(ConfigError, match=r"serve.cache_dtype=bfloat16 .*model.dtype=float32"):
        Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, cache_dtype="bfloat16"))


def test_teacher_forced_scoring_reads_the_weights_as_trained(params):
    """`Generator.score` (what `LLM.score` runs) in deterministic mode: the weights stay in the training layout
    (`model.decode_params` with the config; before, the generator's output-major layout was refused by the
    tiled products) and the scores are the training forward's log-probabilities."""
    from jaxgen.inference.generator import Generator

    prompt, continuation = _prompts(5)[1], _prompts(6)[0]
    got = Generator(params, CFG, Tokenizer.byte_level(), max_batch=8).score([prompt], [continuation])[0]
    seq = prompt + continuation
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(seq)] = seq
    positions = np.where(np.arange(T) < len(seq), np.arange(T), -1)[None].astype(np.int32)
    want = np.asarray(_logprobs(params, tokens, positions, np.float32(1.0), cfg=CFG))[0]
    np.testing.assert_allclose(got["token_logprobs"], want[len(prompt) - 1 : len(seq) - 1], atol=1e-5)


# the test's model, and one with what it lacks: a sliding window (an int32 per layer through the custom VJPs),
# LayerNorm with biases, learned positions, a tied head, a GELU MLP
OTHER = dataclasses.replace(
    CFG, num_kv_heads=4, norm="layernorm", norm_placement="pre", qk_norm="none", position="learned", mlp="gelu",
    use_bias=True, tie_embeddings=True, sliding_window=16, final_softcap=None,
)  # fmt: skip


@pytest.mark.parametrize("cfg", [CFG, OTHER], ids=["post-norm-rope", "window-layernorm-learned"])
def test_the_gradient_is_the_plain_models_and_the_values_stay_tiled(cfg, params):
    """Training in deterministic mode differentiates the plain programs (`layers.tiled_values`): the
    log-probabilities inside `value_and_grad` are the tiled forward's to the bit, the gradient is the flag-off
    model's up to rounding (the two forwards differ by ~1e-6; the gradients by ~1e-4 of a leaf's largest at most)."""
    if cfg is not CFG:
        params = jax.tree.map(lambda w: w * 5.0 if w.ndim > 1 else w, model.init_params(cfg, jax.random.key(2)))
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 256, (3, 40)).astype(np.int32)
    positions = np.where(np.arange(40) < [[40], [33], [21]], np.arange(40), -1).astype(np.int32)

    def loss(p, cfg):
        logp = token_logprobs(p, tokens, positions, cfg=cfg, temperature=0.8)[0]
        return (logp * (positions[:, 1:] >= 0)).sum(), logp

    plain = dataclasses.replace(cfg, deterministic=False)
    (_, logp), grad = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=cfg), has_aux=True))(params)
    (_, plain_logp), plain_grad = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=plain), has_aux=True))(params)
    assert np.array_equal(logp, _logprobs(params, tokens, positions, np.float32(0.8), cfg=cfg))  # the tiled bits
    assert not np.array_equal(logp, plain_logp)  # (so the line above can fail)
    overall = max(float(np.abs(w).max()) for w in jax.tree.leaves(plain_grad))
    assert overall > 0
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grad), jax.tree.leaves(plain_grad), strict=True):
        # relative to the leaf, or to the whole gradient where a leaf's is zero but for rounding (a key bias);
        # the embedding's came to 1.03e-4 of it on an AMD EPYC (XLA:CPU's rounding follows the CPU it runs on)
        bound = 2e-4 * float(np.abs(want).max()) + 1e-6 * overall
        assert np.abs(np.asarray(g) - np.asarray(want)).max() <= bound, jax.tree_util.keystr(path)
