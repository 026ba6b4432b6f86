"""LoRA: the adapted forward against PEFT on the same transformers model, and LoRA training (adapters
only, the base bitwise unchanged, int8 and nf4 bases, resume) on tiny models."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml

from jaxgen import hf, model
from jaxgen.config import ConfigError, LoraConfig
from jaxgen.model import lora, quant
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.step import create_base, create_train_state, make_train_step, put_batch
from tests.test_hf import FAMILIES, _one_device, _randomise

ALL = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("q", "k", "v", "o")
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral"])
def hf_model(request, tmp_path_factory):
    """(family, the transformers model, jaxgen's config and params of the same weights, the HF folder)."""
    family = request.param
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager")
    _randomise(ref, seed=len(family))
    folder = tmp_path_factory.mktemp(f"lora_{family}")
    ref.save_pretrained(folder)
    Tokenizer.byte_level().save_folder(folder)
    cfg, _, params = hf.load_pretrained(folder, mesh=_one_device())
    return family, ref.eval(), cfg, params, folder


def _peft_adapted(ref, targets, seed: int, modules=None, **settings):
    """ref wrapped by PEFT (`modules`, default the targets' "{t}_proj"; `settings`: more of peft.LoraConfig) with
    every lora_A and lora_B drawn at random (B nonzero) and DoRA's magnitudes (use_dora) scaled at random."""
    import peft

    modules = modules or [f"{t}_proj" for t in targets]
    wrapped = peft.get_peft_model(ref, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, **settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_magnitude_vector" in name:  # started at ||W||: around it, so that m / ||V|| stays near 1
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return wrapped.eval()


def _adapters_from_peft(wrapped, cfg) -> dict:
    """PEFT's lora_A (r, in) and lora_B (out, r) per layer, as jaxgen's stacked (L, *in, r) and (L, r, *out)."""
    specs = lora.lora_specs(cfg)
    found = {}
    for name, p in wrapped.named_parameters():
        m = re.search(r"layers\.(\d+)\..*\.(\w+)_proj\.lora_([AB])\.", name)
        if m:
            found[(m[2], m[3], int(m[1]))] = p.detach().numpy().T  # (in, r) or (r, out)
    out = {}
    for target, pair in specs.items():
        out[target] = {}
        for key, spec in pair.items():
            which = "A" if key.startswith("a_") else "B"
            stacked = np.stack([found[(target, which, i)] for i in range(cfg.num_layers)])
            out[target][key] = jnp.asarray(stacked.reshape(spec.shape))
    return out


def test_adapted_logits_equal_peft(hf_model):
    family, ref, cfg, params, _ = hf_model
    targets = ATTENTION if cfg.num_experts else ALL
    if cfg.num_experts:  # adapters on experts are refused with the reason
        with pytest.raises(ConfigError, match=r"model\.lora\.targets.*experts"):
            dataclasses.replace(cfg, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=ALL))
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=targets))
    tokens = np.random.default_rng(3).integers(0, 257, (2, 12)).astype(np.int32)
    positions = np.tile(np.arange(12, dtype=np.int32), (2, 1))
    forward = jax.jit(lambda p: model.forward(p, tokens, positions, cfg=cfg)[0])  # one compile, not op by op
    plain = forward(params)

    wrapped = _peft_adapted(ref, targets, seed=len(family))
    adapters = _adapters_from_peft(wrapped, cfg)
    ours = forward(lora.attach(params, adapters))
    untrained = forward(lora.attach(params, lora.init_lora(cfg, jax.random.key(1))))  # B zeros, as PEFT's
    np.testing.assert_array_equal(np.asarray(untrained), np.asarray(plain))
    with torch.no_grad():
        theirs = wrapped(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(np.asarray(ours) - np.asarray(plain)).max() > 1e-2  # the adapters do change the logits
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=-1", "model.lora.rank=-1 is not allowed"),
        ("model.lora.targets=[q, x]", "model.lora.targets='x' is not allowed: q, k, v, o, gate, up, down"),
        ("model.lora.targets=[q, q]", "model.lora.targets=('q', 'q') is not allowed: distinct"),
        ("model.lora.dropout=0.1", "model.lora.dropout=0.1 is not allowed: 0 (adapter dropout is not implemented)"),
        ("model.lora.alpha=0", "model.lora.alpha=0.0 is not allowed"),
        ("model.lora.dora=maybe", "model.lora.dora='maybe' is not allowed: true or false"),
        ("model.lora.ranks=4", "unknown config key model.lora.ranks; allowed keys under model.lora: rank"),
        ("model.lora.base_dtype=int4", "model.lora.base_dtype='int4' is not allowed: float32, bfloat16, int8, nf4"),
    ],
)
def test_lora_settings_are_checked(override, message):
    from jaxgen.config import load_config
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["model.lora.rank=16", "model.lora.targets=[q, v, up]"])
    assert cfg.model.lora == LoraConfig(rank=16, targets=("q", "v", "up"))
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_reinforcement_learning_refuses_dora(tiny_cfg):
    """The RL sampler runs the adapter from the engine's bank, which serves plain LoRA: refused before anything
    is built."""
    from jaxgen.rl.policy import Policy

    with pytest.raises(ConfigError, match=r"model\.lora\.dora=true is not allowed in reinforcement learning"):
        Policy.of(_lora_cfg(tiny_cfg, dora=True), None, None)


