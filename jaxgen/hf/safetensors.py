"""Reading safetensors weights: a memory-mapped file reader whose header is checked against the file,
and a folder's single or sharded (model.safetensors.index.json) files, each kept inside the folder."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxgen.hf.config import HFError, _fail

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

    def check(self, name: str, expected: tuple[int, ...], path: str, sized_by: str = "") -> str:
        """The stored name of tensor `name`, HFError when it is missing or not of the `expected` shape
        (`sized_by`: the config.json fields that set that shape, for the message)."""
        stored = self.resolve(name)
        if stored is None:
            why = f"jaxgen {path}; {sized_by}" if sized_by else f"jaxgen {path}"
            raise _fail(self.folder, f"tensor {name!r} ({why}) is missing from the {self.family} checkpoint")
        shape = self.where[stored].shape(stored)
        if shape != expected:
            raise _fail(
                self.folder,
                f"tensor {name!r} has shape {shape}, but config.json implies {expected} (jaxgen {path}"
                + (f"; {sized_by})" if sized_by else ")"),
            )
        return stored

    def get(self, name: str, expected: tuple[int, ...], path: str) -> np.ndarray:
        stored = self.check(name, expected, path)
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
