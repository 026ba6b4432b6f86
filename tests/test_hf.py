"""Hugging Face import and export, checked against transformers itself (PyTorch, CPU, float32).

For each family a small model is built by transformers from its config class, every weight drawn at
random (biases and norm scales too, so a mapping mistake cannot hide behind zeros or ones), and saved
with `save_pretrained`. jaxgen then has to reproduce its logits, greedy generations and loss.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxgen import hf
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

V = 257  # the byte-level tokenizer's vocabulary; its end-of-text id is 256
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
SMALL |= dict(max_position_embeddings=128, eos_token_id=256, bos_token_id=256, pad_token_id=0)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ROPE["original_max_position_embeddings"] = 64  # so that high, medium and low frequencies all occur
FAMILIES = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, eos_token_id=256, bos_token_id=256
    ),
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
    "gemma": lambda: transformers.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    ),  # fmt: skip  (layers: local, global)
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **(SMALL | dict(num_hidden_layers=3)),
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=20,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, num_key_value_heads=2),
    "phi3": lambda: transformers.Phi3Config(**SMALL, num_key_value_heads=2),  # unequal q, k, v in qkv_proj
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
    ),
}


def test_every_family_record_is_complete_and_tested():
    """The families are the records of hf.FAMILY, their number derived from it: each has a parity config here
    (the session fixture below runs every test over them), names a transformers class whose config is that
    model_type, and sets only ModelConfig fields."""
    assert len(hf.FAMILIES) == len(hf.FAMILY) == len(FAMILIES) and set(hf.FAMILY) == set(FAMILIES)
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name, family in hf.FAMILY.items():
        assert isinstance(family, hf.Family)
        assert getattr(transformers, family.architecture).config_class.model_type == name
        assert FAMILIES[name]().model_type == name
        assert set(family.fields) <= model_fields, name
        assert all(isinstance(k, str) for k in family.defaults), name
        for field in dataclasses.fields(hf.Family):  # every field set or deliberately at its default
            assert getattr(family, field.name) is not None, (name, field.name)


def _randomise(m: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_((1.0 if "norm" in name or ".ln_" in name else 0.0) + noise)


@pytest.fixture(scope="session", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    """(family, the transformers model, its saved folder, jaxgen Generator over the imported params)."""
    family = request.param
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager")
    _randomise(ref, seed=len(family))
    ref.eval()
    folder = tmp_path_factory.mktemp(f"hf_{family}")
    ref.save_pretrained(folder)
    Tokenizer.byte_level().save_folder(folder)
    cfg, tok, params = hf.load_pretrained(folder, mesh=_one_device())
    return family, ref, folder, Generator(params, cfg, tok, max_batch=4, chunk_steps=16)


def _one_device():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))


def _jaxgen_logits(gen: Generator, tokens: np.ndarray, lengths: list[int]) -> np.ndarray:
    from jaxgen import model

    t = tokens.shape[1]
    positions = np.where(np.arange(t)[None] < np.asarray(lengths)[:, None], np.arange(t)[None], -1)
    logits, _ = model.forward(gen.params, tokens, positions.astype(np.int32), cfg=gen.cfg)
    return np.asarray(logits)


def _torch_logits(ref, tokens: np.ndarray, lengths: list[int]) -> np.ndarray:
    mask = (np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
    with torch.no_grad():
        out = ref(input_ids=torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask))
    return out.logits.numpy()


def test_logits_match_transformers_with_padding(family_model):
    _, ref, _, gen = family_model
    rng = np.random.default_rng(0)
    lengths = [24, 17, 9]  # longer than Mistral's window of 8; rows right-padded with id 0
    tokens = rng.integers(0, V, (3, 24)).astype(np.int32)
    for row, n in enumerate(lengths):
        tokens[row, n:] = 0
    ours, theirs = _jaxgen_logits(gen, tokens, lengths), _torch_logits(ref, tokens, lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(ours[row, :n], theirs[row, :n], atol=1e-4, rtol=0)


# The greedy prompts of the parity and engine tests: one Generator program serves both (the engine test
# compares with it). 12 tokens cross the engine test's prefill chunk of 8; with 32 new tokens every prompt
# crosses the sliding windows of 8.
GREEDY_PROMPTS = [np.random.default_rng(1).integers(0, V, n).tolist() for n in (7, 12, 3)]
GREEDY = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def test_greedy_generation_matches_transformers(family_model):
    _, ref, _, gen = family_model
    prompts = GREEDY_PROMPTS
    ours = gen.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=32, min_new_tokens=32, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert completion.tokens == out[0, len(prompt) :].tolist()


def test_score_equals_transformers_loss(family_model):
    _, ref, _, gen = family_model
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, V, 20).tolist()
    (scored,) = gen.score([tokens[:1]], [tokens[1:]])
    with torch.no_grad():
        loss = ref(input_ids=torch.tensor([tokens]), labels=torch.tensor([tokens])).loss.item()
    assert scored["tokens"] == 19
    np.testing.assert_allclose(scored["nll"], loss, rtol=1e-5)


def test_engine_greedy_equals_generator(family_model):
    """The serving engine (paged cache, chunked prefill) decodes what Generator (contiguous cache) does,
    so it matches transformers too; prompts cross the prefill chunk and the local window."""
    _, _, _, gen = family_model
    serve = ServeConfig(slots=4, page_size=8, num_pages=48, chunk_steps=8, prefill_chunk=8)
    got = Engine(gen.params, gen.cfg, gen.tokenizer, serve).generate(GREEDY_PROMPTS, GREEDY)  # run in this thread
    for ours, want in zip(got, gen.generate(GREEDY_PROMPTS, GREEDY), strict=True):
        assert ours.tokens == want.tokens


def test_export_reloads_in_transformers(family_model, tmp_path):
    family, ref, _, gen = family_model
    out = hf.save_pretrained(tmp_path / "export", gen.params, gen.cfg, gen.tokenizer)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert reloaded.config.model_type == family
    assert all(not v for v in info.values()), info  # no missing, unexpected or mismatched weights
    tokens = np.random.default_rng(3).integers(0, V, (2, 16))
    np.testing.assert_allclose(
        _torch_logits(reloaded.eval(), tokens, [16, 16]), _torch_logits(ref, tokens, [16, 16]), atol=1e-5, rtol=0
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token_id == gen.tokenizer.eos_id


@pytest.mark.parametrize("family_model", ["llama"], indirect=True)  # one family: the code path is shared
def test_sharded_export_and_import_onto_a_mesh(family_model, tmp_path):
    """Sharded safetensors both ways; on a (2, 2, 2) mesh every parameter lands in its own sharding."""
    from jaxgen import model
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    _family, ref, _, gen = family_model
    out = hf.save_pretrained(tmp_path / "sharded", gen.params, gen.cfg, gen.tokenizer, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg, _, params = hf.load_pretrained(out, mesh=mesh)
    want = model.param_shardings(cfg, mesh)
    placed = jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim), params, want)
    assert all(jax.tree.leaves(placed))
    same = jax.tree.map(np.array_equal, model.unstack_layers(params), gen.params)
    assert all(jax.tree.leaves(same))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = np.random.default_rng(4).integers(0, V, (1, 12))
    np.testing.assert_allclose(_torch_logits(reloaded, tokens, [12]), _torch_logits(ref, tokens, [12]), atol=1e-5)


def _rewrite(folder, dst, edit):
    """A copy of `folder` whose single safetensors file went through `edit(dict) -> dict`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family_model", ["qwen2"], indirect=True)  # one family: the code path is shared
