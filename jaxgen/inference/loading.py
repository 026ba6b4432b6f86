"""Loading a model for inference: a run folder's checkpoint, a Hugging Face folder, int8 weights and a
draft model, the one way serve.py, `LLM` and `generate` get theirs.

    load_run(run_dir)                      -> (Config, Tokenizer, params)     a train.py run folder (LoRA: merged)
    load_lora_run(run_dir)                 -> (Config, Tokenizer, base, adapters)  a LoRA run, unmerged
    load_model(path)                       -> (ModelConfig, Tokenizer, params) a run or Hugging Face folder
    load_draft(path, tokenizer)            -> (params, ModelConfig)           a draft for speculative decoding
    load_eagle_head(path, cfg, tokenizer)  -> eagle.Head or None              a head run or vLLM-layout folder
    load_head(run_dir)                     -> eagle.Head                      a head run (train.py draft.target=)
    load_for_serving(source, serve, mesh)  -> Loaded                          the above as `ServeConfig` says
    model_config(path)                     -> ModelConfig | None              read from the folder's config alone

Kept outside `jaxgen.training` so that serving imports no trainer, data pipeline or optimizer: only the
checkpoint reader (`jaxgen.training.checkpoint`, orbax) comes with it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxgen import hf
from jaxgen.config import Config, ConfigError, LoraConfig, MeshConfig, ModelConfig, ServeConfig, load_config
from jaxgen.hf.load import inference_dtype
from jaxgen.inference.budget import check_serving
from jaxgen.model import ParamSpec, eagle, lora, quant
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.checkpoint import Checkpointer, CheckpointError, restore_newest


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model ready for the engine: its config, tokenizer, params and draft model ((params, cfg) or None)."""

    cfg: ModelConfig
    tokenizer: Tokenizer
    params: dict
    draft: tuple | None = None


def load_for_serving(source, serve: ServeConfig, mesh=None, *, cfg=None, tokenizer=None, draft=None) -> Loaded:
    """The model `serve` asks for: `source` a run or Hugging Face folder (`load_model`, held in
    serve.param_dtype) or params given with their `cfg` and `tokenizer`; int8 weights with serve.quantize
    (a no-op on weights already int8), an EAGLE head's too (`eagle.quantized`); the draft model of
    serve.draft unless `draft` is given."""
    if isinstance(source, str | Path):
        found = model_config(source)
        if found is not None:  # checked before the weights load (and by the engine again, with the draft model)
            check_serving(found, serve, mesh=mesh)
        cfg, tokenizer, source = load_model(source, mesh, param_dtype=serve.param_dtype)
    if cfg is None or tokenizer is None:
        raise ValueError("params need cfg= and tokenizer= (or pass a run or Hugging Face folder)")
    if serve.quantize == "int8":
        source = quant.quantize_params(source, embedding=serve.quantize_embedding)
    if serve.draft is not None and draft is None:
        draft = load_eagle_head(serve.draft, cfg, tokenizer)
    if serve.draft is not None and draft is None:
        draft = load_draft(serve.draft, tokenizer, mesh, param_dtype=serve.param_dtype, quantize=serve.quantize,
                           quantize_embedding=serve.quantize_embedding)  # fmt: skip
    if serve.quantize == "int8" and isinstance(draft, eagle.Head):
        draft = eagle.quantized(draft)
    return Loaded(cfg, tokenizer, source, draft)


def load_weights(path: str | Path, serve: ServeConfig, cfg: ModelConfig, mesh=None) -> dict:
    """The weights of the run or Hugging Face folder `path` for an engine that serves `cfg` (a swap:
    `Engine.update_params`), held and quantized as `serve` says; ConfigError when the folder holds
    another model."""
    found, _, params = load_model(path, mesh, param_dtype=serve.param_dtype)
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(found, f.name), getattr(cfg, f.name)
        if b is not None and a != b:  # None: derived (head_dim) or the default (family); a folder may name it
            raise ConfigError(f"{path} holds another model: model.{f.name}={a!r} where the engine serves {b!r}")
    if serve.quantize == "int8":
        params = quant.quantize_params(params, embedding=serve.quantize_embedding)
    return params


def model_config(path: str | Path) -> ModelConfig | None:
    """The ModelConfig of a run or Hugging Face folder, read from its config file alone (no weights); None
    for a folder that is neither (`load_model` says why)."""
    path = Path(path)
    if (path / "config.yaml").exists():
        return load_config(path / "config.yaml").model
    return hf.read_config(path)[1] if hf.is_hf_folder(path) else None


def load_run(run_dir: str | Path, mesh=None, step: int | None = None, param_dtype: str = "float32"):
    """Config, tokenizer and params (held in `param_dtype`) of a run folder's latest good (or given) checkpoint.

    A latest checkpoint that does not restore is skipped with a warning for the one before it.
    The params are placed with the model's shardings on `mesh` (default: all local devices on data).
    """
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    if cfg.model.lora.rank:  # its checkpoints hold adapters, no base (see docs/training.md, LoRA fine-tuning)
        return _merged_lora_run(run_dir, mesh, step, param_dtype)
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    params = _restore(run_dir, cfg, step, lambda ckpt, s: ckpt.restore_params(s, cfg.model, mesh, param_dtype))
    return cfg, Tokenizer.from_folder(run_dir), params