def _lora_cfg(tiny_cfg, **lora_fields):
    m = dataclasses.replace(tiny_cfg.model, lora=LoraConfig(rank=RANK, targets=ALL, **lora_fields))
    opt = dataclasses.replace(tiny_cfg.optimizer, warmup_steps=2, learning_rate=1e-2)
    data = dataclasses.replace(tiny_cfg.data, seq_len=32)
    training = dataclasses.replace(tiny_cfg.training, batch_size=4)
    return dataclasses.replace(tiny_cfg, model=m, optimizer=opt, data=data, training=training)


def _batch(cfg):
    """One fixed batch of a repeating pattern (learnable in a few steps)."""
    b, t = cfg.training.batch_size, cfg.data.seq_len
    seq = (np.arange(b * (t + 1)).reshape(b, t + 1) * 7 % 97).astype(np.int32)
    return {
        "inputs": seq[:, :-1], "targets": seq[:, 1:], "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
        "segment_ids": np.zeros((b, t), np.int32), "loss_mask": np.ones((b, t), np.int32),
    }  # fmt: skip


def _train(cfg, steps: int = 8):
    """(losses, base before, base after, final state, the adapters it started from) of `steps` LoRA steps on
    one batch."""
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    base = create_base(cfg, mesh)
    before = jax.tree.map(lambda x: np.array(x), base)
    state = create_train_state(cfg, mesh, base)  # (DoRA's magnitudes start at the base's norms)
    start = jax.tree.map(np.array, state.params)
    step_fn = make_train_step(cfg, mesh, state, base)
    batch = put_batch(_batch(cfg), mesh)
    losses = []
    for _ in range(steps):
        state, m = step_fn(state, batch)
        losses.append(float(m["loss"]))
    return losses, before, base, state, start


@pytest.mark.parametrize(
    "base_dtype, dora", [("float32", True), ("int8", False), ("nf4", False)], ids=["float32-dora", "int8", "nf4"]
)
def test_lora_trains_adapters_only(tiny_cfg, base_dtype, dora):
    """The loss falls, the base is bitwise unchanged, the optimizer holds the adapters' moments only. DoRA
    (model.lora.dora, the magnitudes trained too): see `_check_dora`."""
    cfg = _lora_cfg(tiny_cfg, base_dtype=base_dtype, dora=dora)
    losses, before, base, state, start = _train(cfg)
    assert losses[-1] < losses[0] - 0.05, losses
    assert quant.is_quantized(base) == (base_dtype != "float32")
    assert (base["layers"]["w_q_dnh"].dtype == jnp.uint8) == (base_dtype == "nf4")  # packed codes
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))  # the base is bitwise unchanged
    adapters = lora.init_lora(cfg.model, jax.random.key(0), base)
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
    moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * lora.count_lora(cfg.model)  # Adam's mu and nu, adapters only
    b = state.params["q"]["b_rnh"]
    assert float(jnp.abs(b).max()) > 0  # B left zero
    if dora:
        _check_dora(cfg, base, start, state.params)


