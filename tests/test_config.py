import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxgen import model
from jaxgen.config import Config, ConfigError, ModelConfig, ServeCommandConfig, load_config, load_serve_config
from tests.conftest import ROOT

SERVE_CONFIGS = {"serve"}  # read by serve.py (load_serve_config); every other file is a training config
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.stem not in SERVE_CONFIGS)


def test_shipped_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "default", "gpt2-124m", "llama-small"} <= names


@pytest.mark.parametrize("name", sorted(SERVE_CONFIGS))
def test_every_serve_config_loads(name):
    assert isinstance(load_serve_config(ROOT / "configs" / f"{name}.yaml"), ServeCommandConfig)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_loads_and_has_the_right_shapes(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    m = cfg.model
    params = jax.eval_shape(lambda: model.init_params(m, jax.random.key(0)))
    assert params["embed_vd"].shape == (m.vocab_size, m.d_model)
    assert params["layers"]["w_q_dnh"].shape == (m.num_layers, m.d_model, m.num_heads, m.head_size)
    assert params["layers"]["w_k_dkh"].shape == (m.num_layers, m.d_model, m.kv_heads, m.head_size)
    assert ("head_dv" in params) == (not m.tie_embeddings)
    tokens = jax.ShapeDtypeStruct((2, cfg.data.seq_len), jnp.int32)
    logits, cache = jax.eval_shape(lambda p, t: model.forward(p, t, t, cfg=m), params, tokens)
    assert logits.shape == (2, cfg.data.seq_len, m.vocab_size) and logits.dtype == jnp.float32
    assert cache is None
    assert model.count_params(m) == sum(x.size for x in jax.tree.leaves(params))


def test_gpt2_124m_has_124m_parameters():
    cfg = load_config(ROOT / "configs" / "gpt2-124m.yaml")
    assert 124e6 < model.count_params(cfg.model) < 125e6 + 0.2e6  # 50304-token vocab and 1024 positions


def test_overrides_are_typed():
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["model.num_layers=3", "optimizer.learning_rate=1e-4"])
    assert cfg.model.num_layers == 3 and cfg.optimizer.learning_rate == 1e-4
    cfg = load_config(None, ["data.source=files", "data.paths=[a.txt, b.txt]", "model.sliding_window=null"])
    assert cfg.data.paths == ("a.txt", "b.txt") and cfg.model.sliding_window is None


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.num_layer=3"], "unknown config key model.num_layer; allowed keys under model: vocab_size"),
        (["modle.num_layers=3"], "unknown config key modle"),
        (["model.num_layers=0"], "model.num_layers=0 is not allowed: a positive integer"),
        (["model.num_layers=two"], "model.num_layers='two' is not allowed: an integer"),
        (["model.position=alibi"], "model.position='alibi' is not allowed: learned, rope"),
        (
            ["model.num_heads=4", "model.num_kv_heads=3"],
            "model.num_kv_heads=3 is not allowed: a divisor of num_heads=4",
        ),
        (["model.d_model=66"], "model.num_heads=4 is not allowed: a divisor of d_model=66"),
        (["data.seq_len=1000"], "data.seq_len=1000 is not allowed: at most model.max_seq_len=128"),
        (["training.grad_accum=3"], "training.grad_accum=3 is not allowed: a divisor of training.batch_size=8"),
        (["optimizer.learning_rate=-1"], "optimizer.learning_rate=-1.0 is not allowed"),
        (["optimizer.b2=1.5"], "optimizer.b2=1.5 is not allowed: a number in [0, 1)"),
        (["data.source=files"], "data.paths=() is not allowed: at least one glob"),
        (["mesh.data=-1", "mesh.fsdp=-1"], "with at most one -1"),
        (["model.use_bias=yes please"], "model.use_bias='yes please' is not allowed: true or false"),
        (["model=3"], "model=3 is not allowed: a mapping of vocab_size"),
        (["model.num_layers"], "is not of the form key=value"),
        (["model.qk_norm=layer"], "model.qk_norm='layer' is not allowed: none, head, full"),
        (["model.global_every=2"], "model.global_every=2 is not allowed: only with model.sliding_window set"),
        (["model.attn_softcap=0"], "model.attn_softcap=0.0 is not allowed: null or a finite number > 0"),
        (
            ["model.num_experts=4", "model.experts_per_token=5"],
            "model.experts_per_token=5 is not allowed: 1..num_experts=4",
        ),
        (["model.num_experts=4", "model.mlp=gelu"], "model.mlp='gelu' is not allowed: swiglu or geglu with experts"),
        (["model.num_experts=4", "model.moe_impl=gmm"], "model.moe_impl='gmm' is not allowed"),
        # values that gave NaN or inf silently (issue 31): norm eps, RoPE bases and factors, caps, scales
        (["model.rope_theta=0"], "model.rope_theta=0.0 is not allowed: a finite number > 0"),
        (["model.rope_theta=-10000"], "model.rope_theta=-10000.0 is not allowed: a finite number > 0"),
        (["model.norm_eps=-1"], "model.norm_eps=-1.0 is not allowed: a finite number > 0"),
        (["model.norm_eps=.nan"], "model.norm_eps=nan is not allowed: a finite number > 0"),
        (["model.rope_factor=0"], "model.rope_factor=0.0 is not allowed: a finite number >= 1"),
        (["model.rope_low_freq_factor=0"], "model.rope_low_freq_factor=0.0 is not allowed: a finite number > 0"),
        (["model.final_softcap=-1"], "model.final_softcap=-1.0 is not allowed: null or a finite number > 0"),
        (["model.query_scale=.inf"], "model.query_scale=inf is not allowed: null or a finite number > 0"),
        (["model.head_dim=0"], "model.head_dim=0 is not allowed: null or a positive integer"),
        (["model.num_kv_heads=0"], "model.num_kv_heads=0 is not allowed: null or a positive integer"),
        (["model.vocab_size=1000000000000"], "model.vocab_size=1000000000000 is not allowed: a positive integer below"),
        (["model.init_std=-1"], "model.init_std=-1.0 is not allowed: a finite number >= 0"),
        # RL settings that passed `> 0` while infinite (issue 44)
        (["rl.temperature=.inf"], "rl.temperature=inf is not allowed: a finite number > 0"),
        (["rl.kl_coef=.inf"], "rl.kl_coef=inf is not allowed: a finite number >= 0"),
        (["rl.warm_start_learning_rate=.inf"], "rl.warm_start_learning_rate=inf is not allowed: a finite number > 0"),
    ],
)
def test_config_errors_name_key_value_and_allowed(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", overrides)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("norm_eps", "abc", "a finite number > 0"), ("rope_theta", None, "a finite number > 0"),
        ("vocab_size", True, "a positive integer below 2**31"), ("num_heads", 4.0, "a positive integer"),
        ("num_experts", -1, "an integer >= 0"), ("tie_embeddings", 1, "true or false"),
        ("attn_softcap", "x", "null or a finite number > 0"), ("sliding_window", "x", "null or a positive integer"),
    ],
)  # fmt: skip
def test_model_config_built_in_code_checks_types_too(field, value, allowed):
    """Not only YAML values: a ModelConfig built from code or config.json names a wrong type (before: a
    TypeError from a comparison, or a model that failed inside a traced function)."""
    with pytest.raises(ConfigError, match=re.escape(f"model.{field}={value!r} is not allowed: {allowed}")):
        ModelConfig(**{field: value})


