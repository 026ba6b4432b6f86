"""Each family's config in configs/ takes a training step (the jitted step train.py's trainer runs) and
exports as that family: transformers loads the folder and computes the same logits (so the YAML really
is a Qwen3, a Gemma 3, a Mixtral, ... and not merely something that trains). The whole trainer (run
folder, checkpoints, resume) is tested on the tiny config in test_train.py and test_resume.py."""

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxgen import hf, model
from jaxgen.config import load_config
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.step import create_train_state, make_train_step, put_batch
from tests.conftest import ROOT
from tests.test_train import random_batch

CONFIGS = [
    "qwen3-small", "gemma2-small", "gemma3-small", "olmo2-small", "phi3-small", "mixtral-small", "qwen3-moe-small",
]  # fmt: skip
SHORT = ["training.batch_size=2", "data.seq_len=64", "mesh.data=1"]


@pytest.mark.parametrize("name", CONFIGS)
def test_family_config_trains_and_exports_as_its_family(name, tmp_path):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", SHORT)  # random batches: no corpus
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = create_train_state(cfg, mesh)
    state, metrics = make_train_step(cfg, mesh, state)(state, put_batch(random_batch(cfg), mesh))
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1
    assert ("router_aux" in metrics) == (cfg.model.num_experts > 0)

    model_cfg, params = cfg.model, state.params
    folder = hf.save_pretrained(tmp_path / "hf", params, model_cfg, Tokenizer.byte_level())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert reloaded.config.model_type == model_cfg.family
    tokens = np.random.default_rng(0).integers(0, 257, (1, 80))  # beyond the local windows of 64
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.from_numpy(tokens)).logits.numpy()
    ours, _ = model.forward(params, tokens.astype(np.int32), np.arange(80, dtype=np.int32)[None], cfg=model_cfg)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=0)
