"""Export: jaxgen params as a folder transformers' `from_pretrained` loads as is (config.json,
generation_config.json, float32 safetensors sharded with an index.json, the tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxgen.config import ModelConfig
from jaxgen.hf.config import family_of, hf_config
from jaxgen.hf.weights import _to_hf, tensor_map
from jaxgen.tokenizer import Tokenizer


def _hf_tensors(params: dict, cfg: ModelConfig, family: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every Hugging Face tensor, fused ones assembled, one layer at a time."""
    table = tensor_map(family, cfg)
    fused: dict[str, list] = {}
    for path, t in table.items():
        for name, index in t.names(cfg, path):
            x = np.asarray(jax.device_get(_lookup(params, path, index)), np.float32)
            if t.part is None:
                yield name, _to_hf(t, x)
                continue
            parts = fused.setdefault(name, [None] * len(t.part[1]))
            parts[t.part[0]] = _to_hf(t, x)
            if all(p is not None for p in parts):
                out_axis = 0 if t.layout == "linear" else -1  # torch Linear is (out, in)
                yield name, np.concatenate(fused.pop(name), axis=out_axis)


def _lookup(params: dict, path: str, index: tuple):
    """One checkpoint tensor's slice of a parameter (`index`: layer, then expert); layers may be
    stacked or a list (`unstack_layers`)."""
    node = params
    for key in path.split("/"):
        node = node[key]
        if key == "layers" and isinstance(node, list):
            node, index = node[index[0]], index[1:]
    return node[index] if index else node


def save_pretrained(
    folder: str | Path, params: dict, cfg: ModelConfig, tokenizer: Tokenizer | None = None, max_shard_bytes: int = 2**31
) -> Path:
    """Writes config.json, generation_config.json, float32 safetensors (sharded with an index.json when
    over `max_shard_bytes`) and the tokenizer: a folder transformers' `from_pretrained` loads as is."""
    from jaxgen.model import layout, quant

    if quant.is_quantized(params):
        raise ValueError("these params hold int8 weights (quantize=int8): export the float checkpoint they came from")
    params = layout.train_layout(params)  # decoding's output-major weights (e.g. an LLM's) as trained
    family = family_of(cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous export's shards would be read beside the new ones
    written, total = _write_shards(folder, _hf_tensors(params, cfg, family), max_shard_bytes)
    _name_shards(folder, written, total)
    _write_json(folder / "config.json", hf_config(cfg, family, tokenizer))
    if tokenizer is not None:
        tokenizer.save_folder(folder)
        gen = {"eos_token_id": list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id}
        _write_json(folder / "generation_config.json", gen)
    return folder


def _write_shards(
    folder: Path, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int
) -> tuple[list[tuple[Path, list[str]]], int]:
    """(partial shard path, its tensor names) of each shard written, and the total bytes of the tensors.
    Each shard is written as soon as it is full (host memory: one shard); the final names carry the
    shard count, so `_name_shards` gives them once it is known."""
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        path = folder / f"model-{len(written) + 1:05d}.partial.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, x in tensors:
        if shard and sum(v.nbytes for v in shard.values()) + x.nbytes > max_shard_bytes:
            flush()
        shard[name] = np.ascontiguousarray(x)
        total += x.nbytes
    flush()
    return written, total


def _name_shards(folder: Path, written: list[tuple[Path, list[str]]], total: int) -> None:
    """Renames the partial shards to model.safetensors, or model-0000k-of-0000n.safetensors beside an index."""
    weight_map = {}
    for k, (path, names) in enumerate(written):
        final = "model.safetensors" if len(written) == 1 else f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / final)
        weight_map |= {name: final for name in names}
    if len(written) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
