"""PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors) <-> jaxgen adapters.

    write_peft_adapter("out/adapter", adapters, cfg)        # peft.PeftModel.from_pretrained(hf_model, folder)
    adapters, lora_cfg = read_peft_adapter("in/adapter", cfg)  # cfg: the base model's ModelConfig

jaxgen's adapters (`jaxgen.model.lora`) are {target: {"a_...": (L, *in, r), "b_...": (L, r, *out)}}; PEFT
stores per layer and module lora_A (r, in) and lora_B (out, r), named after the module of the base weight
("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"). The module of each target is the one
`weights.tensor_map` reads the base weight from, so every family jaxgen imports maps the same way.

Fused modules (GPT-2's c_attn holds q, k and v; Phi-3's qkv_proj and gate_up_proj) get one adapter: the
parts' A stacked on the rank axis and their B block-diagonal, rank (parts x r), with PEFT's rank_pattern and
alpha_pattern keeping alpha / r for that module; reading splits B's rows and gives each part the shared A.
Modules of different rank or scale (rank_pattern, alpha_pattern, use_rslora) read exactly: each B takes its
module's scale over the common one and is zero-padded to the largest rank.

DoRA (`use_dora`, jaxgen's `model.lora.dora`): each module also holds its magnitude, one per output row
("....q_proj.lora_magnitude_vector", (out,)), a fused module's the parts' in the order of its rows. Its
norm is of the fused weight's rows, and with B block-diagonal each row sees only its own part's A and B: the
same norms as jaxgen's per target.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxgen.config import ConfigError, LoraConfig, ModelConfig
from jaxgen.config.model import LORA_TARGETS
from jaxgen.hf.config import family_of
from jaxgen.hf.families import FAMILY
from jaxgen.hf.fields import Fields, HFError, read_object
from jaxgen.hf.safetensors import _SafetensorsFile
from jaxgen.hf.weights import Tensor, tensor_map
from jaxgen.model import lora

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names


@dataclasses.dataclass(frozen=True)
class _Module:
    """One Hugging Face module that carries an adapter: its name ({i}: the layer) and its targets in the
    order of its output rows, each with (first output row, rows)."""

    name: str
    parts: tuple[tuple[str, int, int], ...]
    n_in: int
    n_out: int  # rows of the whole (fused) weight

    @property
    def suffix(self) -> str:
        """The name after the layer index ("self_attn.q_proj"): PEFT's target_modules entry."""
        return self.name.split("{i}.", 1)[1]


