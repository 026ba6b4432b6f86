"""int8 inference: weights (per output channel) and the KV cache (per token and kv head), against float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingConfig, model
from jaxgen.config import ConfigError, ModelConfig, ServeConfig
from jaxgen.inference import loading as checkpoint
from jaxgen.inference.generator import Generator, GeneratorConfig
from jaxgen.model import nf4, quant
from jaxgen.model.paged import page_bytes
from jaxgen.model.storage import dequantize_kv, quantize_kv
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(
    vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=128,
    mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False,
)  # fmt: skip
HELD_OUT = (
    "Decode is bound by memory traffic: each step reads every weight to produce one token per row. "
    "The two standard ways to get more tokens out of the same bytes are to verify several guessed tokens "
    "per target step and to read fewer bytes."
)


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.key(0))


def test_weights_quantize_per_output_channel(params):
    qp = quant.quantize_params(params)
    layer = qp["layers"]
    assert quant.is_q(layer["w_q_dnh"]) and layer["w_q_dnh"].scale.shape == (2, 1, 4, 16)  # (L, 1, N, H)
    assert layer["w_o_nhd"].scale.shape == (2, 1, 1, 64)  # contracted N and H
    assert layer["mlp"]["w_down_fd"].scale.shape == (2, 1, 64)
    assert not quant.is_q(qp["embed_vd"]) and not quant.is_q(qp["head_dv"])  # excluded by default
    assert not quant.is_q(layer["attn_norm"]["scale_d"])
    with_embedding = quant.quantize_params(params, embedding=True)
    assert with_embedding["embed_vd"].scale.shape == (257, 1) and with_embedding["head_dv"].scale.shape == (1, 257)
    w, q = np.asarray(params["layers"]["w_q_dnh"]), layer["w_q_dnh"]
    # symmetric rounding: every weight within half a step of its channel's scale, the largest exact
    assert np.all(np.abs(np.asarray(q.dequantize()) - w) <= np.asarray(q.scale) / 2 + 1e-7)
    assert int(jnp.max(jnp.abs(q.q))) == 127
    assert quant.weight_bytes(with_embedding) < 0.3 * quant.weight_bytes(params)
    assert quant.quantize_params(qp) is not qp and quant.is_q(quant.quantize_params(qp)["layers"]["w_q_dnh"])


@pytest.mark.parametrize("embedding", [False, True])
def test_int8_weights_forward_close_to_float32(params, embedding):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 257, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    want, _ = model.forward(params, tokens, positions, None, cfg=CFG)
    got, _ = model.forward(quant.quantize_params(params, embedding), tokens, positions, None, cfg=CFG)
    err = float(jnp.max(jnp.abs(got - want)))
    assert 0 < err < 0.03 * float(jnp.max(jnp.abs(want)))  # int8 rounding shows, but only just


def test_kv_quantization_per_token_and_head():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 2, 16)), jnp.float32)
    q, scale = quantize_kv(x)
    assert q.dtype == jnp.int8 and scale.shape == (3, 5, 2)
    np.testing.assert_allclose(scale, np.abs(np.asarray(x)).max(-1) / 127, rtol=1e-6)
    assert np.all(np.abs(np.asarray(dequantize_kv(q, scale) - x)) <= np.asarray(scale)[..., None] / 2 + 1e-7)
    # an int8 page holds 64 values and a float32 scale per token and head: ~2x the tokens of bfloat16
    big = ModelConfig(d_model=512, num_heads=8)
    assert 1.8 < page_bytes(big, 16, "bfloat16") / page_bytes(big, 16, "int8") < 2.0
    from jaxgen.model.kvcache import KVCache
    from jaxgen.model.paged import PagedCache

    contiguous = KVCache.init(CFG, 2, 16, "int8")  # one buffer per layer and block
    paged = PagedCache.init(CFG, 4, 16, 2, 2, "int8")
    for k, v, k_scale, v_scale in [
        *zip(*(jax.tree.leaves(x) for x in (contiguous.k, contiguous.v, contiguous.k_scale, contiguous.v_scale))),
        (paged.k, paged.v, paged.k_scale, paged.v_scale),
    ]:  # (contiguous keys are stored (B, K, H, S / N): the scales follow the values' (B, K, S / N))
        assert k.dtype == v.dtype == jnp.int8 and k_scale.shape == v_scale.shape == v.shape[:-1]
        assert k_scale is not v_scale  # two buffers: a donated step must not get one twice


def test_int8_kv_cache_decode_close_to_float_and_engine_equals_generator(params):
    """Greedy decode with an int8 cache: logprobs near the float cache's; the engine (paged int8) and the
    Generator (contiguous int8) quantize the same keys the same way, so they pick the same tokens."""
    tok = Tokenizer.byte_level()
    prompts = ["int8 keys", "and values, ragged"]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=10)
    ref = Generator(params, CFG, tok, GeneratorConfig()).generate(prompts, greedy)
    gen = Generator(params, CFG, tok, GeneratorConfig(cache_dtype="int8")).generate(prompts, greedy)
    for a, b in zip(gen, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), len(a.tokens))
        assert n >= 1  # the first token comes from the prefill's last position, over int8 keys already
        np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=0.05)
    llm = LLM(params, cfg=CFG, tokenizer=tok, slots=2, num_pages=16, cache_dtype="int8")
    for out, g in zip(llm.generate(prompts, greedy), gen, strict=True):
        assert out.outputs[0].tokens == g.tokens
        np.testing.assert_allclose(out.outputs[0].logprobs, g.logprobs, atol=1e-4)
    assert llm.engine.state.cache.k.dtype == jnp.int8 and llm.engine.state.cache.k_scale.dtype == jnp.float32


def test_int8_held_out_perplexity_within_one_percent(tiny_run):
    """The trained tiny run: held-out perplexity with int8 weights, and with an int8 KV cache, within 1%."""
    cfg, tok, params = checkpoint.load_model(tiny_run)
    prompt, rest = HELD_OUT[:30], HELD_OUT[30:110]  # within the tiny model's 128-token context

    def perplexity(p, cache_dtype="float32"):  # the continuation reads the prompt's cache, then its own keys
        (r,) = Generator(p, cfg, tok, GeneratorConfig(cache_dtype=cache_dtype)).score_shared([prompt], [rest])
        return r["perplexity"]

    base = perplexity(params)
    _, _, q8 = checkpoint.load_model(tiny_run, quantize="int8")
    weights, kv = perplexity(q8), perplexity(params, "int8")
    assert weights != base and kv != base  # both paths really ran quantized
    assert abs(weights / base - 1) < 0.01 and abs(kv / base - 1) < 0.01, (base, weights, kv)


def test_int8_settings_are_checked_and_export_refuses_int8(params, tmp_path):
    with pytest.raises(ConfigError, match=r"serve\.quantize='int4' is not allowed"):
        ServeConfig(quantize="int4")
    with pytest.raises(ConfigError, match=r"serve\.cache_dtype='int4'"):
        ServeConfig(cache_dtype="int4")
    with pytest.raises(ValueError, match="quantize='fp8' is not allowed"):
        checkpoint.load_model(tmp_path, quantize="fp8")
    from jaxgen.hf.export import save_pretrained

    with pytest.raises(ValueError, match="int8 weights"):
        save_pretrained(tmp_path / "hf", quant.quantize_params(params), CFG)
    assert dataclasses.replace(ServeConfig(), quantize="int8").quantize == "int8"


def test_int8_engine_on_a_data_and_tensor_mesh_equals_one_device(params):
    """int8 weights placed by the model's shardings (tensor-parallel int8 products) and int8 pages split
    by kv head: the same tokens as one device."""
    from jaxgen.config import MeshConfig
    from jaxgen.inference.engine import Engine
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
    placed = quant.quantize_params(jax.device_put(params, model.param_shardings(CFG, mesh)))
    # stored (L, N * H, D) output-major: the heads still split, as the float weight's
    assert placed["layers"]["w_q_dnh"].q.sharding.spec[1] == "tensor"
    serve = ServeConfig(slots=4, num_pages=32, cache_dtype="int8")
    prompts = ["one device", "or four", "the same"]
    greedy, sampled = (
        SamplingConfig(temperature=0.0, max_new_tokens=8),
        SamplingConfig(temperature=0.8, seed=3, max_new_tokens=8),
    )
    configs = [greedy, sampled, greedy]
    a = Engine(placed, CFG, Tokenizer.byte_level(), serve, mesh=mesh).generate(prompts, configs)
    b = Engine(quant.quantize_params(params), CFG, Tokenizer.byte_level(), serve).generate(prompts, configs)
    assert [x.tokens for x in a] == [x.tokens for x in b]


def _nf4_reference(w_oi: np.ndarray):
    """(packed bytes, absmax) of w (..., O, I) by the NF4 rule written plainly in numpy: zero-pad I to a
    multiple of 64, blocks of 64 along I, each value / its block's absmax to the nearest code (the lower
    on a tie: argmin takes the first), two codes a byte, the first in the high nibble."""
    pad = -w_oi.shape[-1] % 64
    w = np.pad(w_oi.astype(np.float64), [(0, 0)] * (w_oi.ndim - 1) + [(0, pad)])
    blocks = w.reshape(*w.shape[:-1], -1, 64)
    absmax = np.abs(blocks).max(-1)
    scaled = blocks / np.where(absmax > 0, absmax, 1.0)[..., None]
    codes = np.abs(scaled[..., None] - nf4.CODE.astype(np.float64)).argmin(-1).reshape(*w.shape[:-1], -1, 2)
    return (codes[..., 0] * 16 + codes[..., 1]).astype(np.uint8), absmax.astype(np.float32)


def test_nf4_follows_the_code_book_and_block_rule(params):
    """NF4 (model.lora.base_dtype=nf4): known values give known codes and absmax; random weights the bytes
    and scales of a plain numpy reference; the round trip within half the widest code gap times absmax."""
    codes = np.random.default_rng(1).permutation(np.tile(np.arange(16), 4))  # one block of 64
    packed, absmax = nf4.quantize_matrix(3.0 * nf4.CODE[codes][None])  # every code exactly, absmax 3
    assert np.asarray(absmax).tolist() == [[3.0]] and packed.dtype == jnp.uint8
    assert np.asarray(packed)[0].tolist() == (codes[0::2] * 16 + codes[1::2]).tolist()
    ties = np.concatenate([nf4.MIDPOINTS, [1.0], np.zeros(48, np.float32)])  # a value on a midpoint: the lower
    tie_bytes = np.asarray(nf4.quantize_matrix(ties[None])[0])[0, :8]  # codes 0, 1, ..., 14 and 15 (the 1.0)
    assert (tie_bytes >> 4).tolist() == list(range(0, 16, 2)) and (tie_bytes & 15).tolist() == list(range(1, 16, 2))

    w = np.asarray(params["layers"]["w_o_nhd"])  # (L, N, H, D): input N x H = 64, output D
    odd = np.random.default_rng(2).normal(size=(3, 100, 5)).astype(np.float32)  # I = 100: padded to 128
    for weight, lead, n_in in ((w, 1, 2), (odd, 1, 1)):
        q = nf4.quantize(weight, lead, n_in)
        w_oi = weight.reshape(weight.shape[0], -1, weight.shape[-1]).swapaxes(-1, -2)  # (L, O, I)
        want_packed, want_absmax = _nf4_reference(w_oi)
        np.testing.assert_array_equal(np.asarray(q.packed), want_packed)
        np.testing.assert_array_equal(np.asarray(q.absmax), want_absmax)
        back = np.asarray(q.dequantize())
        assert back.shape == weight.shape == q.shape
        half_gap = np.diff(nf4.CODE).max() / 2  # 0.139: between 0.723 and 1
        bound = np.repeat(np.asarray(q.absmax), 64, axis=-1)[..., : w_oi.shape[-1]] * half_gap
        back_oi = back.reshape(w_oi.shape[0], -1, w_oi.shape[1]).swapaxes(-1, -2)
        assert np.all(np.abs(back_oi - w_oi) <= bound * (1 + 1e-6))

    qp = quant.frozen_base(params, "nf4")
    assert quant.is_q(qp["layers"]["mlp"]["w_down_fd"]) and qp["embed_vd"].dtype == jnp.bfloat16
    matrices = sum(x.size for k, x in params["layers"].items() if k.startswith("w_"))
    matrices += sum(x.size for x in params["layers"]["mlp"].values())
    nf4_bytes = quant.weight_bytes({k: qp["layers"][k] for k in params["layers"] if k.startswith("w_")})
    nf4_bytes += quant.weight_bytes(qp["layers"]["mlp"])
    assert nf4_bytes == matrices * (0.5 + 4 / 64)  # half a byte a value, a float32 absmax per 64


def test_nf4_keeps_the_float_weights_shardings(params):
    """Packed bytes and scales are split like the float weight's output and input axes (tensor parallel)."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
    placed = quant.frozen_base(jax.device_put(params, model.param_shardings(CFG, mesh)), "nf4")
    q, o = placed["layers"]["w_q_dnh"], placed["layers"]["w_o_nhd"]  # (L, N * H, D / 2): the heads split
    assert q.packed.sharding.spec[1] == q.absmax.sharding.spec[1] == "tensor"
    assert o.packed.sharding.spec[2] == "tensor"  # (L, D, N * H / 2): the input split as the heads are
    assert o.absmax.sharding.spec[2] is None and o.absmax.shape[2] == 1  # one block of 64: it cannot split