def test_missing_wrong_shaped_and_unsupported_are_clear_errors(family_model, tmp_path):
    _family, _, folder, _ = family_model
    name = "model.layers.1.self_attn.k_proj.bias"
    missing = _rewrite(folder, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    sized_by = "num_hidden_layers=2, num_key_value_heads=2, head_dim=8"  # the config.json fields that set its shape
    with pytest.raises(
        hf.HFError, match=rf"'{name}' \(jaxgen layers/b_k_kh; {sized_by}\) is missing.*supported families"
    ):
        hf.load_pretrained(missing, mesh=_one_device())
    up = "model.layers.0.mlp.up_proj.weight"
    wrong = _rewrite(folder, tmp_path / "wrong", lambda t: t | {up: np.zeros((64, 31), np.float32)})
    with pytest.raises(hf.HFError, match=rf"'{up}' has shape \(64, 31\), but config.json implies \(64, 32\)"):
        hf.load_pretrained(wrong, mesh=_one_device())
    other = tmp_path / "bert"
    shutil.copytree(folder, other)
    (other / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(hf.HFError, match=r"model_type='bert'.*supported families: gpt2, llama, mistral, qwen2, gemma"):
        hf.load_pretrained(other, mesh=_one_device())


def test_peak_host_memory_is_one_parameter_not_a_second_model(tmp_path):
    """Reading tensor by tensor: beyond what stays (XLA:CPU may adopt numpy buffers as the placed params),
    loading holds about one stacked parameter at a time, never a second copy of the model."""
    import tracemalloc

    config = transformers.LlamaConfig(**(SMALL | dict(hidden_size=128, num_hidden_layers=6, intermediate_size=256)))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    family, cfg = hf.read_config(tmp_path)
    sizes = [np.prod(s.shape) * 4 for s in jax.tree.leaves(jax.eval_shape(lambda: _init(cfg)))]
    tracemalloc.start()
    params = hf.load_params(tmp_path, cfg, family, _one_device())
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(p.nbytes for p in jax.tree.leaves(params)) == sum(sizes)
    assert max(sizes) < 0.2 * sum(sizes)  # so the bound below is far from a whole model
    # One stacked parameter being filled, a layer's slices, and (when XLA does not adopt the buffer)
    # the copy device_put makes of it: about two parameters, never the model (4.2 MB here).
    assert peak - kept < 2.5 * max(sizes), (peak, kept, max(sizes), sum(sizes))


def _init(cfg):
    from jaxgen import model

    return model.init_params(cfg, jax.random.key(0))


def test_tokenizer_reads_end_of_sequence_ids_and_chat_template(tmp_path):
    tok = Tokenizer.byte_level()
    tok.save_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 10]}))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = Tokenizer.from_folder(tmp_path)
    assert loaded.eos_ids == (256, 10) and loaded.eos_id == 256
    assert loaded.chat_template == cfg["chat_template"]
    (tmp_path / "generation_config.json").unlink()
    assert Tokenizer.from_folder(tmp_path).eos_ids == (256,)  # from tokenizer_config.json's eos_token


