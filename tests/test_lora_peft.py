"""PEFT adapters in and out (jaxgen.hf.peft), merging (lora.merge) and serving or converting a LoRA run,
each against transformers + PEFT on the same tiny model."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxgen import hf, model
from jaxgen.config import LoraConfig
from jaxgen.hf.peft import read_peft_adapter, write_peft_adapter
from jaxgen.model import lora
from tests.test_hf import FAMILIES, _one_device, _randomise
from tests.test_lora import ALL, ATTENTION, _adapters_from_peft, _peft_adapted

RANK, ALPHA = 4, 8.0
FUSED = {"gpt2": ["c_attn", "attn.c_proj", "c_fc"], "phi3": ["qkv_proj", "o_proj", "gate_up_proj"]}  # PEFT's modules
TOKENS = np.random.default_rng(3).integers(0, 257, (2, 12)).astype(np.int32)
POSITIONS = np.tile(np.arange(12, dtype=np.int32), (2, 1))


@dataclasses.dataclass
class Case:
    family: str
    folder: object  # the saved transformers model (and tokenizer)
    cfg: object  # jaxgen's ModelConfig with model.lora set
    params: dict  # the base
    adapters: dict  # random A and B (B nonzero)

    def forward(self, params, cfg=None):
        """Logits of TOKENS under `cfg` (default: the case's), one compile per params structure and config."""
        return _forward(params, cfg or self.cfg)

    def reference(self):
        """A fresh transformers model of the folder (PEFT wraps models in place)."""
        return transformers.AutoModelForCausalLM.from_pretrained(self.folder, attn_implementation="eager").eval()


# gpt2 and phi3: fused modules (c_attn; qkv_proj and gate_up_proj); mixtral: attention targets only
@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral", "gpt2", "phi3"])
def case(request, tmp_path_factory):
    from jaxgen.tokenizer import Tokenizer

    family = request.param
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager")
    _randomise(ref, seed=len(family))
    folder = tmp_path_factory.mktemp(f"peft_{family}")
    ref.save_pretrained(folder)
    Tokenizer.byte_level().save_folder(folder)
    cfg, _, params = hf.load_pretrained(folder, mesh=_one_device())
    targets = ATTENTION if cfg.num_experts else ALL
    if cfg.mlp == "gelu":
        targets = tuple(t for t in targets if t != "gate")
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=targets))
    rng = np.random.default_rng(len(family))
    adapters = jax.tree.map(
        lambda s: (rng.standard_normal(s.shape) * 0.1).astype(np.float32),
        lora.lora_specs(cfg),
        is_leaf=lambda x: isinstance(x, model.ParamSpec),
    )
    return Case(family, folder, cfg, params, adapters)


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(params, cfg):
    return model.forward(params, TOKENS, POSITIONS, cfg=cfg)[0]


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m(input_ids=torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


def test_export_loads_in_peft_with_the_same_logits(case, tmp_path):
    import peft

    ours = np.asarray(case.forward(lora.attach(case.params, case.adapters)))
    assert np.abs(ours - np.asarray(case.forward(case.params))).max() > 1e-2  # the adapters matter
    write_peft_adapter(tmp_path, case.adapters, case.cfg, base_model_name_or_path=str(case.folder))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, str(case.folder))
    wrapped = peft.PeftModel.from_pretrained(case.reference(), tmp_path).eval()
    np.testing.assert_allclose(ours, _torch_logits(wrapped), atol=1e-4, rtol=0)

    back, lora_cfg = read_peft_adapter(tmp_path, case.cfg)  # import of that folder: the same jaxgen logits
    adapted = dataclasses.replace(case.cfg, lora=lora_cfg)
    if case.family not in ("gpt2", "phi3"):  # unfused modules come back as they went, bit for bit
        assert lora_cfg == case.cfg.lora
        for x, y in zip(jax.tree.leaves(case.adapters), jax.tree.leaves(back), strict=True):
            np.testing.assert_array_equal(x, y)
    again = case.forward(lora.attach(case.params, back), adapted)
    np.testing.assert_allclose(np.asarray(again), ours, atol=1e-5, rtol=0)


