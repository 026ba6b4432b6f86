"""The tensor names of a Hugging Face checkpoint for each jaxgen parameter, and the shape, transpose and
fused-slice conversions between one layer's tensor in each layout."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.hf.families import FAMILY


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one jaxgen parameter lives in a Hugging Face checkpoint (per layer: `{i}` in the name).

    layout: "linear" a torch Linear weight (out, in); "conv1d" GPT-2's (in, out); "vector" a 1-D tensor;
        "matrix" a 2-D tensor stored as jaxgen stores it (embeddings).
    in_axes: how many leading jaxgen axes form the input side (w_o_nhd: 2, N and H).
    part: (index, widths) when the tensor is slice `index` of a fused one whose output axis
        concatenates slices of these widths (GPT-2's c_attn, Phi-3's qkv_proj and gate_up_proj).
    experts: the jaxgen array has an expert axis after the layer axis, stored as one tensor per expert
        (`{e}` in the name), as Mixtral and Qwen3-MoE checkpoints do.
    """

    name: str
    layout: str
    in_axes: int = 1
    part: tuple[int, tuple[int, ...]] | None = None
    experts: bool = False

    def names(self, cfg: ModelConfig, path: str) -> list[tuple[str, tuple]]:
        """(checkpoint name, index into the jaxgen array) of every tensor behind this parameter."""
        if not path.startswith("layers/"):
            return [(self.name, ())]
        layers = range(cfg.num_layers)
        if self.experts:
            return [(self.name.format(i=i, e=e), (i, e)) for i in layers for e in range(cfg.num_experts)]
        return [(self.name.format(i=i), (i,)) for i in layers]


def tensor_map(family: str, cfg: ModelConfig) -> dict[str, Tensor]:
    """jaxgen parameter path ("layers/w_q_dnh") -> its Hugging Face tensor, for the params `cfg` has."""
    table = _gpt2_tensors(cfg) if FAMILY[family].layout == "gpt2" else _llama_like_tensors(family, cfg)
    table["head_dv"] = Tensor("lm_head.weight", "linear")
    wanted = set(_param_paths(cfg))
    return {path: t for path, t in table.items() if path in wanted}


def _gpt2_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
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
    widths = (cfg.d_model,) * 3
    for j, (w, b) in enumerate((("w_q_dnh", "b_q_nh"), ("w_k_dkh", "b_k_kh"), ("w_v_dkh", "b_v_kh"))):
        table[f"layers/{w}"] = Tensor(h + "attn.c_attn.weight", "conv1d", part=(j, widths))
        table[f"layers/{b}"] = Tensor(h + "attn.c_attn.bias", "vector", part=(j, widths))
    return table


