"""config.json <-> ModelConfig: the supported families, reading a folder's config, choosing the family a
jaxgen model exports to and writing its config.json; HFError, the error every hf module raises."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxgen.config import ModelConfig
from jaxgen.tokenizer import Tokenizer

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "gemma")
_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class HFError(ValueError):
    """A Hugging Face folder (or a jaxgen model) that cannot be converted; the message says why."""


def _fail(folder, what: str) -> HFError:
    return HFError(f"{folder}: {what} (supported families: {', '.join(FAMILIES)})")


def read_config(folder: str | Path) -> tuple[str, ModelConfig]:
    """The family and jaxgen model config of a folder's config.json (params float32, compute float32)."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise _fail(folder, "no config.json: not a Hugging Face model folder")
    hf = json.loads((folder / "config.json").read_text())
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _fail(folder, f"unsupported architecture model_type={family!r} ({hf.get('architectures')})")
    return family, (_gpt2_config(hf, folder) if family == "gpt2" else _llama_like_config(hf, family, folder))


def _gpt2_config(hf: dict, folder) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise _fail(folder, f"gpt2 activation_function={act!r} is not supported; allowed: {', '.join(_TANH_GELU)}")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise _fail(folder, "gpt2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights")
    d = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], d_model=d, num_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf.get("n_positions", 1024), position="learned",
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu", use_bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )  # fmt: skip


def _rope_fields(hf: dict, folder) -> dict:
    """RoPE settings from transformers 5's rope_parameters or the older rope_theta + rope_scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return fields
    if kind == "linear":
        return fields | {"rope_scaling": "linear", "rope_factor": float(rope["factor"])}
    if kind == "llama3":
        return fields | {
            "rope_scaling": "llama3",
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "rope_original_max_len": int(rope.get("original_max_position_embeddings", 8192)),
        }
    raise _fail(folder, f"rope type {kind!r} is not supported; allowed: default, linear, llama3")


def _llama_like_config(hf: dict, family: str, folder) -> ModelConfig:
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    want = _TANH_GELU if family == "gemma" else ("silu",)
    if act not in want:
        raise _fail(folder, f"{family} hidden_act={act!r} is not supported; allowed: {', '.join(want)}")
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        raise _fail(folder, f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: jaxgen biases both or neither")
    window = hf.get("sliding_window") if family == "mistral" else None
    if family == "qwen2" and hf.get("use_sliding_window"):
        raise _fail(folder, "qwen2 with use_sliding_window=true (per-layer windows) is not supported")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], d_model=d, num_heads=n,
        num_kv_heads=hf.get("num_key_value_heads") or n, head_dim=hf.get("head_dim") or d // n,
        d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048), position="rope",
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="geglu" if family == "gemma" else "swiglu",
        use_bias=attn_bias, qkv_bias=family == "qwen2", sliding_window=window,
        tie_embeddings=hf.get("tie_word_embeddings", family == "gemma"),
        norm_unit_offset=family == "gemma", embed_scale=family == "gemma", **_rope_fields(hf, folder),
    )  # fmt: skip


def family_of(cfg: ModelConfig) -> str:
    """The Hugging Face family a jaxgen model config exports to, or HFError saying what does not fit."""
    gpt2 = dict(position="learned", norm="layernorm", mlp="gelu", use_bias=True, qkv_bias=False, sliding_window=None)
    gpt2 |= dict(norm_unit_offset=False, embed_scale=False, num_kv_heads=None, head_dim=None)
    rope = dict(position="rope", norm="rmsnorm", embed_scale=False, norm_unit_offset=False, sliding_window=None)
    candidates = {
        "gemma": rope | dict(mlp="geglu", use_bias=False, qkv_bias=False, norm_unit_offset=True, embed_scale=True),
        "qwen2": rope | dict(mlp="swiglu", use_bias=False, qkv_bias=True),
        "mistral": rope | dict(mlp="swiglu", use_bias=False, qkv_bias=False, sliding_window=cfg.sliding_window),
        "llama": rope | dict(mlp="swiglu", qkv_bias=False, use_bias=cfg.use_bias),
        "gpt2": gpt2,
    }
    if cfg.sliding_window is None:
        del candidates["mistral"]
    plain = dataclasses.replace(  # GPT-2 spells head size and head count only one way
        cfg,
        head_dim=None if cfg.head_size * cfg.num_heads == cfg.d_model else cfg.head_dim,
        num_kv_heads=None if cfg.kv_heads == cfg.num_heads else cfg.num_kv_heads,
    )
    for family, fields in candidates.items():
        if all(getattr(plain, k) == v for k, v in fields.items()):
            return family
    raise HFError(
        f"this model has no Hugging Face equivalent (position={cfg.position}, norm={cfg.norm}, mlp={cfg.mlp}, "
        f"use_bias={cfg.use_bias}, qkv_bias={cfg.qkv_bias}); exportable: gpt2 (learned, layernorm, gelu, "
        "biases, multi-head), llama/mistral/qwen2 (rope, rmsnorm, swiglu), gemma (rope, rmsnorm, geglu)"
    )


def hf_config(cfg: ModelConfig, family: str, tokenizer: Tokenizer | None = None) -> dict:
    """config.json for `cfg` in `family` (see `family_of`)."""
    common = {"architectures": [_ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size}
    common |= {"tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    if tokenizer is not None:
        common["eos_token_id"] = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else list(tokenizer.eos_ids)
    if family == "gpt2":
        return common | {
            "n_layer": cfg.num_layers, "n_embd": cfg.d_model, "n_head": cfg.num_heads, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        }  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope |= {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        rope |= {
            "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }  # fmt: skip
    out = common | {
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.d_model, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "hidden_act": "gelu_pytorch_tanh" if family == "gemma" else "silu",
    }  # fmt: skip
    if family == "llama":
        out |= {"attention_bias": cfg.use_bias, "mlp_bias": cfg.use_bias}
    if family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if family == "qwen2":
        out |= {"use_sliding_window": False, "sliding_window": None}
    return out