@pytest.mark.parametrize("family_model", ["llama"], indirect=True)  # one family: the code path is shared
def test_fine_tune_convert_and_serve_from_the_command_lines(family_model, token_cache, tmp_path, capsys):
    """train.py starts from a Hugging Face folder (prompt/response masking), convert.py exports the
    result for transformers, and serve.py generates from a Hugging Face folder."""
    import convert
    import serve
    import train
    from jaxgen import model
    from jaxgen.inference.loading import load_run

    _family, _, folder, gen = family_model
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"q": f"Q: {i} + 1?", "a": f" A: {i + 1}"}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    argv = ["--config", "configs/tiny.yaml", "--run-dir", str(run), "--no-progress", f"training.init_from={folder}"]
    argv += ["data.source=jsonl", f"data.paths=[{pairs}]", "data.prompt_field=q", "data.response_field=a"]
    argv += [
        "data.seq_len=32",
        "data.eval_fraction=0.25",
        "training.steps=3",
        "training.batch_size=2",
        f"data.cache_dir={token_cache}",
    ]
    assert train.main([*argv, "mesh.data=1"]) == 0
    cfg, _, tuned = load_run(run, mesh=_one_device())
    assert cfg.model == gen.cfg  # the model section came from config.json
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), model.unstack_layers(tuned), gen.params
    )
    assert 0 < max(jax.tree.leaves(moved)) < 0.02  # fine-tuned from the imported weights, not from scratch

    out = tmp_path / "exported"
    assert convert.main([str(run), str(out)]) == 0
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info
    tokens = np.random.default_rng(5).integers(0, V, (2, 16)).astype(np.int32)
    theirs = _torch_logits(reloaded.eval(), tokens, [16, 16])
    ours, _ = model.forward(tuned, tokens, np.tile(np.arange(16, dtype=np.int32), (2, 1)), cfg=cfg.model)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)
    with pytest.raises(SystemExit):  # writing over the run folder is refused
        convert.main([str(run), str(run)])
    assert "out_dir must differ from run_dir" in capsys.readouterr().err

    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(folder), "--prompt", "Q: 7 + 1?", "--temperature", "0"]
    assert serve.main([*argv, "--max-new-tokens", "8"]) == 0
    import jaxgen

    (want,) = jaxgen.generate(str(folder), ["Q: 7 + 1?"], SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert capsys.readouterr().out == "Q: 7 + 1?" + want.text + "\n"


@pytest.mark.parametrize("family_model", ["gemma"], indirect=True)  # one family: the code path is shared
def test_bfloat16_checkpoint_loads_as_float32_or_as_itself(family_model, tmp_path):
    _family, ref, _, gen = family_model
    import copy

    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(tmp_path)
    Tokenizer.byte_level().save_folder(tmp_path)
    cfg, _, params = hf.load_pretrained(tmp_path, mesh=_one_device())
    assert cfg == gen.cfg
    want = jax.tree.map(lambda p: np.asarray(jax.numpy.asarray(p, jax.numpy.bfloat16), np.float32), gen.params)
    from jaxgen import model

    same = jax.tree.map(np.array_equal, model.unstack_layers(params), want)
    assert all(jax.tree.leaves(same))

    # held in their own dtype: auto keeps bfloat16 on an accelerator, float32 on CPU (slow bf16 products)
    from jaxgen.hf.load import checkpoint_dtype, inference_dtype

    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert inference_dtype("auto", "bfloat16", backend="gpu") == "bfloat16"
    assert inference_dtype("auto", "bfloat16", backend="tpu") == "bfloat16"
    assert inference_dtype("auto", "bfloat16", backend="cpu") == "float32"
    cfg16, _, params16 = hf.load_pretrained(tmp_path, mesh=_one_device(), param_dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and {p.dtype for p in jax.tree.leaves(params16)} == {np.dtype(jnp.bfloat16)}
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a, np.float32), b), params16, params)
    assert all(jax.tree.leaves(same))  # the same bits, half the bytes
    tokens = np.array([[5, 9, 11, 3, 7]], np.int32)
    pos = np.arange(5, dtype=np.int32)[None]
    full, _ = model.forward(params, tokens, pos, cfg=cfg)
    half, _ = model.forward(params16, tokens, pos, cfg=cfg16)
    assert np.abs(np.asarray(half) - np.asarray(full)).max() < 0.1 * np.abs(np.asarray(full)).max()


