"""config.json <-> ModelConfig: the supported families, reading a folder's config, choosing the family a
jaxgen model exports to and writing its config.json; HFError, the error every hf module raises.

Each family is one record (`jaxgen.hf.families.FAMILY`): the Llama layout plus a few fields; reading and
writing are one function each way over the record, and `family_of` checks a candidate by writing the config
and reading it back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxgen.config import ModelConfig
from jaxgen.config.base import ConfigError
from jaxgen.hf.families import FAMILIES, FAMILY
from jaxgen.hf.fields import Fields, HFError, read_object
from jaxgen.tokenizer import Tokenizer

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# Fields a round trip through config.json need not keep: how jaxgen computes, not what the model is.
_NOT_ARCHITECTURE = (
    "dtype", "init_std", "family", "moe_impl", "router_z_coef", "attention_impl", "attention_block", "remat",
    "decode_impl", "lora", "deterministic", "cache_layout",
)  # fmt: skip


def _fail(folder, what: str) -> HFError:
    return HFError(f"{folder}: {what} (supported families: {', '.join(FAMILIES)})")


def read_config(folder: str | Path) -> tuple[str, ModelConfig]:
    """The family and jaxgen model config of a folder's config.json (params float32, compute float32);
    HFError naming the file, the key and the value for any entry jaxgen cannot use."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise _fail(folder, "no config.json: not a Hugging Face model folder")
    hf = read_object(folder / "config.json")
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _fail(folder, f"unsupported architecture model_type={family!r} ({hf.get('architectures')})")
    return family, _from_hf(hf, family, folder)


def _from_hf(hf: dict, family: str, folder) -> ModelConfig:
    layout = FAMILY[family].layout
    f = Fields(FAMILY[family].defaults | hf, f"{folder}/config.json")
    fields = _gpt2_fields(f, folder) if layout == "gpt2" else _llama_like_fields(f, family, folder)
    try:
        return ModelConfig(**fields)
    except ConfigError as e:  # a check across fields (e.g. heads and kv-heads): name the file and its keys
        names = _HF_NAMES[layout]
        key = str(e).split("=", 1)[0].removeprefix("model.")
        raise HFError(f"{f.where}: {e} (config.json's {names.get(key, key)})") from None


# config.json's names of the ModelConfig fields a cross-field check can refuse
_HF_NAMES = {
    "gpt2": {
        "num_heads": "n_head", "d_model": "n_embd", "num_layers": "n_layer", "max_seq_len": "n_positions",
        "d_ff": "n_inner", "norm_eps": "layer_norm_epsilon",
    },
    "llama": {
        "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "d_model": "hidden_size",
        "num_layers": "num_hidden_layers", "max_seq_len": "max_position_embeddings", "d_ff": "intermediate_size",
        "rope_high_freq_factor": "rope_scaling.high_freq_factor", "experts_per_token": "num_experts_per_tok",
        "norm_eps": "rms_norm_eps", "query_scale": "query_pre_attn_scalar",
        "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping",
    },
}  # fmt: skip


_AXIS_FIELDS = {
    "vocab": "vocab_size", "embed": "d_model", "act_embed": "d_model", "heads": "num_heads",
    "kv_heads": "num_kv_heads", "head_dim": "head_dim", "mlp": "d_ff", "layers": "num_layers", "expert": "num_experts",
    "positions": "max_seq_len",
}  # fmt: skip


def size_fields(cfg: ModelConfig, family: str, axes: tuple | None = None) -> str:
    """The config.json fields that size one parameter with logical `axes` (None: all the weights), as
    `name=value, ...`: what an error about sizes points the reader to."""
    names = _HF_NAMES[FAMILY[family].layout] | {
        "num_experts": "num_local_experts" if FAMILY[family].experts == "mixtral" else "num_experts"
    }
    if FAMILY[family].experts == "qwen3_moe":
        names["d_ff"] = "moe_intermediate_size"
    if axes is None:
        axes = ("vocab", "embed", "layers", "mlp") + ("expert",) * bool(cfg.num_experts)
        axes += ("positions",) * (cfg.position == "learned")
    value = {"head_dim": cfg.head_size, "num_kv_heads": cfg.kv_heads}
    fields = dict.fromkeys(_AXIS_FIELDS[a] for a in axes if a in _AXIS_FIELDS)
    return ", ".join(f"{names.get(k, k)}={value.get(k, getattr(cfg, k))}" for k in fields)


