"""Hugging Face checkpoints: import a local model folder into jaxgen, and export jaxgen params to one.

    cfg, tokenizer, params = load_pretrained("path/to/folder", mesh)   # config.json + *.safetensors
    save_pretrained("out/folder", params, cfg, tokenizer)              # transformers loads it back

Supported families (FAMILIES): GPT-2, Llama (Llama 3 rope scaling included), Mistral (sliding window),
Qwen2 (q/k/v biases) and Gemma (first generation: GeGLU, scaled embeddings, (1 + scale) RMSNorm).
Nothing is downloaded: a folder is what `save_pretrained` or `huggingface-cli download` left on disk.

Weights are read tensor by tensor from memory-mapped safetensors files (single or sharded with
model.safetensors.index.json) and each jaxgen parameter is placed straight into its sharding, so
beside the placed model the host holds one stacked parameter (and briefly device_put's copy of it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.sharding import make_mesh
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


# --- config.json <-> ModelConfig -------------------------------------------------------------------


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


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


# --- tensor names ----------------------------------------------------------------------------------


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
    if family == "gpt2":
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
    else:
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
    table["head_dv"] = Tensor("lm_head.weight", "linear")
    wanted = set(_param_paths(cfg))
    return {path: t for path, t in table.items() if path in wanted}


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


# --- reading safetensors ---------------------------------------------------------------------------

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


_MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers too


class _SafetensorsFile:
    """A memory-mapped .safetensors file. Reading it directly (its format is an 8-byte header length,
    a JSON header of dtype/shape/offsets, then raw little-endian data) gives bfloat16 through ml_dtypes,
    which safetensors' numpy loader refuses, and copies nothing until a tensor is converted.

    The header is checked against the file before any byte is read through it: a truncated or hostile
    file is an HFError naming the file (and the tensor), never a numpy error or garbage weights."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        if size < 8:
            raise self._error(f"{size} bytes, too short for the 8-byte header length (truncated?)")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise self._error(
                    f"header length {n} bytes, but {size - 8} bytes follow it and at most {_MAX_HEADER_BYTES} "
                    "are allowed (truncated, or not a safetensors file)"
                )
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise self._error(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._error(f"header is a JSON {type(header).__name__}, not an object of tensors")
        header.pop("__metadata__", None)
        self.header, self.offset, self.data_bytes = header, 8 + n, size - 8 - n
        empty = self.data_bytes == 0  # np.memmap refuses an empty range
        self.data = np.empty(0, np.uint8) if empty else np.memmap(path, np.uint8, mode="r", offset=self.offset)

    def _error(self, what: str, name: str | None = None) -> HFError:
        return HFError(f"{self.path}: {what}" if name is None else f"{self.path}: tensor {name!r} {what}")

    def _info(self, name: str) -> tuple[type, tuple[int, ...], int, int]:
        """A tensor's (dtype, shape, begin, end), each checked against the file's data bytes."""
        info = self.header.get(name)
        if not isinstance(info, dict):
            raise self._error("is not in this file" if info is None else f"has entry {info!r}, not an object", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise self._error(f"has dtype {dtype!r}, which jaxgen cannot read; readable: {', '.join(_DTYPES)}", name)
        if not _naturals(shape):
            raise self._error(f"has shape {shape!r}: expected a list of non-negative integers", name)
        if not (_naturals(offsets) and len(offsets) == 2):
            raise self._error(f"has data_offsets {offsets!r}: expected [begin, end], non-negative integers", name)
        begin, end = offsets
        if not begin <= end <= self.data_bytes:
            raise self._error(
                f"has data_offsets [{begin}, {end}], outside the {self.data_bytes} data bytes after the header "
                "(truncated file?); allowed: 0 <= begin <= end <= data bytes",
                name,
            )
        nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != nbytes:
            raise self._error(
                f"has shape {tuple(shape)} of {dtype} ({nbytes} bytes), but data_offsets [{begin}, {end}] "
                f"hold {end - begin} bytes",
                name,
            )
        return _DTYPES[dtype], tuple(shape), begin, end

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name)[1]

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._info(name)
        return self.data[begin:end].view(dtype).reshape(shape)


def _naturals(x) -> bool:
    """A JSON list of non-negative integers (booleans excluded)."""
    return isinstance(x, list) and all(type(v) is int and v >= 0 for v in x)


def _inside(folder: Path, name: str, source: str) -> Path:
    """`folder / name`, refused unless it stays inside the folder once `..` and symlinks are resolved.
    One exception: a Hugging Face hub cache snapshot (`.../snapshots/<rev>/`) links its files to
    `../../blobs/`, the cache's own store, as `huggingface-cli download` leaves them."""
    root = folder.resolve()
    lexical = Path(os.path.normpath(root / name))  # `..` in the name itself, before any symlink
    path = (root / name).resolve()
    hub_blob = root.parent.name == "snapshots" and path.is_relative_to(root.parent.parent / "blobs")
    if Path(name).is_absolute() or not lexical.is_relative_to(root) or not (path.is_relative_to(root) or hub_blob):
        raise HFError(
            f"{folder}: file {name!r} ({source}) resolves to {path}, outside the model folder; "
            "weights are only read from files inside it"
        )
    if not path.is_file():
        raise HFError(f"{folder}: file {name!r} ({source}) does not exist or is not a regular file")
    return folder / name


class _Checkpoint:
    """The tensors of a folder's single or sharded (index.json) safetensors files, by name."""

    def __init__(self, folder: Path, family: str):
        self.folder, self.family = folder, family
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = _weight_map(index)
            first = {}  # a tensor that names each file, for the error message
            for name, f in weight_map.items():
                first.setdefault(f, name)

            def opened(f: str) -> _SafetensorsFile:
                return _SafetensorsFile(_inside(folder, f, f"{index.name} maps tensor {first[f]!r} to it"))

            files = {f: opened(f) for f in sorted(first)}
            self.where = {name: files[f] for name, f in weight_map.items()}
        else:
            paths = sorted(folder.glob("*.safetensors"))
            if not paths:
                raise _fail(folder, "no *.safetensors file (pytorch_model.bin is not read: convert it first)")
            files = [_SafetensorsFile(_inside(folder, p.name, "matched *.safetensors")) for p in paths]
            self.where = {name: f for f in files for name in f.header}

    def resolve(self, name: str) -> str | None:
        """The stored name: original GPT-2 files drop the `transformer.` prefix."""
        if name in self.where:
            return name
        short = name.removeprefix("transformer.")
        return short if short in self.where else None

    def get(self, name: str, expected: tuple[int, ...], path: str) -> np.ndarray:
        stored = self.resolve(name)
        if stored is None:
            raise _fail(self.folder, f"tensor {name!r} (jaxgen {path}) is missing from the {self.family} checkpoint")
        shape = self.where[stored].shape(stored)
        if shape != expected:
            raise _fail(
                self.folder, f"tensor {name!r} has shape {shape}, but config.json implies {expected} (jaxgen {path})"
            )
        return self.where[stored].get(stored)


def _weight_map(index: Path) -> dict[str, str]:
    """The tensor -> file map of a model.safetensors.index.json, its shape checked."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as e:  # not JSON, or JSON but not an object
        raise HFError(f"{index}: not a JSON object with a weight_map ({e})") from None
    if not isinstance(weight_map, dict):
        raise HFError(f"{index}: weight_map is {type(weight_map).__name__}, expected an object of tensor -> file")
    for name, f in weight_map.items():
        if not (isinstance(f, str) and f):
            raise HFError(f"{index}: weight_map maps tensor {name!r} to {f!r}, expected a file name in the folder")
    return weight_map


# --- import and export -----------------------------------------------------------------------------


def load_params(folder: str | Path, cfg: ModelConfig, family: str, mesh=None) -> dict:
    """Float32 params from a folder's safetensors, each placed into its sharding on `mesh` as read."""
    folder = Path(folder)
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    ckpt = _Checkpoint(folder, family)
    specs = _param_paths(cfg)
    shardings = dict(zip(specs, jax.tree.leaves(model.param_shardings(cfg, mesh)), strict=True))
    placed = {}
    for path, t in tensor_map(family, cfg).items():
        spec = specs[path]
        stacked = path.startswith("layers/")
        shape = spec.shape[1:] if stacked else spec.shape
        expected = _hf_shape(t, shape)
        if stacked:
            host = np.empty(spec.shape, np.float32)
            for i in range(cfg.num_layers):
                host[i] = _to_jaxgen(t, ckpt.get(t.name.format(i=i), expected, path), shape)
        else:
            host = _to_jaxgen(t, ckpt.get(t.name, expected, path), shape).astype(np.float32)
        # Wait for the transfer: device_put is asynchronous and keeps `host` alive until it is done,
        # so without this two stacked parameters could be on the host at once.
        placed[path] = jax.block_until_ready(jax.device_put(host, shardings[path]))
        del host
    return _unflatten(placed)


def _unflatten(flat: dict[str, jax.Array]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


def load_pretrained(folder: str | Path, mesh=None, dtype: str = "float32"):
    """(ModelConfig, Tokenizer, params) of a Hugging Face folder; `dtype` is the compute dtype."""
    folder = Path(folder)
    family, cfg = read_config(folder)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").exists() else None
    return cfg, tokenizer, load_params(folder, cfg, family, mesh)


def _hf_tensors(params: dict, cfg: ModelConfig, family: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every Hugging Face tensor, fused ones assembled, one layer at a time."""
    table = tensor_map(family, cfg)
    fused: dict[str, list] = {}
    for path, t in table.items():
        stacked = path.startswith("layers/")
        for i in range(cfg.num_layers) if stacked else [None]:
            x = np.asarray(jax.device_get(_lookup(params, path, i)), np.float32)
            name = t.name.format(i=i)
            if t.part is None:
                yield name, _to_hf(t, x)
                continue
            parts = fused.setdefault(name, [None] * t.part[1])
            parts[t.part[0]] = _to_hf(t, x)
            if all(p is not None for p in parts):
                yield name, np.concatenate(fused.pop(name), axis=-1)


def _lookup(params: dict, path: str, layer: int | None):
    """One parameter (one layer's slice of it): layers may be stacked or a list (`unstack_layers`)."""
    node = params
    keys = path.split("/")
    for key in keys:
        node = node[key]
        if key == "layers" and isinstance(node, list):
            node, layer = node[layer], None
    return node if layer is None else node[layer]


def save_pretrained(
    folder: str | Path, params: dict, cfg: ModelConfig, tokenizer: Tokenizer | None = None, max_shard_bytes: int = 2**31
) -> Path:
    """Writes config.json, generation_config.json, float32 safetensors (sharded with an index.json when
    over `max_shard_bytes`) and the tokenizer: a folder transformers' `from_pretrained` loads as is."""
    family = family_of(cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous export's shards would be read beside the new ones
    # Each shard is written as soon as it is full (host memory: one shard); the final names carry the
    # shard count, so they are given once it is known.
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        path = folder / f"model-{len(written) + 1:05d}.partial.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, x in _hf_tensors(params, cfg, family):
        if shard and sum(v.nbytes for v in shard.values()) + x.nbytes > max_shard_bytes:
            flush()
        shard[name] = np.ascontiguousarray(x)
        total += x.nbytes
    flush()
    weight_map = {}
    for k, (path, names) in enumerate(written):
        final = "model.safetensors" if len(written) == 1 else f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / final)
        weight_map |= {name: final for name in names}
    if len(written) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, family, tokenizer), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_folder(folder)
        gen = {"eos_token_id": list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id}
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return folder