_NORMS = {  # norm_placement -> jaxgen norm -> the Hugging Face module
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {
        "attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
    },
    "post": {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
}  # fmt: skip


def _llama_like_tensors(family: str, cfg: ModelConfig) -> dict[str, Tensor]:
    """Every parameter of the RoPE families (`tensor_map` keeps those of the config): Llama's names,
    with each family's norms, Phi-3's fused projections and the MoE families' experts."""
    h = "model.layers.{i}."
    table = {
        "embed_vd": Tensor("model.embed_tokens.weight", "matrix"),
        "final_norm/scale_d": Tensor("model.norm.weight", "vector"),
        "layers/w_o_nhd": Tensor(h + "self_attn.o_proj.weight", "linear", in_axes=2),
        "layers/b_o_d": Tensor(h + "self_attn.o_proj.bias", "vector"),
        "layers/q_norm_h": Tensor(h + "self_attn.q_norm.weight", "vector"),
        "layers/k_norm_h": Tensor(h + "self_attn.k_norm.weight", "vector"),
        "layers/q_norm_nh": Tensor(h + "self_attn.q_norm.weight", "vector"),
        "layers/k_norm_kh": Tensor(h + "self_attn.k_norm.weight", "vector"),
    }
    for ours, theirs in _NORMS[cfg.norm_placement].items():
        table[f"layers/{ours}/scale_d"] = Tensor(h + f"{theirs}.weight", "vector")
    qkv_widths = (cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.kv_heads * cfg.head_size)
    for j, (x, kind) in enumerate((("q", "nh"), ("k", "kh"), ("v", "kh"))):
        fused = FAMILY[family].fused
        name = h + ("self_attn.qkv_proj.weight" if fused else f"self_attn.{x}_proj.weight")
        table[f"layers/w_{x}_d{kind}"] = Tensor(name, "linear", part=(j, qkv_widths) if fused else None)
        table[f"layers/b_{x}_{kind}"] = Tensor(h + f"self_attn.{x}_proj.bias", "vector")
    mlp = (("gate", "w_gate_df", "b_gate_f"), ("up", "w_up_df", "b_up_f"), ("down", "w_down_fd", "b_down_d"))
    for x, w, b in mlp:
        table[f"layers/mlp/{w}"] = Tensor(h + f"mlp.{x}_proj.weight", "linear")
        table[f"layers/mlp/{b}"] = Tensor(h + f"mlp.{x}_proj.bias", "vector")
    if FAMILY[family].fused:  # gate then up, fused
        for j, w in enumerate(("w_gate_df", "w_up_df")):
            table[f"layers/mlp/{w}"] = Tensor(h + "mlp.gate_up_proj.weight", "linear", part=(j, (cfg.d_ff,) * 2))
    return table | _expert_tensors(FAMILY[family].experts)


def _expert_tensors(experts: str) -> dict[str, Tensor]:
    h = "model.layers.{i}."
    if experts == "mixtral":
        moe, names = h + "block_sparse_moe.", ("w1", "w3", "w2")
    elif experts == "qwen3_moe":
        moe, names = h + "mlp.", ("gate_proj", "up_proj", "down_proj")
    else:
        return {}
    table = {"layers/mlp/w_router_de": Tensor(moe + "gate.weight", "linear")}
    for ours, theirs in zip(("w_gate_edf", "w_up_edf", "w_down_efd"), names, strict=True):
        table[f"layers/mlp/{ours}"] = Tensor(moe + "experts.{e}." + theirs + ".weight", "linear", experts=True)
    return table


def _param_paths(cfg: ModelConfig) -> dict[str, model.ParamSpec]:
    is_spec = lambda x: isinstance(x, model.ParamSpec)
    flat = jax.tree_util.tree_flatten_with_path(model.param_specs(cfg), is_leaf=is_spec)
    return {"/".join(k.key for k in path): spec for path, spec in flat[0]}


def _per_tensor_shape(t: Tensor, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The jaxgen shape behind one checkpoint tensor: without the layer axis (and the expert axis)."""
    drop = (path.startswith("layers/")) + t.experts
    return shape[drop:]


def _hf_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of one tensor, given jaxgen's shape for it (`_per_tensor_shape`)."""
    if t.layout == "matrix":
        return shape
    if t.layout == "vector":
        return (sum(t.part[1]) if t.part else math.prod(shape),)
    fan_in, fan_out = math.prod(shape[: t.in_axes]), math.prod(shape[t.in_axes :])
    fan_out = sum(t.part[1]) if t.part else fan_out
    return (fan_out, fan_in) if t.layout == "linear" else (fan_in, fan_out)


def _to_jaxgen(t: Tensor, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if t.layout == "linear":
        x = x.T
    if t.part:
        index, widths = t.part
        start = sum(widths[:index])
        x = x[..., start : start + widths[index]]
    return x.reshape(shape)


def _to_hf(t: Tensor, x: np.ndarray) -> np.ndarray:
    """One layer's jaxgen array as its (part of the) Hugging Face tensor."""
    if t.layout == "matrix":
        return x
    if t.layout == "vector":
        return x.reshape(-1)
    x = x.reshape(math.prod(x.shape[: t.in_axes]), -1)
    return np.ascontiguousarray(x.T) if t.layout == "linear" else x
