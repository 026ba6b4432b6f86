"""Import: a Hugging Face folder's config, tokenizer and weights into jaxgen, each parameter placed into
its sharding as it is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import MeshConfig, ModelConfig
from jaxgen.hf.config import read_config
from jaxgen.hf.safetensors import _Checkpoint
from jaxgen.hf.weights import _hf_shape, _param_paths, _per_tensor_shape, _to_jaxgen, tensor_map
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` looks like a Hugging Face model folder: config.json beside a *.safetensors file."""
    path = Path(path)
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


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
        shape = _per_tensor_shape(t, path, spec.shape)
        expected = _hf_shape(t, shape)
        host = np.empty(spec.shape, np.float32)
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


def load_pretrained(folder: str | Path, mesh=None, dtype: str = "float32"):
    """(ModelConfig, Tokenizer, params) of a Hugging Face folder; `dtype` is the compute dtype."""
    folder = Path(folder)
    family, cfg = read_config(folder)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").exists() else None
    return cfg, tokenizer, load_params(folder, cfg, family, mesh)