def test_import_of_a_folder_peft_saved(case, tmp_path):
    """PEFT's own save_pretrained of random adapters reads as the adapters PEFT runs (logits within 1e-4)."""
    wrapped = _peft_adapted(case.reference(), case.cfg.lora.targets, seed=7, modules=FUSED.get(case.family))
    wrapped.save_pretrained(tmp_path)
    adapters, lora_cfg = read_peft_adapter(tmp_path, case.cfg, mesh=_one_device())  # placed in their shardings
    if case.family not in ("gpt2", "phi3"):
        assert lora_cfg == case.cfg.lora
        expected = _adapters_from_peft(wrapped, case.cfg)
        for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(adapters), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    adapted = dataclasses.replace(case.cfg, lora=lora_cfg)
    ours = case.forward(lora.attach(case.params, adapters), adapted)
    np.testing.assert_allclose(np.asarray(ours), _torch_logits(wrapped), atol=1e-4, rtol=0)


def _dora(case, seed: int = 1) -> tuple:
    """(config, adapters) of `case` with DoRA: its A and B, each magnitude the adapted weight's norms times
    random factors in [0.7, 1.3] (as a trained m would be)."""
    cfg = dataclasses.replace(case.cfg, lora=dataclasses.replace(case.cfg.lora, dora=True))
    specs = lora.lora_specs(cfg)
    zeros = {t: {k: case.adapters[t].get(k, np.zeros(s.shape, np.float32)) for k, s in specs[t].items()} for t in specs}
    adapters = jax.tree.map(np.array, lora.with_norms(case.params, zeros, cfg))
    rng = np.random.default_rng(seed)
    for pair in adapters.values():
        lora.parts(pair)[2][:] *= rng.uniform(0.7, 1.3, lora.parts(pair)[2].shape).astype(np.float32)
    return cfg, adapters


@pytest.mark.parametrize("case", ["llama", "qwen2", "gpt2"], indirect=True)  # qwen2, gpt2: biases; gpt2: fused
def test_dora_equals_peft_both_ways(case, tmp_path):
    """DoRA adapters written by jaxgen run in peft with jaxgen's logits (and read back the same); a DoRA folder
    PEFT saved (random A, B, magnitudes) reads as the adapters PEFT runs, logits and (llama) gradients alike."""
    import peft

    cfg, adapters = _dora(case)
    ours = np.asarray(case.forward(lora.attach(case.params, adapters), cfg))
    assert np.abs(ours - np.asarray(case.forward(lora.attach(case.params, case.adapters)))).max() > 1e-2
    write_peft_adapter(tmp_path / "ours", adapters, cfg)
    if case.family == "gpt2":  # DoRA rescales every row of c_attn: one of its parts left out is refused
        part = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=("q", "v")))
        with pytest.raises(hf.HFError, match=r"DoRA on gpt2's attn\.c_attn needs all of its parts targeted"):
            write_peft_adapter(tmp_path / "part", {t: adapters[t] for t in ("q", "v")}, part)
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["use_dora"] is True
    wrapped = peft.PeftModel.from_pretrained(case.reference(), tmp_path / "ours").eval()
    np.testing.assert_allclose(ours, _torch_logits(wrapped), atol=1e-4, rtol=0)
    back, lora_cfg = read_peft_adapter(tmp_path / "ours", cfg)
    assert lora_cfg.dora
    again = case.forward(lora.attach(case.params, back), dataclasses.replace(cfg, lora=lora_cfg))
    np.testing.assert_allclose(np.asarray(again), ours, atol=1e-5, rtol=0)

    theirs = _peft_adapted(case.reference(), cfg.lora.targets, 9, FUSED.get(case.family), use_dora=True)
    theirs.save_pretrained(tmp_path / "theirs")
    adapters, lora_cfg = read_peft_adapter(tmp_path / "theirs", cfg)
    adapted = dataclasses.replace(cfg, lora=lora_cfg)
    got = case.forward(lora.attach(case.params, adapters), adapted)
    np.testing.assert_allclose(np.asarray(got), _torch_logits(theirs), atol=1e-4, rtol=0)
    if case.family == "llama":
        _dora_gradients_equal_peft(case, adapters, adapted, theirs)