def test_run_folder_restores_in_bfloat16_when_asked(tiny_run):
    from jaxgen.inference.loading import load_model

    cfg, _, params = load_model(tiny_run, _one_device(), param_dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
    cfg32, _, params32 = load_model(tiny_run, _one_device())  # auto on CPU: float32
    assert cfg32.dtype == "float32" and {p.dtype for p in jax.tree.leaves(params32)} == {np.dtype(np.float32)}
    close = jax.tree.map(lambda a, b: np.allclose(np.asarray(a, np.float32), b, rtol=1e-2, atol=1e-6), params, params32)
    assert all(jax.tree.leaves(close))


def test_hugging_face_tokenizer_adds_its_special_tokens_like_transformers(tmp_path):
    """A Llama-style tokenizer (BOS added by its post-processor) encodes as transformers encodes."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    text = "the lazy fox"
    assert ours.encode(text) == fast(text).input_ids and ours.encode(text)[0] == 1
    assert ours.encode(text, special=False) == fast(text, add_special_tokens=False).input_ids
    assert ours.eos_ids == (2,)  # from tokenizer_config.json's eos_token: no config.json here


@pytest.mark.parametrize(
    "family, edit, message",
    [
        ("gemma3_text", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types=\['full_attention'"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_type='longrope' is not"),
        ("phi3", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, r"partial_rotary_factor=0.5"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, r"qwen3_moe with dense layers"),
        ("qwen3", {"use_sliding_window": True}, r"qwen3 with use_sliding_window=true"),
        ("gemma2", {"hidden_activation": "relu"}, r"gemma2 hidden_act='relu'"),
    ],
)
def test_unsupported_settings_of_the_newer_families_name_the_field(family, edit, message, tmp_path):
    """Read from config.json alone, before any weight: the error names the field and the value."""
    cfg = transformers.AutoConfig.for_model(family, **SMALL, num_key_value_heads=2, head_dim=8).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(hf.HFError, match=message):
        hf.read_config(tmp_path)


def test_a_model_no_family_has_is_refused_on_export():
    from jaxgen.config import ModelConfig

    odd = ModelConfig(qk_norm="full", norm_placement="sandwich")  # OLMo 2's qk-norm with Gemma's norms
    with pytest.raises(hf.HFError, match=r"no Hugging Face equivalent.*qk_norm=full, norm_placement=sandwich"):
        hf.family_of(odd)
    assert hf.family_of(ModelConfig(qk_norm="full", norm_placement="post")) == "olmo2"
    assert hf.family_of(ModelConfig(num_experts=4)) == "mixtral"


def test_keys_a_config_leaves_out_take_the_family_defaults_of_transformers():
    """jaxgen's table of per-family defaults agrees with transformers' config classes, so a sparse
    config.json (as in a multimodal Gemma 3's text_config) reads as transformers would read it."""
    for family, record in hf.FAMILY.items():
        defaults = record.defaults
        theirs = transformers.AutoConfig.for_model(family, pad_token_id=0).to_dict()
        rope = theirs.get("rope_parameters") or {}
        theirs["rope_theta"] = rope.get("full_attention", rope).get("rope_theta")
        theirs["rope_local_base_freq"] = rope.get("sliding_attention", {}).get("rope_theta")
        theirs["hidden_act"] = theirs.get("hidden_act") or theirs.get("hidden_activation")
        for key, value in defaults.items():
            assert theirs[key] == value, (family, key, theirs[key], value)
    sparse = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": 64, "intermediate_size": 128}
    sparse |= {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1}
    cfg = hf.config._from_hf(sparse, "gemma3_text", "sparse")
    assert (cfg.head_size, cfg.rope_theta, cfg.rope_local_theta, cfg.query_scale) == (256, 1e6, 1e4, 256)
    assert cfg.sliding_window == 4096 and cfg.global_every == 6 and cfg.mlp == "geglu"


def test_every_family_takes_adapters_and_merges_them(family_model):
    """Issue 33: LoRA on every imported family (attention targets for mixture of experts, every product
    otherwise): the adapted forward equals the forward of the weights with A @ B * scale merged in."""
    import dataclasses

    from jaxgen import model
    from jaxgen.config import LoraConfig
    from jaxgen.config.model import LORA_TARGETS
    from jaxgen.model import lora

    family, _, folder, _ = family_model
    cfg, _, base = hf.load_pretrained(folder, mesh=_one_device())
    targets = (
        ("q", "k", "v", "o") if cfg.num_experts else tuple(t for t in LORA_TARGETS if t != "gate" or cfg.mlp != "gelu")
    )
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=2, alpha=4.0, targets=targets))
    adapters = lora.init_lora(cfg, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), adapters)  # B != 0
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) * 7 % 250
    positions = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    adapted = model.forward(lora.attach(base, adapters), tokens, positions, cfg=cfg)[0]
    merged = model.forward(lora.merge(base, adapters, cfg), tokens, positions, cfg=cfg)[0]
    plain = model.forward(base, tokens, positions, cfg=cfg)[0]
    assert float(jnp.max(jnp.abs(adapted - plain))) > 1e-3, family  # the adapters do something
    np.testing.assert_allclose(np.asarray(adapted), np.asarray(merged), atol=2e-5, err_msg=family)