def _check_dora(cfg, base, start, trained):
    """DoRA's untrained adapters give the base's logits (m = ||W||), training moved every magnitude, and the
    merged weights give the adapted logits (the engine's bank refusing DoRA: tests/test_multi_lora.py)."""
    moved = [float(jnp.abs(lora.parts(trained[t])[2] - lora.parts(start[t])[2]).max()) for t in ALL]
    assert min(moved) > 0, moved
    batch = _batch(cfg)
    forward = jax.jit(lambda p: model.forward(p, batch["inputs"], batch["positions"], cfg=cfg.model)[0])
    np.testing.assert_allclose(forward(lora.attach(base, start)), forward(base), atol=1e-5, rtol=0)
    merged = lora.merge(base, trained, cfg.model)
    np.testing.assert_allclose(forward(merged), forward(lora.attach(base, trained)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("hf_model", ["llama"], indirect=True)  # one family: the code path is shared
def test_lora_run_from_hugging_face_resumes_exactly(hf_model, token_cache, tmp_path):
    """train() from an HF folder with LoRA for 4 steps; a copy of its folder as a kill after step 2 leaves it
    (checkpoint 4 gone) continues to the same losses and bitwise the same adapters."""
    _, _, _, _, hf_folder = hf_model
    from jaxgen.config import load_config
    from jaxgen.training.checkpoint import Checkpointer
    from jaxgen.training.trainer import resolve_init_from, train
    from tests.conftest import ROOT

    texts = tmp_path / "texts.jsonl"  # a small corpus: the folder's tokenizer has its own token cache
    texts.write_text("".join(json.dumps({"text": f"{i} + {i} = {2 * i}. " * 4}) + "\n" for i in range(200)))
    overrides = [
        f"data.cache_dir={token_cache}", "data.source=jsonl", f"data.paths=[{texts}]", "data.eval_batches=1",
        "mesh.data=1", f"training.init_from={hf_folder}", "model.lora.rank=4", "training.steps=4",
        "training.batch_size=2", "data.seq_len=32", "training.eval_every=100", "training.peak_flops=1e12",
        "checkpoint.every=2", "checkpoint.keep=5",
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    once = train(cfg, tmp_path / "once", progress=False)
    assert once.losses[-1] < once.losses[0]
    shutil.copytree(tmp_path / "once", tmp_path / "killed")
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "4")
    resumed = train(cfg, tmp_path / "killed", progress=False)
    assert resumed.step == 4 and resumed.losses == once.losses[2:]
    resolved, _ = resolve_init_from(cfg)

    def adapters_of(run):
        ckpt = Checkpointer(run)
        state, _ = ckpt.restore(4, create_train_state(resolved, _one_device()), with_data=False)
        ckpt.close()
        return state.params

    a, b = adapters_of(tmp_path / "once"), adapters_of(tmp_path / "killed")
    assert jax.tree.structure(a) == jax.tree.structure(lora.init_lora(resolved.model, jax.random.key(0)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    from jaxgen.inference.loading import load_run

    merged_cfg, _, merged = load_run(tmp_path / "once")  # adapters merged into the base: tests/test_lora_peft.py
    assert merged_cfg.model.lora.rank == 0
    assert load_config(tmp_path / "once" / "config.yaml").model.lora.base == str(Path(hf_folder).resolve())
    # a run folder written before model.lora.base (the base named by training.init_from alone) loads the same
    config_file = tmp_path / "killed" / "config.yaml"
    data = yaml.safe_load(config_file.read_text())
    del data["model"]["lora"]["base"]
    config_file.write_text(yaml.safe_dump(data))
    _, _, old = load_run(tmp_path / "killed")
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