def _run_config(run_dir: Path) -> Config:
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a jaxgen run folder (no config.yaml); train.py writes one")
    return load_config(run_dir / "config.yaml")


def _restore(run_dir: Path, cfg: Config, step: int | None, restore):
    """`restore(checkpointer, step)` of the given step, or of the newest that restores (older ones tried
    after a warning)."""
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"{run_dir} has no checkpoint yet")
        if step is not None and step not in steps:
            raise CheckpointError(f"{ckpt.directory} has no checkpoint of step {step}; it has steps {steps}")
        return restore_newest(ckpt, lambda s: restore(ckpt, s), steps if step is None else [step])[1]
    finally:
        ckpt.close()


def load_lora_run(run_dir: str | Path, mesh=None, step: int | None = None):
    """(Config, Tokenizer, base, adapters) of a LoRA run folder: the float32 adapters of its latest good (or
    given) checkpoint ({target: {"a_...": (L, *in, r), "b_...": (L, r, *out)}}, `jaxgen.model.lora`) and the
    float32 base they adapt: model.lora.base's weights (`lora_base_folder`), or the weights the run's seed draws
    (the checkpoints hold no base). model.lora.base_dtype (bfloat16, int8, nf4) was how training held the base
    to save memory; the base here is the full-precision one."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    if not cfg.model.lora.rank:
        raise ConfigError(f"{run_dir} is not a LoRA run (model.lora.rank=0): its checkpoints hold the whole model")
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    adapters = _restore(run_dir, cfg, step, lambda ckpt, s: _restore_adapters(ckpt, s, cfg.model, mesh))
    return cfg, Tokenizer.from_folder(run_dir), _lora_base(cfg, mesh), adapters


def _restore_adapters(ckpt: Checkpointer, step: int, model_cfg: ModelConfig, mesh) -> dict:
    """Only the adapters (the train state's params) of a LoRA run's checkpoint, in their shardings on `mesh`."""
    import jax

    specs, shardings = lora.lora_specs(model_cfg), lora.lora_shardings(model_cfg, mesh)
    is_spec = lambda x: isinstance(x, ParamSpec)
    abstract = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, "float32", sharding=s), specs, shardings,
                            is_leaf=is_spec)  # fmt: skip
    item = {"params": abstract}
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return ckpt.manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]


def lora_base_folder(cfg: Config) -> str | None:
    """The folder of a LoRA run's base: model.lora.base, which train.py and rl.py write. Runs written before
    that field named it in rl.init_from (rl.py) or training.init_from (train.py): read there. None: the
    weights the run's seed draws."""
    return cfg.model.lora.base or cfg.rl.init_from or cfg.training.init_from or None


def _lora_base(cfg: Config, mesh) -> dict:
    """A LoRA run's float32 base: the weights of `lora_base_folder` (a run folder, or a Hugging Face folder read
    with the run's model config), else the seed's (drawn as training drew them)."""
    folder = lora_base_folder(cfg)
    if folder is not None:
        if (Path(folder) / "config.yaml").exists():  # a run folder (rl.py's starting policy)
            return load_model(folder, mesh, param_dtype="float32")[2]
        if not hf.is_hf_folder(folder):
            raise FileNotFoundError(
                f"the base of this LoRA run, {folder!r}, is neither a run folder nor a Hugging Face model folder "
                "(config.json and *.safetensors) any more; the run's checkpoints hold the adapters only"
            )
        return hf.load_params(folder, cfg.model, hf.read_config(folder)[0], mesh)
    from jaxgen.training.step import create_base  # the seed's draw, one definition (brings optax: rare path)

    float_base = dataclasses.replace(cfg.model.lora, base_dtype="float32")
    return create_base(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=float_base)), mesh)


def _merged_lora_run(run_dir: Path, mesh, step: int | None, param_dtype: str):
    """`load_run` of a LoRA run: the adapters merged into the float32 base (`lora.merge`), held in `param_dtype`;
    the Config's model.lora is rank 0, as the params hold no adapters."""
    import jax

    cfg, tokenizer, base, adapters = load_lora_run(run_dir, mesh, step)
    params = lora.merge(base, adapters, cfg.model)
    if param_dtype != "float32":
        params = jax.tree.map(lambda w: w.astype(param_dtype), params)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig()))
    return cfg, tokenizer, params