def _gpt2_fields(f: Fields, folder) -> dict:
    act = f.text("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise _fail(folder, f"gpt2 activation_function={act!r} is not supported; allowed: {', '.join(_TANH_GELU)}")
    if f.flag("scale_attn_by_inverse_layer_idx", False) or not f.flag("scale_attn_weights", True):
        raise _fail(folder, "gpt2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights")
    d = f.integer("n_embd")
    return dict(
        vocab_size=f.integer("vocab_size"), num_layers=f.integer("n_layer"), d_model=d, num_heads=f.integer("n_head"),
        d_ff=f.integer("n_inner", 4 * d), max_seq_len=f.integer("n_positions", 1024), position="learned",
        norm="layernorm", norm_eps=f.number("layer_norm_epsilon", 1e-5), mlp="gelu", use_bias=True,
        tie_embeddings=f.flag("tie_word_embeddings", True), family="gpt2",
    )  # fmt: skip


def _rope_section(f: Fields) -> Fields:
    """transformers 5's rope_parameters, else the older rope_scaling (either may be absent)."""
    return f.section("rope_parameters") if f.has("rope_parameters") else f.section("rope_scaling")


def _rope_fields(f: Fields, family: str, folder) -> dict:
    """RoPE settings from transformers 5's rope_parameters (per layer type for Gemma 3) or the older
    rope_theta + rope_scaling."""
    rope, fields = _rope_section(f), {}
    if rope.has("full_attention"):  # per layer type: the global layers' settings, the local layers' base
        local = rope.section("sliding_attention")
        fields["rope_local_theta"] = local.number("rope_theta", f.number("rope_local_base_freq", 10000.0))
        if local.text("rope_type", "default") != "default":
            raise _fail(folder, f"{local.prefix}rope_type={local.data['rope_type']!r}; allowed: default")
        rope = rope.section("full_attention")
    elif FAMILY[family].local_rope:
        fields["rope_local_theta"] = f.number("rope_local_base_freq", 10000.0)
    partial = rope.number("partial_rotary_factor", f.number("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _fail(folder, f"partial_rotary_factor={partial} is not supported; allowed: 1.0")
    kind = rope.text("rope_type", rope.text("type", "default"))
    fields["rope_theta"] = rope.number("rope_theta", f.number("rope_theta", 10000.0))
    if kind == "default":
        return fields
    if kind == "linear":
        return fields | {"rope_scaling": "linear", "rope_factor": rope.number("factor", lo=1.0, closed=True)}
    if kind == "llama3":
        return fields | {
            "rope_scaling": "llama3",
            "rope_factor": rope.number("factor", lo=1.0, closed=True),
            "rope_low_freq_factor": rope.number("low_freq_factor", 1.0),
            "rope_high_freq_factor": rope.number("high_freq_factor", 4.0),
            "rope_original_max_len": rope.integer("original_max_position_embeddings", 8192),
        }
    raise _fail(folder, f"{rope.prefix}rope_type={kind!r} is not supported; allowed: default, linear, llama3")


def _window_fields(f: Fields, family: str, folder) -> dict:
    """The sliding window, and for Gemma 2/3 which layers are global (`global_every`)."""
    kind = FAMILY[family].window
    if kind == "refused" and f.flag("use_sliding_window", False):
        raise _fail(folder, f"{family} with use_sliding_window=true (per-layer windows) is not supported")
    window = f.integer("sliding_window", None) if kind in ("sliding", "layered") else None
    if window is None:
        return {}
    if kind == "sliding":
        return {"sliding_window": window}
    n = f.integer("num_hidden_layers")
    types = f.raw("layer_types", None, "a list of full_attention / sliding_attention")
    if types is None:  # older configs: Gemma 2 alternates, Gemma 3 has a period
        period = 2 if not FAMILY[family].local_rope else f.integer("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise f.error("layer_types", types, f"a list of num_hidden_layers={n} layer types")
    is_global = [t == "full_attention" for t in types]
    every = is_global.index(True) + 1 if any(is_global) else 0
    if is_global != [every > 0 and (i + 1) % every == 0 for i in range(n)]:
        raise _fail(folder, f"layer_types={types} is not every-n-th-layer-global; jaxgen needs that pattern")
    return {"sliding_window": window, "global_every": every}


def _expert_fields(f: Fields, family: str, folder) -> dict:
    experts = FAMILY[family].experts
    if experts == "mixtral":
        return {
            "num_experts": f.integer("num_local_experts"), "experts_per_token": f.integer("num_experts_per_tok"),
            "router_renormalize": True, "router_aux_coef": f.number("router_aux_loss_coef", 0.02, closed=True),
        }  # fmt: skip
    if experts == "qwen3_moe":
        if f.integer("decoder_sparse_step", 1) != 1 or f.raw("mlp_only_layers", None, "a list"):
            raise _fail(folder, "qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers)")
        # transformers 5 writes num_local_experts
        experts = f.integer("num_experts") if f.has("num_experts") else f.integer("num_local_experts")
        return {
            "num_experts": experts, "experts_per_token": f.integer("num_experts_per_tok"),
            "d_ff": f.integer("moe_intermediate_size"), "router_renormalize": f.flag("norm_topk_prob", False),
            "router_aux_coef": f.number("router_aux_loss_coef", 0.001, closed=True),
        }  # fmt: skip
    return {}


def _gemma_fields(f: Fields, family: str) -> dict:
    if FAMILY[family].window != "layered":
        return {}
    scale = f.number("query_pre_attn_scalar") if f.has("query_pre_attn_scalar") else f.number("head_dim", 256.0)
    return {
        "query_scale": scale, "attn_softcap": f.number("attn_logit_softcapping", None),
        "final_softcap": f.number("final_logit_softcapping", None),
    }  # fmt: skip


def _llama_like_fields(f: Fields, family: str, folder) -> dict:
    act = f.text("hidden_activation") if f.has("hidden_activation") else f.text("hidden_act", "silu")
    gelu = FAMILY[family].gelu
    want = _TANH_GELU if gelu else ("silu",)
    if act not in want:
        raise _fail(folder, f"{family} hidden_act={act!r} is not supported; allowed: {', '.join(want)}")
    attn_bias, mlp_bias = f.flag("attention_bias", False), f.flag("mlp_bias", False)
    if attn_bias != mlp_bias:
        raise _fail(folder, f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: jaxgen biases both or neither")
    if attn_bias and family != "llama":
        raise _fail(folder, f"{family} with attention_bias=true is not supported")
    d, n = f.integer("hidden_size"), f.integer("num_attention_heads")
    fields = dict(
        vocab_size=f.integer("vocab_size"), num_layers=f.integer("num_hidden_layers"), d_model=d, num_heads=n,
        num_kv_heads=f.integer("num_key_value_heads", n), head_dim=f.integer("head_dim", d // n),
        d_ff=f.integer("intermediate_size"), max_seq_len=f.integer("max_position_embeddings", 2048),
        position="rope", norm="rmsnorm", norm_eps=f.number("rms_norm_eps", 1e-6), mlp="swiglu",
        use_bias=attn_bias, tie_embeddings=f.flag("tie_word_embeddings", gelu), family=family,
    )  # fmt: skip
    fields |= FAMILY[family].fields | _rope_fields(f, family, folder) | _window_fields(f, family, folder)
    return fields | _gemma_fields(f, family) | _expert_fields(f, family, folder)


# --- export ----------------------------------------------------------------------------------------


def family_of(cfg: ModelConfig) -> str:
    """The Hugging Face family a jaxgen model config exports to (its own `family` first, if it still
    fits), or HFError saying what does not fit. A family fits when its config.json reads back as the
    same architecture."""
    order = ([cfg.family] if cfg.family in FAMILIES else []) + [f for f in FAMILIES if f != cfg.family]
    for family in order:
        try:
            back = _from_hf(hf_config(cfg, family), family, "export")
        except (HFError, KeyError, TypeError, ValueError):
            continue
        if _architecture(back) == _architecture(cfg):
            return family
    raise HFError(
        f"this model has no Hugging Face equivalent (position={cfg.position}, norm={cfg.norm}, mlp={cfg.mlp}, "
        f"use_bias={cfg.use_bias}, qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, "
        f"norm_placement={cfg.norm_placement}, num_experts={cfg.num_experts}); exportable: {', '.join(FAMILIES)} "
        "as transformers defines them (see jaxgen.hf.families.FAMILY)"
    )


def _architecture(cfg: ModelConfig) -> dict:
    """The fields that define the network, spelled one way (defaults filled in, unused ones dropped)."""
    out = dataclasses.asdict(cfg)
    out |= {"head_dim": cfg.head_size, "num_kv_heads": cfg.kv_heads, "query_scale": cfg.query_scale or cfg.head_size}
    out |= {"global_every": tuple(cfg.is_global(i) for i in range(cfg.num_layers))}
    out["rope_local_theta"] = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    drop = set(_NOT_ARCHITECTURE)
    if cfg.rope_scaling == "none":
        drop |= {"rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"}
    if cfg.position != "rope":
        drop |= {"rope_theta", "rope_scaling"}
    if not cfg.num_experts:
        drop |= {"experts_per_token", "router_renormalize", "router_aux_coef"}
    return {k: v for k, v in out.items() if k not in drop}


def hf_config(cfg: ModelConfig, family: str, tokenizer: Tokenizer | None = None) -> dict:
    """config.json for `cfg` in `family` (see `family_of`)."""
    record = FAMILY[family]
    common = {"architectures": [record.architecture], "model_type": family, "vocab_size": cfg.vocab_size}
    common |= {"tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    if tokenizer is not None:
        common["eos_token_id"] = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else list(tokenizer.eos_ids)
    if record.layout == "gpt2":
        return common | {
            "n_layer": cfg.num_layers, "n_embd": cfg.d_model, "n_head": cfg.num_heads, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        }  # fmt: skip
    out = common | {
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.d_model, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": _rope_json(cfg, family), "attention_bias": cfg.use_bias, "mlp_bias": cfg.use_bias,
        "hidden_act": "gelu_pytorch_tanh" if record.gelu else "silu",
    }  # fmt: skip
    if record.gelu:
        out["hidden_activation"] = out["hidden_act"]
    if record.window in ("sliding", "layered"):
        out["sliding_window"] = cfg.sliding_window
    if record.window == "refused":
        out |= {"use_sliding_window": False, "sliding_window": None}
    if record.window == "layered":
        layer_types = ["full_attention" if cfg.is_global(i) else "sliding_attention" for i in range(cfg.num_layers)]
        out |= {"layer_types": layer_types, "query_pre_attn_scalar": _int_if_whole(cfg.query_scale or cfg.head_size)}
        out |= {"attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap}
    if record.pad_is_eos:
        out["pad_token_id"] = common.get("eos_token_id", 0)  # transformers' default (= vocab size) fails
    return out | _experts_json(cfg, family)


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # transformers' config classes type-check some fields


def _rope_json(cfg: ModelConfig, family: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope |= {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        rope |= {
            "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }  # fmt: skip
    if FAMILY[family].local_rope:
        local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        return {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return rope


def _experts_json(cfg: ModelConfig, family: str) -> dict:
    experts = FAMILY[family].experts
    if experts == "mixtral":
        return {
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_coef, "output_router_logits": False,
        }  # fmt: skip
    if experts == "qwen3_moe":
        return {
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.d_ff, "norm_topk_prob": cfg.router_renormalize,
            "router_aux_loss_coef": cfg.router_aux_coef, "decoder_sparse_step": 1, "mlp_only_layers": [],
        }  # fmt: skip
    return {}