def _dora_gradients_equal_peft(case, adapters, cfg, wrapped):
    """The gradients of a weighted sum of the logits, jaxgen's and PEFT's, for layer 0's q adapter: its norm is
    held constant in the backward pass in both (a gradient through it changes A's and m's)."""
    weights = np.random.default_rng(0).standard_normal((*TOKENS.shape, cfg.vocab_size)).astype(np.float32)
    grads = jax.jit(jax.grad(lambda ad: (_forward(lora.attach(case.params, ad), cfg) * weights).sum()))(adapters)
    logits = wrapped(input_ids=torch.from_numpy(TOKENS.astype(np.int64))).logits
    (logits * torch.from_numpy(weights)).sum().backward()
    module = wrapped.base_model.model.model.layers[0].self_attn.q_proj
    a, _, m = lora.parts(grads["q"])
    for ours, theirs in [
        (a[0], module.lora_A["default"].weight.grad.T),
        (m[0], module.lora_magnitude_vector["default"].weight.grad),
    ]:
        theirs = theirs.numpy().reshape(ours.shape)
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4 * np.abs(theirs).max(), rtol=0)


def test_merged_export_equals_the_adapted_model(case, tmp_path):
    adapted = np.asarray(case.forward(lora.attach(case.params, case.adapters)))
    merged = lora.merge(case.params, case.adapters, case.cfg)
    np.testing.assert_allclose(np.asarray(case.forward(merged)), adapted, atol=1e-5, rtol=0)
    if case.family != "llama":
        return  # the export itself is hf.save_pretrained's, tested per family in test_hf.py
    hf.save_pretrained(tmp_path, merged, dataclasses.replace(case.cfg, lora=LoraConfig()))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(theirs), adapted, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama"], indirect=True)  # merge does not depend on the family
