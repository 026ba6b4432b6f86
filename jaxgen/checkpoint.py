"""Checkpoints with orbax: async saves, keep-last-K, resume from the latest, restore onto any mesh.

A run folder is self-describing:
    <run_dir>/config.yaml       the full config the run used
    <run_dir>/tokenizer.json    its tokenizer
    <run_dir>/checkpoints/<step>/{state,data}   train state and the data iterator's position
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxgen import model
from jaxgen.config import CheckpointConfig, Config, MeshConfig, load_config
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig = CheckpointConfig()):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, cleanup_tmp_directories=True, enable_async_checkpointing=True
        )
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Starts an async save; returns once the arrays are copied off the devices."""
        args = {"state": ocp.args.StandardSave(state)}
        if data_state is not None:
            args["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int, target, with_data: bool = True):
        """Restores onto `target`'s shapes and shardings (any mesh); returns (state, data_state)."""
        abstract = jax.tree.map(_abstract, target)
        args = {"state": ocp.args.StandardRestore(abstract)}
        if with_data and (self.directory / str(step) / "data").exists():
            args["data"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out.get("data") if "data" in args else None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if hasattr(x, "sharding") else x


def load_run(run_dir: str | Path, mesh=None, step: int | None = None):
    """Config, tokenizer and float32 params of a run folder's latest (or given) checkpoint.

    The params are placed with the model's shardings on `mesh` (default: all local devices on data).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a jaxgen run folder (no config.yaml); train.py writes one")
    cfg: Config = load_config(run_dir / "config.yaml")
    tokenizer = Tokenizer.from_folder(run_dir)
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint yet")
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    shardings = model.param_shardings(cfg.model, mesh)
    abstract = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    item = {"params": abstract}
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    restored = ckpt.manager.restore(step, args=ocp.args.Composite(state=args))
    ckpt.close()
    return cfg, tokenizer, restored["state"]["params"]


def load_model(path: str | Path, mesh=None, step: int | None = None):
    """(ModelConfig, Tokenizer, params) of a jaxgen run folder or a local Hugging Face model folder."""
    from jaxgen import hf

    path = Path(path)
    if (path / "config.yaml").exists():
        cfg, tokenizer, params = load_run(path, mesh, step)
        return cfg.model, tokenizer, params
    if hf.is_hf_folder(path):
        cfg, tokenizer, params = hf.load_pretrained(path, mesh)
        if tokenizer is None:
            raise FileNotFoundError(f"{path} has no tokenizer.json; jaxgen needs one to read and write text")
        return cfg, tokenizer, params
    raise FileNotFoundError(
        f"{path} is neither a jaxgen run folder (config.yaml, written by train.py) nor a Hugging Face model "
        "folder (config.json and *.safetensors)"
    )
