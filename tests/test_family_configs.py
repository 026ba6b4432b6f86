"""Each family's config in configs/ trains with the trainer train.py runs, and its run exports as that
family: transformers loads the folder and computes the same logits (so the YAML really is a Qwen3, a
Gemma 3, a Mixtral, ... and not merely something that trains)."""

import numpy as np
import pytest
import torch
import transformers

from jaxgen import hf, model
from jaxgen.config import load_config
from jaxgen.training.checkpoint import load_model
from jaxgen.training.trainer import train
from tests.conftest import ROOT

CONFIGS = [
    "qwen3-small", "gemma2-small", "gemma3-small", "olmo2-small", "phi3-small", "mixtral-small", "qwen3-moe-small",
]  # fmt: skip
SHORT = ["training.steps=2", "training.batch_size=2", "data.seq_len=64", "training.eval_every=2"]
SHORT += ["data.eval_batches=1", "checkpoint.every=2", "mesh.data=1"]


@pytest.mark.parametrize("name", CONFIGS)
def test_family_config_trains_and_exports_as_its_family(name, token_cache, tmp_path):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"data.cache_dir={token_cache}", *SHORT])
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.step == 2 and np.isfinite(result.losses).all() and np.isfinite(result.eval_losses[-1][1])

    model_cfg, tokenizer, params = load_model(tmp_path / "run")
    folder = hf.save_pretrained(tmp_path / "hf", params, model_cfg, tokenizer)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert reloaded.config.model_type == model_cfg.family
    tokens = np.random.default_rng(0).integers(0, 257, (1, 80))  # beyond the local windows of 64
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.from_numpy(tokens)).logits.numpy()
    ours, _ = model.forward(params, tokens.astype(np.int32), np.arange(80, dtype=np.int32)[None], cfg=model_cfg)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=0)
