"""Multi-LoRA serving, the host side: which adapters the engine holds and in which slot of its bank
(`jaxgen.model.lora.Bank`), and reading an adapter folder.

    registry = LoraRegistry(max_loras=4)
    ref = registry.reserve("sql", in_use={...})    # a free slot, and a prefix-cache key unique to this load
    registry.add(ref)                               # requests may name it from now on
    registry.resolve("sql")                         # -> LoraRef; an unknown name -> LoraNotFound
    registry.remove("sql")                          # new requests cannot name it; running ones finish

A slot stays taken while any live request uses it, even after its adapter was removed (the engine
passes the slots its requests hold as `in_use`), so unloading never changes what a running row computes.
Each load gets a new `key`: the prefix cache keys pages by it, so two adapters (or two loads of one
name) never share cached pages. No JAX here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

MAX_NAME = 256  # characters of an adapter's name
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # all that is read of an adapter folder
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")  # torch.save's formats: loading them can run code


class LoraError(ValueError):
    """An adapter that cannot be loaded (a bad folder, too high a rank, no free slot, a target the bank
    lacks): the client's error (HTTP 400). `field` names the request field at fault."""

    def __init__(self, message: str, field: str | None = "lora_name"):
        super().__init__(message)
        self.field = field


class LoraNotFound(LoraError):
    """A name no loaded adapter has (HTTP 404, `model_not_found`)."""


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """A loaded adapter: its name, its slot in the bank (1..max_loras; 0 is no adapter) and the key that
    keeps its prefix-cache pages apart from every other adapter's and from the base model's."""

    name: str
    slot: int
    key: bytes


class LoraRegistry:
    """Adapter names -> slots of the engine's bank; see the module docstring. Not thread-safe: the engine
    calls it with its lock held."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.loaded: dict[str, LoraRef] = {}
        self._loads = 0  # loads so far: each one's key is new

    def names(self) -> list[str]:
        return list(self.loaded)

    def resolve(self, name: str | None) -> LoraRef | None:
        """The adapter a request names (None: the base model); LoraNotFound for a name not loaded."""
        if name is None:
            return None
        ref = self.loaded.get(name)
        if ref is None:
            have = ", ".join(map(repr, self.loaded)) or "none"
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded (loaded: {have})", "model")
        return ref

    def reserve(self, name: str, in_use: set[int], replace: bool = False) -> LoraRef:
        """A slot for a new adapter `name`: one neither loaded nor used by a live request (`in_use`). With
        `replace`, the slot of a loaded `name` counts as free unless a live request uses it; `add` then swaps
        the new adapter in for the old one, which stays loaded until then (and when no slot is free)."""
        if self.max_loras == 0:
            raise LoraError("this engine serves no LoRA adapters: start it with serve.max_loras > 0")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
            raise LoraError(f"lora_name={name!r} is not allowed: a name of 1 to {MAX_NAME} printable characters")
        if name in self.loaded and not replace:
            raise LoraError(f"lora_name={name!r} is loaded already: unload it first (or load it in place)")
        taken = {r.slot for n, r in self.loaded.items() if n != name or not replace} | set(in_use)
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        if not free:
            draining = len(taken) - len(self.loaded)
            why = f" ({draining} held by unloaded adapters whose requests are still running)" if draining else ""
            raise LoraError(
                f"cannot load lora_name={name!r}: {len(self.loaded)} adapters are loaded and every one of the "
                f"serve.max_loras={self.max_loras} slots is taken{why}; unload one first"
            )
        self._loads += 1
        return LoraRef(name, free[0], f"lora:{self._loads}:{name}".encode())

    def add(self, ref: LoraRef) -> None:
        """Requests may name `ref.name` from now on (in place of an adapter of that name loaded before)."""
        self.loaded[ref.name] = ref

    def remove(self, name: str) -> LoraRef:
        """Unloads `name` (LoraNotFound when not loaded): new requests cannot name it; those using it finish."""
        ref = self.resolve(name)
        del self.loaded[name]
        return ref


def read_adapter_folder(folder: str | Path, cfg) -> tuple[dict, float]:
    """(adapters in `jaxgen.model.lora`'s layout, their scale alpha / rank) of a PEFT adapter folder
    (`adapter_config.json` + `adapter_model.safetensors`, read by `jaxgen.hf.peft`); LoraError naming the
    folder and what is wrong with it. A pickle (adapter_model.bin, .pt) is never read: unpickling runs code."""
    path = Path(folder)
    if not path.is_dir():
        raise LoraError(f"lora_path={str(folder)!r} is not a folder", "lora_path")
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            pickles = sorted(p.name for p in path.glob("adapter_model.*") if p.suffix in PICKLE_SUFFIXES)
            why = (
                f" (it holds {', '.join(pickles)}: a pickle, never read, as loading one can run code)"
                if pickles
                else ""
            )
            raise LoraError(
                f"lora_path={str(folder)!r} has no {name}{why}; a PEFT adapter folder of {' + '.join(ADAPTER_FILES)} "
                "is expected (peft's save_pretrained writes safetensors by default)", "lora_path",
            )  # fmt: skip
    try:
        from jaxgen.hf.peft import read_peft_adapter  # (safetensors and the mapping only when a folder is read)
    except ImportError as e:  # pragma: no cover - the PEFT reader ships with jaxgen
        raise LoraError(f"cannot read PEFT folders here: {e}", "lora_path") from None
    try:
        adapters, lora_cfg = read_peft_adapter(path, cfg)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise LoraError(f"lora_path={str(folder)!r} is not an adapter for this model: {e}", "lora_path") from None
    return adapters, float(lora_cfg.scale)


def folder_in_root(folder: str, root: str) -> Path | None:
    """`folder` (relative to `root`, or absolute) resolved, when it and the files an adapter load reads
    (ADAPTER_FILES) lie inside `root` once every symlink and `..` is resolved; None when any lies outside."""
    if "\0" in folder:  # no file has such a name (os.path refuses it with a ValueError)
        return None
    base = Path(os.path.realpath(root))
    path = Path(os.path.realpath(os.path.join(base, folder)))
    reads = [path, *(Path(os.path.realpath(path / name)) for name in ADAPTER_FILES)]
    return path if all(p.is_relative_to(base) for p in reads) else None
