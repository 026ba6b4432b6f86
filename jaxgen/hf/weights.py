"""The tensor names of a Hugging Face checkpoint for each jaxgen parameter, and the shape, transpose and
fused-slice conversions between one layer's tensor in each layout."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one jaxgen parameter lives in a Hugging Face checkpoint (per layer: `{i}` in the name).

    layout: "linear" a torch Linear weight (out, in); "conv1d" GPT-2's (in, out); "vector" a 1-D tensor;
        "matrix" a 2-D tensor stored as jaxgen stores it (embeddings).
    in_axes: how many leading jaxgen axes form the input side (w_o_nhd: 2, N and H).
    part: (index, count) when the tensor is one slice of a fused one along its output axis (c_attn).
    """

    name: str
    layout: str
    in_axes: int = 1
    part: tuple[int, int] | None = None


def tensor_map(family: str, cfg: ModelConfig) -> dict[str, Tensor]:
    """jaxgen parameter path ("layers/w_q_dnh") -> its Hugging Face tensor, for the params `cfg` has."""
    table = _gpt2_tensors() if family == "gpt2" else _llama_like_tensors()
    table["head_dv"] = Tensor("lm_head.weight", "linear")
    wanted = set(_param_paths(cfg))
    return {path: t for path, t in table.items() if path in wanted}


def _gpt2_tensors() -> dict[str, Tensor]:
    """Every parameter a GPT-2 model can have (`tensor_map` keeps those of the config); q, k and v are
    thirds of the fused c_attn."""
    h = "transformer.h.{i}."
    table = {
        "embed_vd": Tensor("transformer.wte.weight", "matrix"),
        "pos_embed_td": Tensor("transformer.wpe.weight", "matrix"),
        "final_norm/scale_d": Tensor("transformer.ln_f.weight", "vector"),
        "final_norm/bias_d": Tensor("transformer.ln_f.bias", "vector"),
        "layers/attn_norm/scale_d": Tensor(h + "ln_1.weight", "vector"),
        "layers/attn_norm/bias_d": Tensor(h + "ln_1.bias", "vector"),
        "layers/mlp_norm/scale_d": Tensor(h + "ln_2.weight", "vector"),
        "layers/mlp_norm/bias_d": Tensor(h + "ln_2.bias", "vector"),
        "layers/w_o_nhd": Tensor(h + "attn.c_proj.weight", "conv1d", in_axes=2),
        "layers/b_o_d": Tensor(h + "attn.c_proj.bias", "vector"),
        "layers/mlp/w_up_df": Tensor(h + "mlp.c_fc.weight", "conv1d"),
        "layers/mlp/b_up_f": Tensor(h + "mlp.c_fc.bias", "vector"),
        "layers/mlp/w_down_fd": Tensor(h + "mlp.c_proj.weight", "conv1d"),
        "layers/mlp/b_down_d": Tensor(h + "mlp.c_proj.bias", "vector"),
    }
    for j, (w, b) in enumerate((("w_q_dnh", "b_q_nh"), ("w_k_dkh", "b_k_kh"), ("w_v_dkh", "b_v_kh"))):
        table[f"layers/{w}"] = Tensor(h + "attn.c_attn.weight", "conv1d", part=(j, 3))
        table[f"layers/{b}"] = Tensor(h + "attn.c_attn.bias", "vector", part=(j, 3))
    return table


def _llama_like_tensors() -> dict[str, Tensor]:
    """Every parameter a Llama, Mistral, Qwen2 or Gemma model can have (`tensor_map` keeps those of the config)."""
    h = "model.layers.{i}."
    table = {
        "embed_vd": Tensor("model.embed_tokens.weight", "matrix"),
        "final_norm/scale_d": Tensor("model.norm.weight", "vector"),
        "layers/attn_norm/scale_d": Tensor(h + "input_layernorm.weight", "vector"),
        "layers/mlp_norm/scale_d": Tensor(h + "post_attention_layernorm.weight", "vector"),
        "layers/w_o_nhd": Tensor(h + "self_attn.o_proj.weight", "linear", in_axes=2),
        "layers/b_o_d": Tensor(h + "self_attn.o_proj.bias", "vector"),
    }
    for x, kind in (("q", "nh"), ("k", "kh"), ("v", "kh")):
        table[f"layers/w_{x}_d{kind}"] = Tensor(h + f"self_attn.{x}_proj.weight", "linear")
        table[f"layers/b_{x}_{kind}"] = Tensor(h + f"self_attn.{x}_proj.bias", "vector")
    mlp = (("gate", "w_gate_df", "b_gate_f"), ("up", "w_up_df", "b_up_f"), ("down", "w_down_fd", "b_down_d"))
    for x, w, b in mlp:
        table[f"layers/mlp/{w}"] = Tensor(h + f"mlp.{x}_proj.weight", "linear")
        table[f"layers/mlp/{b}"] = Tensor(h + f"mlp.{x}_proj.bias", "vector")
    return table


def _param_paths(cfg: ModelConfig) -> dict[str, model.ParamSpec]:
    is_spec = lambda x: isinstance(x, model.ParamSpec)
    flat = jax.tree_util.tree_flatten_with_path(model.param_specs(cfg), is_leaf=is_spec)
    return {"/".join(k.key for k in path): spec for path, spec in flat[0]}


def _hf_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of one layer's tensor, given jaxgen's per-layer shape."""
    count = t.part[1] if t.part else 1
    if t.layout == "matrix":
        return shape
    if t.layout == "vector":
        return (math.prod(shape) * count,)
    fan_in, fan_out = math.prod(shape[: t.in_axes]), math.prod(shape[t.in_axes :]) * count
    return (fan_out, fan_in) if t.layout == "linear" else (fan_in, fan_out)


def _to_jaxgen(t: Tensor, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if t.layout == "linear":
        x = x.T
    if t.part:
        x = np.split(x, t.part[1], axis=-1)[t.part[0]]
    return x.reshape(shape)


def _to_hf(t: Tensor, x: np.ndarray) -> np.ndarray:
    """One layer's jaxgen array as its (part of the) Hugging Face tensor."""
    if t.layout == "matrix":
        return x
    if t.layout == "vector":
        return x.reshape(-1)
    x = x.reshape(math.prod(x.shape[: t.in_axes]), -1)
    return np.ascontiguousarray(x.T) if t.layout == "linear" else x