def _sizes(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(fan in, fan out) of a target's product."""
    ins, outs = lora._product_axes(cfg)[target]
    return math.prod(x[0] for x in ins), math.prod(x[0] for x in outs)


def adapter_modules(cfg: ModelConfig, family: str, targets=LORA_TARGETS) -> dict[str, _Module]:
    """{module name: _Module} of the `targets` this model has (a target without a plain weight, such as
    the MLP of an MoE model, is left out)."""
    table = tensor_map(family, cfg)
    grouped: dict[str, list[tuple[str, Tensor]]] = {}
    for target in targets:
        t = table.get("/".join(lora.TARGET_PARAMS[target]))  # the base weight's Hugging Face tensor
        if t is not None and t.name.endswith(".weight") and "{i}." in t.name:
            grouped.setdefault(t.name.removesuffix(".weight"), []).append((target, t))
    modules = {}
    for name, members in grouped.items():
        n_in = _sizes(cfg, members[0][0])[0]
        widths = members[0][1].part[1] if members[0][1].part else (_sizes(cfg, members[0][0])[1],)
        parts = []
        for target, t in sorted(members, key=lambda m: m[1].part[0] if m[1].part else 0):
            index = t.part[0] if t.part else 0
            parts.append((target, sum(widths[:index]), widths[index]))
        modules[name] = _Module(name, tuple(parts), n_in, sum(widths))
    return modules


def write_peft_adapter(
    folder: str | Path, adapters: dict, cfg: ModelConfig, *, family: str | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:  # fmt: skip
    """Writes `adapters` ({target: {"a_...": (L, *in, r), "b_...": (L, r, *out)}}, cfg.lora's rank and alpha)
    as PEFT's adapter folder, float32, for the Hugging Face export of `cfg` (`family`, default `family_of`)."""
    import jax
    from safetensors.numpy import save_file

    if not cfg.lora.rank:
        raise ValueError("model.lora.rank=0: there are no adapters to write")
    if lora.is_dora(adapters) != cfg.lora.dora:
        held = "hold" if lora.is_dora(adapters) else "do not hold"
        raise ValueError(f"model.lora.dora={cfg.lora.dora}, but the adapters {held} DoRA magnitudes")
    family = family or family_of(cfg)
    r, scale = cfg.lora.rank, cfg.lora.scale
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), adapters)
    modules = adapter_modules(cfg, family, tuple(host))
    missing = sorted(set(host) - {p[0] for m in modules.values() for p in m.parts})
    if missing:
        raise HFError(f"model.lora.targets={missing} have no {family} module to export to (experts are not adapted)")
    for m in modules.values():  # DoRA rescales every row of a module: one left out would need the base's norms
        if cfg.lora.dora and sum(p[2] for p in m.parts) != m.n_out:
            raise HFError(
                f"DoRA on {family}'s {m.suffix} needs all of its parts targeted: model.lora.targets has "
                f"{', '.join(p[0] for p in m.parts)} of it"
            )
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for m in modules.values():
        k = len(m.parts)
        for i in range(cfg.num_layers):
            a_rows, b = [], np.zeros((m.n_out, k * r), np.float32)
            magnitude = np.zeros((m.n_out,), np.float32)
            for j, (target, start, rows) in enumerate(m.parts):
                a, b_part, m_part = (x if x is None else x[i] for x in lora.parts(host[target]))
                a_rows.append(a.reshape(m.n_in, r).T)
                b[start : start + rows, j * r : (j + 1) * r] = b_part.reshape(r, rows).T
                if m_part is not None:
                    magnitude[start : start + rows] = m_part.reshape(rows)
            name = _PREFIX + m.name.format(i=i)
            tensors[name + ".lora_A.weight"] = np.ascontiguousarray(np.concatenate(a_rows))
            tensors[name + ".lora_B.weight"] = b
            if cfg.lora.dora:
                tensors[name + ".lora_magnitude_vector"] = magnitude
        if k > 1:  # the fused module's rank is k r; its alpha keeps the scale alpha / r
            rank_pattern[m.suffix], alpha_pattern[m.suffix] = k * r, scale * k * r
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": cfg.lora.alpha,
        "target_modules": sorted(m.suffix for m in modules.values()), "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "use_dora": cfg.lora.dora,
        "fan_in_fan_out": FAMILY[family].layout == "gpt2",  # GPT-2's Conv1D weights are (in, out)
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base_model_name_or_path,
    }  # fmt: skip
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_peft_adapter(
    folder: str | Path, cfg: ModelConfig, *, family: str | None = None, mesh=None
) -> tuple[dict, LoraConfig]:
    """(adapters, LoraConfig) of a PEFT LoRA folder for the base model `cfg`: float32 host arrays of
    `jaxgen.model.lora`'s structure ({target: {"a_...": (L, *in, r), "b_...": (L, r, *out)}}), placed with
    `lora.lora_shardings` when `mesh` is given. HFError (one line) for what jaxgen cannot run as PEFT does."""
    folder = Path(folder)
    family = family or family_of(cfg)
    f = Fields(read_object(folder / CONFIG), str(folder / CONFIG))
    settings = _check_settings(f, family)
    if not (folder / WEIGHTS).exists():
        raise HFError(f"{folder} has no {WEIGHTS} (only safetensors adapters are read)")
    file = _SafetensorsFile(folder / WEIGHTS)
    tensors = {name: np.asarray(file.get(name), np.float32) for name in file.header}  # bfloat16 too
    modules = adapter_modules(cfg, family)
    per_target, scales = _per_target(_match(tensors, modules, cfg, str(folder / WEIGHTS)), modules, settings, folder)
    rank = max(r for r, _ in scales)
    uniform = len(set(scales)) == 1  # one rank and scale: kept as they are, else the config's scale
    common = scales[0][1] if uniform else settings.alpha / settings.r
    alpha = settings.alpha if uniform and (rank, common) == (settings.r, settings.alpha / settings.r) else common * rank
    try:
        targets = tuple(t for t in LORA_TARGETS if t in per_target)
        lora_cfg = LoraConfig(
            rank=rank, alpha=alpha, targets=targets, dora=settings.dora, base_dtype=cfg.lora.base_dtype
        )
        adapted = dataclasses.replace(cfg, lora=lora_cfg)
    except ConfigError as e:
        raise HFError(f"{folder / CONFIG}: {e}") from None
    adapters = _stack(per_target, adapted, common, settings.layers, folder)
    if mesh is not None:
        import jax

        adapters = jax.device_put(adapters, lora.lora_shardings(adapted, mesh))
    return adapters, lora_cfg