def test_missing_config_file_lists_shipped_configs():
    with pytest.raises(ConfigError, match=r"shipped configs: .*tiny\.yaml"):
        load_config("configs/nope.yaml")


def test_a_shipped_config_named_relative_loads_from_any_folder(tmp_path, monkeypatch):
    """`python /path/to/rl.py` from another folder: its default `configs/rl-arithmetic.yaml` is the shipped one."""
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/tiny.yaml") == load_config(ROOT / "configs" / "tiny.yaml")
    (tmp_path / "configs").mkdir()  # a folder's own configs/ comes first
    (tmp_path / "configs" / "tiny.yaml").write_text("model:\n  num_layers: 3\n")
    assert load_config("configs/tiny.yaml").model.num_layers == 3


def test_mesh_shape():
    from jaxgen.config import MeshConfig

    assert MeshConfig().shape(8) == (8, 1, 1)
    assert MeshConfig(data=-1, fsdp=2, tensor=2).shape(8) == (2, 2, 2)
    assert MeshConfig(data=1).shape(8) == (1, 1, 1)
    with pytest.raises(ConfigError, match="at most 8 devices"):
        MeshConfig(data=4, fsdp=4).shape(8)


def test_model_config_is_frozen_and_derives_values():
    m = ModelConfig(num_heads=8, num_kv_heads=2, d_model=64)
    assert (m.kv_heads, m.head_size, m.groups) == (2, 8, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_layers = 3
    assert Config().model == ModelConfig()


def test_train_cli_reports_config_errors_before_any_work():
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "model.num_heads=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "model.num_heads=0 is not allowed: a positive integer" in out.stderr
