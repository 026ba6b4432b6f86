"""Import: a Hugging Face folder's config, tokenizer and weights into jaxgen, each parameter placed into
its sharding as it is read."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.hf.config import HFError, read_config, size_fields
from jaxgen.hf.safetensors import _Checkpoint
from jaxgen.hf.weights import _hf_shape, _param_paths, _per_tensor_shape, _to_jaxgen, tensor_map
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` looks like a Hugging Face model folder: config.json beside a *.safetensors file."""
    path = Path(path)
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def load_params(folder: str | Path, cfg: ModelConfig, family: str, mesh=None, dtype="float32") -> dict:
    """Params held in `dtype` from a folder's safetensors, each placed into its sharding on `mesh` as read."""
    folder = Path(folder)
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    ckpt = _Checkpoint(folder, family)
    specs = _param_paths(cfg)
    shardings = dict(zip(specs, jax.tree.leaves(model.param_shardings(cfg, mesh)), strict=True))
    table = tensor_map(family, cfg)
    for path, t in table.items():  # every tensor's shape against config.json, before anything is allocated
        expected = _hf_shape(t, _per_tensor_shape(t, path, specs[path].shape))
        sized_by = size_fields(cfg, family, tuple(a or "positions" for a in specs[path].names))
        for name, _ in t.names(cfg, path):
            ckpt.check(name, expected, path, sized_by)
    placed = {}
    for path, t in table.items():
        spec = specs[path]
        shape = _per_tensor_shape(t, path, spec.shape)
        expected = _hf_shape(t, shape)
        host = np.empty(spec.shape, jax.numpy.dtype(dtype))
        for name, index in t.names(cfg, path):
            host[index] = _to_jaxgen(t, ckpt.get(name, expected, path), shape)
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


def load_pretrained(folder: str | Path, mesh=None, dtype: str = "float32", param_dtype: str = "float32"):
    """(ModelConfig, Tokenizer, params) of a Hugging Face folder; `dtype` is the compute dtype,
    `param_dtype` how the weights are held ("auto": see `checkpoint_dtype` and `inference_dtype`)."""
    folder = Path(folder)
    family, cfg = read_config(folder)
    param_dtype = inference_dtype(param_dtype, checkpoint_dtype(folder))
    if param_dtype == "bfloat16":  # bfloat16 weights compute in bfloat16, as the checkpoint's authors ran them
        dtype = "bfloat16"
    cfg = dataclasses.replace(cfg, dtype=dtype)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").exists() else None
    if tokenizer is not None:
        tokenizer.check_model_vocab(cfg.vocab_size, f"{folder}/config.json")
    check_memory(cfg, family, param_dtype, f"{folder}/config.json", mesh)
    return cfg, tokenizer, load_params(folder, cfg, family, mesh, param_dtype)


def check_memory(cfg: ModelConfig, family: str, dtype: str, where: str, mesh=None) -> None:
    """HFError naming the size fields when the weights alone would not fit in the memory they go to
    (the devices', else the host's): checked before anything is allocated, since a config.json with
    vocab_size 10**12 or 10**6 layers otherwise ends in a MemoryError, or an hour of swapping."""
    count = sum(math.prod(spec.shape) for spec in _param_paths(cfg).values())
    need = count * np.dtype(jax.numpy.dtype(dtype)).itemsize
    have = _memory_bytes(mesh.devices.flat if mesh is not None else jax.devices())
    if need > have:
        raise HFError(
            f"{where}: the weights would take {need / 2**30:,.1f} GiB ({count:,} parameters in {dtype}; "
            f"{size_fields(cfg, family)}), more than the {have / 2**30:,.1f} GiB of memory here"
        )


def _memory_bytes(devices) -> int:
    """The memory the devices report (GPU, TPU), else the host's physical memory (CPU)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in devices if d.platform != "cpu"]
    if limits and all(limits):
        return sum(limits)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpoint_dtype(folder: str | Path) -> str:
    """The dtype a Hugging Face folder's weights were saved in (config.json's dtype / torch_dtype), as
    one jaxgen holds: bfloat16 (also for float16) or float32."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    return "bfloat16" if saved in ("bfloat16", "float16") else "float32"


def inference_dtype(requested: str, saved: str, backend: str | None = None) -> str:
    """How serving holds weights: `requested` (float32, bfloat16), or for "auto" the checkpoint's own
    dtype on a GPU or TPU and float32 on CPU, where XLA converts a bfloat16 matrix whole at every
    product instead of fusing the conversion (13-15x slower decode at batch 1: docs/performance.md, "CPU facts")."""
    if requested != "auto":
        return requested
    return "float32" if (backend or jax.default_backend()) == "cpu" else saved