def _per_target(found: dict, modules: dict[str, _Module], settings: _Settings, folder: Path) -> tuple[dict, list]:
    """({target: {layer: (A (in, r_m), B (r_m, out), the module's scale, DoRA's magnitude (out,) or None)}},
    [(r_m, scale) per module]) of the file's (module, layer) pairs, each checked against the model and
    adapter_config.json."""
    per_target, scales = {}, []
    for (name, i), pair in sorted(found.items()):
        m, module = modules[name], name.format(i=i)
        a, b = pair.get("A"), pair.get("B")
        where = f"{folder / WEIGHTS}: {_PREFIX}{module}"
        if a is None or b is None:
            raise HFError(f"{where} has lora_{'A' if a is None else 'B'} missing (both are needed)")
        magnitude = _magnitude(pair.get("M"), settings, m, where)
        rank = a.shape[0] if a.ndim == 2 else -1
        if a.shape != (rank, m.n_in) or b.shape != (m.n_out, rank) or rank < 1:
            raise HFError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model: "
                f"allowed (r, {m.n_in}) and ({m.n_out}, r)"
            )
        if rank != settings.rank(module):
            raise HFError(f"{where}: lora_A has rank {rank}, but {CONFIG} says r={settings.rank(module)} for it")
        scales.append((rank, settings.scale(module, rank)))
        for target, start, rows in m.parts:  # a fused module's parts share its A
            part = None if magnitude is None else magnitude[start : start + rows]
            per_target.setdefault(target, {})[i] = (a.T, b[start : start + rows].T, scales[-1][1], part)
    if not per_target:
        raise HFError(f"{folder / WEIGHTS} holds no LoRA weights")
    return per_target, scales


def _magnitude(x, settings: _Settings, m: _Module, where: str):
    """DoRA's magnitude of one module (n_out,), checked: present exactly when use_dora says so."""
    if (x is None) == settings.dora:
        has = "has no lora_magnitude_vector" if x is None else "has a lora_magnitude_vector"
        raise HFError(f"{where} {has}, but {CONFIG} says use_dora={str(settings.dora).lower()}")
    if x is not None and x.shape != (m.n_out,):
        raise HFError(f"{where}: lora_magnitude_vector {tuple(x.shape)} does not fit this model: allowed ({m.n_out},)")
    return x


@dataclasses.dataclass(frozen=True)
class _Settings:
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    layers: tuple[int, ...] | None  # layers_to_transform: the others may have no weights
    dora: bool = False  # use_dora: each module has a magnitude vector

    def rank(self, module: str) -> int:
        """PEFT's rank of one module (its full name): rank_pattern's, else r."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def scale(self, module: str, rank: int) -> float:
        """PEFT's scaling of one module (its full name), whose lora_A has `rank` rows."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _pattern_key(patterns: dict, module: str) -> str | None:
    """The key of rank_pattern or alpha_pattern that applies to `module`, matched as PEFT does."""
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)