def test_merge_of_bfloat16_and_int8_bases(case):
    """bfloat16 stays bfloat16 (float32 math); int8 weights come back float32: dequantized plus the update."""
    from jaxgen.model import quant

    bf16 = jax.tree.map(lambda w: w.astype(jax.numpy.bfloat16), case.params)
    merged = lora.merge(bf16, case.adapters, case.cfg)
    w32 = lora.merge(case.params, case.adapters, case.cfg)["layers"]["w_q_dnh"]
    assert merged["layers"]["w_q_dnh"].dtype == jax.numpy.bfloat16
    np.testing.assert_allclose(np.asarray(merged["layers"]["w_q_dnh"], np.float32), w32, atol=2e-2)
    q8 = quant.quantize_params(case.params)
    merged = lora.merge(q8, case.adapters, case.cfg)
    w = merged["layers"]["w_q_dnh"]
    assert not quant.is_q(w) and w.dtype == np.float32
    delta = w32 - case.params["layers"]["w_q_dnh"]
    np.testing.assert_allclose(w, q8["layers"]["w_q_dnh"].dequantize() + delta, atol=1e-6)
    assert quant.is_q(merged["layers"]["mlp"]["w_gate_df"]) is False  # a target too
    assert quant.is_q(merged["head_dv"]) == quant.is_q(q8["head_dv"])  # not a target: as it was


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize(
    "settings",
    [
        dict(use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 3.0, "down_proj": 5.0}),
        dict(layers_to_transform=[1], target_modules=["q_proj", "up_proj"]),
    ],
    ids=["patterns", "one_layer"],
)
def test_import_of_per_module_ranks_and_layers(case, tmp_path, settings):
    """PEFT adapters of several ranks and scales (rank_pattern, alpha_pattern, rsLoRA's alpha / sqrt(r)) or of
    some layers only read as one jaxgen rank and scale with PEFT's logits."""
    import peft

    settings = {"target_modules": [f"{t}_proj" for t in ALL]} | settings
    wrapped = peft.get_peft_model(case.reference(), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, **settings))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    wrapped.eval().save_pretrained(tmp_path)
    adapters, lora_cfg = read_peft_adapter(tmp_path, case.cfg)
    adapted = dataclasses.replace(case.cfg, lora=lora_cfg)
    assert lora_cfg.rank == RANK and lora_cfg.targets == tuple(
        t for t in ALL if f"{t}_proj" in settings["target_modules"]
    )
    ours = case.forward(lora.attach(case.params, adapters), adapted)
    np.testing.assert_allclose(np.asarray(ours), _torch_logits(wrapped), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_bfloat16_adapter_files_read(case, tmp_path):
    """Adapters saved in bfloat16 (as PEFT saves a bfloat16 model's) read as their float32 values."""
    from safetensors.torch import load_file, save_file

    write_peft_adapter(tmp_path, case.adapters, case.cfg)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "adapter_model.safetensors")
    adapters, _ = read_peft_adapter(tmp_path, case.cfg)
    for x, y in zip(jax.tree.leaves(case.adapters), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(np.asarray(jax.numpy.asarray(x, jax.numpy.bfloat16), np.float32), y)


def _edit(folder, tmp_path, **changes):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | changes))
    return out


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "has no lora_magnitude_vector, but adapter_config.json says use_dora=true"),
        ({"use_dora": True, "layers_to_transform": [0]}, "layers_to_transform=[0] is not allowed: null with use_dora"),
        ({"bias": "all"}, "bias='all' is not allowed: none"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not allowed: false for llama"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not allowed"),
        ({"peft_type": "IA3"}, "peft_type='IA3' is not allowed: LORA"),
        ({"r": 8}, "lora_A has rank 4, but adapter_config.json says r=8"),
        ({"rank_pattern": {"q_proj": 2}}, "lora_A has rank 4, but adapter_config.json says r=2"),
    ],
)
def test_unsupported_adapters_are_refused(case, tmp_path, changes, message):
    write_peft_adapter(tmp_path / "a", case.adapters, case.cfg)
    with pytest.raises(hf.HFError) as e:
        read_peft_adapter(_edit(tmp_path / "a", tmp_path, **changes), case.cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["mixtral"], indirect=True)  # experts: not a target
