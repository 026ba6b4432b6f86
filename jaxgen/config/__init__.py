"""Configuration: nested frozen dataclasses, loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/tiny.yaml", ["model.num_layers=4", "training.steps=50"])
    serving = load_serve_config("configs/serve.yaml", ["serve.chunk_steps=16"])  # what serve.py reads

Unknown keys and bad values raise `ConfigError` naming the key, the value seen and what is allowed.
Every check runs here, before anything is compiled.

base.py     ConfigError, the checks (one for every Literal field), YAML data to dataclasses, dotted overrides
model.py    ModelConfig: the network
train.py    DataConfig, OptimizerConfig, TrainingConfig, CheckpointConfig, PreferenceConfig: what a training run reads
devices.py  MeshConfig and DistributedConfig: the device mesh and several processes
serve.py    ServeConfig, HttpConfig, ServeCommandConfig: the engine and the HTTP server (serve.py's file)
rl.py       RLConfig: what rl.py reads (the task and reward, rollouts, the policy-gradient loss)
run.py      Config (a whole run) and the files: load_config, save_config, load_serve_config
"""

from jaxgen.config.base import ConfigError, apply_overrides
from jaxgen.config.devices import DistributedConfig, MeshConfig
from jaxgen.config.model import LoraConfig, ModelConfig
from jaxgen.config.rl import RLConfig
from jaxgen.config.run import Config, config_from_dict, load_config, load_serve_config, save_config
from jaxgen.config.serve import HttpConfig, ServeCommandConfig, ServeConfig
from jaxgen.config.train import (
    CheckpointConfig,
    DataConfig,
    DraftHeadConfig,
    OptimizerConfig,
    PreferenceConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "DraftHeadConfig",
    "HttpConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PreferenceConfig",
    "RLConfig",
    "ServeCommandConfig",
    "ServeConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "load_serve_config",
    "save_config",
]  # fmt: skip