def _check_settings(f: Fields, family: str) -> _Settings:
    """adapter_config.json's settings, refusing those that jaxgen does not run as PEFT does."""
    if f.text("peft_type", "LORA") != "LORA":
        raise f.error("peft_type", f.data["peft_type"], "LORA (the only adapter type jaxgen reads)")
    if f.flag("lora_bias", False):
        raise f.error("lora_bias", True, "false (adapter biases are not implemented)")
    if f.text("bias", "none") != "none":
        raise f.error("bias", f.data["bias"], "none (trained biases are not implemented)")
    if f.flag("fan_in_fan_out", False) and family != "gpt2":
        raise f.error("fan_in_fan_out", True, f"false for {family} (true only for GPT-2's Conv1D weights)")
    for key in ("modules_to_save", "trainable_token_indices"):
        if f.data.get(key):
            raise f.error(key, f.data[key], "none (only LoRA weights are read, no full copies of modules)")
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = f.data.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(v, int | float) and v > 0 for v in value.values()):
            raise f.error(key, value, "an object of module name patterns to positive numbers")
        patterns[key] = value
    layers = f.data.get("layers_to_transform")
    layers = (layers,) if isinstance(layers, int) else tuple(layers) if layers is not None else None
    dora = f.flag("use_dora", False)
    if dora and layers is not None:  # a layer left out would need its magnitudes at the base's norms
        raise f.error("layers_to_transform", f.data["layers_to_transform"], "null with use_dora (every layer)")
    return _Settings(
        r=f.integer("r"), alpha=f.number("lora_alpha"), rslora=f.flag("use_rslora", False),
        rank_pattern=patterns["rank_pattern"], alpha_pattern=patterns["alpha_pattern"], layers=layers, dora=dora,
    )  # fmt: skip


def _match(tensors: dict, modules: dict[str, _Module], cfg: ModelConfig, where: str) -> dict:
    """{(module name, layer): {"A": array, "B": array, "M": DoRA's magnitude}} of the file's tensors; HFError
    for any other."""
    tail = r"\.lora_(?:([AB])\.weight|magnitude_vector)"
    patterns = [(re.compile(re.escape(name).replace(r"\{i\}", r"(\d+)") + tail), name) for name in modules]
    found: dict = {}
    for key, x in tensors.items():
        name = key.removeprefix(_PREFIX)
        hit = next(((m, n) for p, n in patterns if (m := p.fullmatch(name))), None)
        if hit is None or int(hit[0][1]) >= cfg.num_layers:
            allowed = ", ".join(m.suffix for m in modules.values())
            raise HFError(
                f"{where}: {key} is not an adapter jaxgen runs on this model: allowed lora_A/lora_B/"
                f"lora_magnitude_vector of {allowed}"
            )
        found.setdefault((hit[1], int(hit[0][1])), {})[hit[0][2] or "M"] = x
    return found


def _stack(per_target: dict, cfg: ModelConfig, common: float, layers, folder: Path) -> dict:
    """jaxgen's stacked adapters: each layer's B scaled by its module's scale over `common`, and A and B
    zero-padded to cfg.lora.rank; a layer without weights (outside layers_to_transform) is zeros."""
    out = {}
    r = cfg.lora.rank
    for target, specs in lora.lora_specs(cfg).items():
        (a_key, a_spec), (b_key, b_spec), *dora = sorted(specs.items())  # DoRA: ("m_..", its spec)
        a_all, b_all = np.zeros(a_spec.shape, np.float32), np.zeros(b_spec.shape, np.float32)
        m_all = np.zeros(dora[0][1].shape, np.float32) if dora else None
        for i in range(cfg.num_layers):
            if i not in per_target[target]:
                if layers is None or i in layers:
                    raise HFError(f"{folder / WEIGHTS} has no adapter for target {target} in layer {i}")
                continue
            a, b, s, magnitude = per_target[target][i]
            rank = a.shape[1]
            b = b if s == common else b * np.float32(s / common)
            a_all[i] = np.pad(a, ((0, 0), (0, r - rank))).reshape(a_spec.shape[1:])
            b_all[i] = np.pad(b, ((0, r - rank), (0, 0))).reshape(b_spec.shape[1:])
            if m_all is not None:
                m_all[i] = magnitude.reshape(m_all.shape[1:])
        out[target] = {a_key: a_all, b_key: b_all} | ({dora[0][0]: m_all} if dora else {})
    return out