def load_model(
    path: str | Path, mesh=None, step: int | None = None, param_dtype: str = "auto", quantize: str = "none",
    quantize_embedding: bool = False,
):  # fmt: skip
    """(ModelConfig, Tokenizer, params) of a jaxgen run folder or a local Hugging Face model folder.

    param_dtype: how the weights are held for inference: float32, bfloat16, or auto: the checkpoint's
    dtype (float32 master weights for a run folder; usually bfloat16 for a Hugging Face folder) on GPU
    and TPU, float32 on CPU (see `hf.load.inference_dtype`). bfloat16 weights compute in bfloat16.
    quantize: "int8" holds the matrix weights as int8 (`jaxgen.model.quant`; with `quantize_embedding`
    the embedding and head too), for inference only."""
    if quantize not in ("none", "int8"):
        raise ValueError(f"quantize={quantize!r} is not allowed: none, int8")
    path = Path(path)
    if (path / "config.yaml").exists():
        dtype = inference_dtype(param_dtype, "float32")
        cfg, tokenizer, params = load_run(path, mesh, step, dtype)
        cfg = dataclasses.replace(cfg.model, dtype="bfloat16") if dtype == "bfloat16" else cfg.model
    elif hf.is_hf_folder(path):
        cfg, tokenizer, params = hf.load_pretrained(path, mesh, param_dtype=param_dtype)
        if tokenizer is None:
            raise FileNotFoundError(f"{path} has no tokenizer.json; jaxgen needs one to read and write text")
    else:
        raise FileNotFoundError(
            f"{path} is neither a jaxgen run folder (config.yaml, written by train.py) nor a Hugging Face model "
            "folder (config.json and *.safetensors)"
        )
    if quantize == "int8":
        params = quant.quantize_params(params, embedding=quantize_embedding)
    return cfg, tokenizer, params


def load_eagle_head(path: str | Path, cfg: ModelConfig, tokenizer):
    """The EAGLE-3 head at `path` for target `cfg` (ValueError naming what differs), or None when `path` holds
    none: a head run folder (train.py draft.target=..., its head.json) or a folder in vLLM's layout
    (config.json of LlamaForCausalLMEagle3, `jaxgen.hf.eagle3`)."""
    from jaxgen.hf import eagle3

    path = Path(path)
    if (path / "head.json").exists():
        mine = tokenizer.tok.get_vocab(with_added_tokens=True)
        if (path / "tokenizer.json").exists() and Tokenizer.from_folder(path).tok.get_vocab(
            with_added_tokens=True
        ) != mine:
            raise ValueError(f"the EAGLE head at {path} was trained for a target with another tokenizer")
        return eagle.check_head(load_head(path), cfg)
    config = path / "config.json"
    if config.exists() and eagle3.ARCHITECTURE in json.loads(config.read_text()).get("architectures", []):
        return eagle3.load(path, cfg, tokenizer)
    return None


def load_draft(path: str | Path, tokenizer, mesh=None, param_dtype: str = "auto", quantize: str = "none",
               quantize_embedding: bool = False) -> tuple:  # fmt: skip
    """(params, ModelConfig) of a draft model for speculative decoding (`load_model`'s folders and options),
    ValueError when its tokenizer maps tokens to other ids than the target's `tokenizer` (a draft's tokens
    are fed to the target as they are). The model's own checks (vocabulary, context) are
    `jaxgen.inference.speculative.check_draft`'s, where the draft meets its target."""
    try:
        cfg, draft_tokenizer, params = load_model(path, mesh, param_dtype=param_dtype, quantize=quantize,
                                                  quantize_embedding=quantize_embedding)  # fmt: skip
    except FileNotFoundError as e:
        raise FileNotFoundError(f"the draft model (serve.draft): {e}") from e
    mine = tokenizer.tok.get_vocab(with_added_tokens=True)
    theirs = draft_tokenizer.tok.get_vocab(with_added_tokens=True)
    if mine != theirs:
        differ = sum(1 for t, i in theirs.items() if mine.get(t) != i) + len(set(mine) - set(theirs))
        raise ValueError(
            f"the draft model at {path} has another tokenizer than the target's ({differ} tokens differ; "
            f"{len(theirs)} vs {len(mine)} tokens): a draft model must use the same tokenizer"
        )
    return params, cfg


def load_head(run_dir: str | Path, step: int | None = None) -> eagle.Head:
    """The `eagle.Head` of a head run folder (its latest checkpoint, or `step`)."""
    run_dir = Path(run_dir)
    if not (run_dir / "head.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a draft head run folder (no head.json); "
                                "`python train.py draft.target=...` writes one")  # fmt: skip
    try:
        meta = json.loads((run_dir / "head.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{run_dir / 'head.json'} is not valid JSON ({e}): train.py draft.target=... writes it") from e
    cfg = load_config(run_dir / "config.yaml")
    head = eagle.new_head(cfg.model, jax.random.key(0), tuple(meta["layers"]), np.asarray(meta["draft_to_target"]))
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{run_dir} holds no checkpoint of its head yet")
        params = ckpt.restore_params_as(
            step, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), head.params)
        )
    finally:
        ckpt.close()
    return head.replace(params=params)