@pytest.mark.parametrize("experts", [0, 4])
def test_nf4_forward_is_the_dequantized_weights_and_near_float32(params, experts):
    """The NF4 base's forward (dequantized inside each product; MoE experts expanded) equals the forward of
    its dequantized weights, and stays near the float32 model's: 4-bit rounding shows, bounded."""
    cfg = dataclasses.replace(CFG, num_experts=experts)
    weights = params if not experts else model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 257, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    forward = jax.jit(lambda p: model.forward(p, tokens, positions, None, cfg=cfg)[0])
    base = quant.frozen_base(weights, "nf4")
    expanded = jax.tree.map(lambda w: w.dequantize() if nf4.is_nf4(w) else w, base, is_leaf=nf4.is_nf4)
    want, got = np.asarray(forward(weights)), np.asarray(forward(base))
    np.testing.assert_allclose(got, np.asarray(forward(expanded)), atol=1e-5 * np.abs(want).max(), rtol=0)
    if experts:  # experts are expanded before their products: plain autodiff, nothing more to check
        return
    # the backward through the products (nf4's custom VJP: x's gradient through the dequantized weight)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=want.shape), jnp.float32)
    embed = base["embed_vd"].astype(jnp.float32)
    grad = jax.jit(jax.grad(lambda e, p: jnp.sum(forward(p | {"embed_vd": e}) * probe)))
    g_nf4, g_expanded = np.asarray(grad(embed, base)), np.asarray(grad(embed, expanded))
    np.testing.assert_allclose(g_nf4, g_expanded, atol=1e-5 * np.abs(g_expanded).max(), rtol=0)
    # measured 0.062 (dense) and 0.064 (experts) of the largest logit: NF4's 16 levels leave these Gaussian
    # weights 9% RMS off (int8's rounding: 0.6%, and its logits move 0.6%); the bfloat16 rest adds 0.25%
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0.01 < err < 0.1
