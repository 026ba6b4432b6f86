"""`Config`, a whole run (every section), and the config files: `load_config` and `save_config` for
training, `load_serve_config` for serve.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxgen.config.base import (
    ConfigError,
    apply_overrides,
    build,
    check,
    check_types,
    field_names,
    plain,
    read_yaml,
    set_key,
)
from jaxgen.config.devices import DistributedConfig, MeshConfig
from jaxgen.config.model import ModelConfig
from jaxgen.config.rl import RLConfig
from jaxgen.config.serve import ServeCommandConfig, ServeConfig
from jaxgen.config.train import (
    CheckpointConfig,
    DataConfig,
    DraftHeadConfig,
    OptimizerConfig,
    PreferenceConfig,
    TrainingConfig,
)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "run"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)  # read by rl.py only
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)  # training.objective dpo...
    draft: DraftHeadConfig = dataclasses.field(default_factory=DraftHeadConfig)  # draft.target: train a draft head

    def __post_init__(self):
        pairs, objective = self.data.source == "preference", self.training.objective
        check(pairs == (objective != "sft"), "training.objective", objective,
              "dpo, ipo or simpo with data.source=preference (pairs), sft with any other source")  # fmt: skip
        if pairs:
            check(self.training.grad_accum == 1, "training.grad_accum", self.training.grad_accum,
                  "1 with a preference objective (each step's pairs in one micro-batch)")  # fmt: skip
        if self.draft.target:
            check(objective == "sft" and self.training.init_from is None and not self.model.lora.rank,
                  "draft.target", self.draft.target, "a head for a frozen target: no init_from, LoRA or preference "
                  "objective beside it")  # fmt: skip
        if self.training.init_from is None and not self.draft.target:  # else `model` is replaced: checked once read
            self.check_seq_len()

    def check_seq_len(self, source: str = "") -> None:
        """data.seq_len fits the model's positions (`source`: where model.max_seq_len came from)."""
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            self.data.seq_len,
            f"at most model.max_seq_len={self.model.max_seq_len}{source}",
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(data: dict) -> Config:
    try:
        return build(Config, data or {})
    except TypeError as e:  # a wrong nesting, e.g. `model: 4`
        raise ConfigError(str(e)) from e


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Reads a YAML config (or the defaults when `path` is None) and applies dotted overrides."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
        data.setdefault("name", Path(path).stem)
        check_types(Config, data)  # its values, before the overrides replace some
    return config_from_dict(apply_overrides(data, list(overrides)))


def load_serve_config(
    path: str | Path | None = None, overrides: list[str] = (), settings: dict[str, Any] | None = None
) -> ServeCommandConfig:
    """What serve.py runs with. Later wins: the defaults, the YAML at `path` (top-level sections `serve` and
    `http`, both optional), the dotted `overrides`, then `settings` ({dotted key: value}, serve.py's flags)."""
    data = read_yaml(path) if path is not None else {}
    training = sorted(set(data) & (set(field_names(Config)) - set(field_names(ServeCommandConfig))))
    if training:
        raise ConfigError(f"{path} is a training config (it has {', '.join(training)}): serve.py reads a file "
                          "with serve and http sections, such as configs/serve.yaml")  # fmt: skip
    _check_layer(ServeCommandConfig, data)  # the file's values, before the overrides replace some
    data = apply_overrides(data, list(overrides))
    settings = settings or {}
    replaced = {item.split("=", 1)[0].strip() for item in overrides} & set(settings)
    if replaced:  # an override a flag replaces is checked too, with every other setting as it will be
        _build_serve(_with(data, {k: v for k, v in settings.items() if k not in replaced}))
    return _build_serve(_with(data, settings))


def _with(data: dict, settings: dict[str, Any]) -> dict:
    """A copy of `data` with each dotted key of `settings` set."""
    data = apply_overrides(data, [])
    for key, value in settings.items():
        set_key(data, key, value, f"{key}={value!r}")
    return data


def _build_serve(data: dict) -> ServeCommandConfig:
    http = data.get("http")
    if isinstance(http, dict) and "api_key" in http:
        raise ConfigError("http.api_key is not read from config files (they get copied and committed): "
                          "pass --api-key or set JAXGEN_API_KEY")  # fmt: skip
    try:
        return build(ServeCommandConfig, data)
    except TypeError as e:  # a wrong nesting, e.g. `serve: 4`
        raise ConfigError(str(e)) from e


def _check_layer(cls, data: dict) -> None:
    """`check_types` of a file's data (an `http.api_key` in it is refused by name later, not as unknown)."""
    http = data.get("http")
    if isinstance(http, dict) and "api_key" in http:
        return
    check_types(cls, data)


def save_config(cfg: Config, path: str | Path) -> None:
    """Writes the YAML next to `path` and renames it over: a crash or a full disk never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    data = plain(cfg.to_dict())
    data.pop("distributed", None)  # how this run was started, not what it is: a reused file must not rejoin it
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