def test_adapters_that_do_not_fit_the_model_are_refused(case, tmp_path):
    from safetensors.numpy import load_file, save_file

    write_peft_adapter(tmp_path, case.adapters, case.cfg)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for bad, message in [
        ({name: np.zeros((RANK, 7), np.float32)}, "lora_A (4, 7) and lora_B (32, 4) do not fit this model"),
        ({name.replace("self_attn.q_proj", "mlp.experts.0.w1"): tensors[name]}, "is not an adapter jaxgen runs"),
    ]:
        save_file(tensors | bad, tmp_path / "adapter_model.safetensors")
        with pytest.raises(hf.HFError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_peft_adapter(tmp_path, case.cfg)


def _greedy(forward, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by full forwards over a fixed length (causal: the padding after them is not seen)."""
    tokens = np.zeros((1, len(prompt) + n), np.int32)
    tokens[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        tokens[0, t] = int(np.argmax(np.asarray(forward(tokens))[0, t - 1]))
    return tokens[0, len(prompt) :].tolist()


def _lora_run(case, token_cache, run) -> None:
    """A LoRA run folder of `case`'s adapters on `case.folder` (training.init_from), at step 3, as train.py
    leaves one (config.yaml, tokenizer.json, a checkpoint of the train state), without compiling a train step."""
    from jaxgen.config import load_config
    from jaxgen.training.checkpoint import Checkpointer
    from jaxgen.training.step import create_train_state
    from jaxgen.training.trainer import prepare_run_dir, resolve_init_from
    from tests.conftest import ROOT

    overrides = [
        f"data.cache_dir={token_cache}", "mesh.data=1", f"training.init_from={case.folder}", f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}", f"model.lora.targets=[{', '.join(case.cfg.lora.targets)}]",
    ]  # fmt: skip
    cfg, _ = resolve_init_from(load_config(ROOT / "configs" / "tiny.yaml", overrides))
    prepare_run_dir(cfg, run)
    state = create_train_state(cfg, _one_device())
    assert jax.tree.structure(state.params) == jax.tree.structure(case.adapters)
    ckpt = Checkpointer(run, cfg.checkpoint)
    ckpt.save(3, state.replace(params=jax.tree.map(jax.numpy.asarray, case.adapters)))
    ckpt.close()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_lora_run_serves_and_converts(case, token_cache, tmp_path):
    """A LoRA run from a Hugging Face folder: load_run merges its adapters into the base and the engine serves
    it (greedy tokens as the adapted model's); convert.py writes its adapters as a PEFT folder (peft runs it
    with the adapted model's logits) and, with --merge-lora, the merged model (transformers: the same logits)."""
    import peft

    import convert
    from jaxgen import LLM, SamplingConfig
    from jaxgen.inference.loading import load_lora_run, load_run

    run = tmp_path / "run"
    _lora_run(case, token_cache, run)
    cfg, tokenizer, base, adapters = load_lora_run(run, mesh=_one_device())
    # the adapters' settings, and the base named in the one field both train.py and rl.py write
    assert cfg.model.lora == dataclasses.replace(case.cfg.lora, base=str(Path(case.folder).resolve()))
    for x, y in zip(jax.tree.leaves(case.adapters), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    for x, y in zip(jax.tree.leaves(case.params), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the base: training.init_from's weights
    adapted = lora.attach(base, adapters)
    ours = np.asarray(case.forward(adapted))
    merged_cfg, _, merged = load_run(run, mesh=_one_device())
    assert merged_cfg.model.lora.rank == 0 and "lora" not in merged["layers"]
    np.testing.assert_allclose(np.asarray(case.forward(merged)), ours, atol=1e-5, rtol=0)

    prompt = tokenizer.encode("7 + 7 =")
    positions = np.arange(len(prompt) + 6, dtype=np.int32)[None]
    expected = _greedy(jax.jit(lambda t: model.forward(adapted, t, positions, cfg=case.cfg)[0]), prompt, 6)
    llm = LLM(run, slots=2, num_pages=16, prefill_chunk=16)  # what serve.py --checkpoint RUN loads
    (out,) = llm.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=6))
    got = out.outputs[0].tokens
    assert got and got == expected[: len(got)]

    assert convert.main([str(run), str(tmp_path / "peft")]) == 0
    wrapped = peft.PeftModel.from_pretrained(case.reference(), tmp_path / "peft").eval()
    np.testing.assert_allclose(_torch_logits(wrapped), ours, atol=1e-4, rtol=0)
    assert convert.main([str(run), str(tmp_path / "merged"), "--merge-lora"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    np.testing.assert_allclose(_torch_logits(theirs.eval()), ours, atol=1e-4, rtol=0)


def test_convert_refuses_what_it_cannot_write(tmp_path, tiny_cfg, capsys):
    """Checked from config.yaml before anything loads: --merge-lora of a full run, a PEFT folder of a LoRA run
    whose base was drawn from the seed (no Hugging Face base to name)."""
    import convert
    from jaxgen.config import save_config

    for name, lora_cfg, flags, message in [
        ("full", LoraConfig(), ["--merge-lora"], "is not a LoRA run (no model.lora.rank > 0); drop the flag"),
        ("seeded", LoraConfig(rank=4), [], "no Hugging Face model is its base"),
    ]:
        (tmp_path / name).mkdir()
        save_config(dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, lora=lora_cfg)),
                    tmp_path / name / "config.yaml")  # fmt: skip
        assert convert.main([str(tmp_path / name), str(tmp_path / "out"), *flags]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
