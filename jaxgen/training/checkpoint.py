"""Checkpoints with orbax: async saves, keep-last-K, resume from the latest, restore onto any mesh.

A run folder is self-describing:
    <run_dir>/config.yaml       the full config the run used
    <run_dir>/tokenizer.json    its tokenizer
    <run_dir>/checkpoints/<step>/{state,data}   train state and the data iterator's position
    <run_dir>/checkpoints_damaged/<step>        checkpoints that did not restore, set aside on resuming

A checkpoint whose files were truncated or deleted does not restore; `restore_newest` then falls back
to the newest one that does, so training and serving go on from the last good step (a single process:
with several, the error names the checkpoint to move aside). Loading a model for inference
(`load_run`, `load_model`) is `jaxgen.inference.loading`'s, which needs nothing of training but this.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import jax
import orbax.checkpoint as ocp

from jaxgen import model
from jaxgen.config import CheckpointConfig
from jaxgen.distributed import barrier, is_main

T = TypeVar("T")


class CheckpointError(FileNotFoundError):
    """No checkpoint of a run folder restores (train.py, serve.py and convert.py print it as one line)."""


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run folder holds a checkpoint (finished or not, good or damaged); orbax names them by step."""
    folder = Path(run_dir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def restore_newest(ckpt: Checkpointer, restore: Callable[[int], T], steps: Iterable[int]) -> tuple[int, T]:
    """(step, restore(step)) for the newest of `steps` that restores, warning on stderr about each one that does not.

    Raises CheckpointError, naming the folder, when none restores.
    """
    steps = sorted(steps, reverse=True)
    if not steps:
        raise CheckpointError(f"{ckpt.directory} holds no checkpoint")
    if jax.process_count() > 1:
        return _restore_newest_of_several(ckpt, restore, steps[0])
    quiet_background_errors(str(ckpt.directory))  # before: a failing read prints from other threads at once
    reason = ""
    for i, step in enumerate(steps):
        try:
            return step, restore(step)
        except Exception as e:  # damage surfaces as ValueError, KeyError, FileNotFoundError or a bare Exception
            reason = error_summary(e)
            then = f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "none left to try"
            print(
                f"warning: checkpoint {ckpt.directory / str(step)} does not restore ({reason}); {then}",
                file=sys.stderr,
            )
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} restores (tried steps {', '.join(map(str, steps))}; "
        f"step {steps[-1]}: {reason}); "
        f"move {ckpt.directory} aside to start the run over, or pass another run folder"
    )


def _restore_newest_of_several(ckpt: Checkpointer, restore: Callable[[int], T], step: int) -> tuple[int, T]:
    """With several processes only the newest checkpoint is tried: each process reads its own shards, so one
    may fail where another succeeds, and a fallback taken by one process alone would mix steps."""
    quiet_background_errors(str(ckpt.directory))
    try:
        return step, restore(step)
    except Exception as e:
        aside = ckpt.directory.parent / "checkpoints_damaged"
        raise CheckpointError(
            f"checkpoint {ckpt.directory / str(step)} does not restore on process {jax.process_index()} "
            f"({error_summary(e)}); with several processes the run does not fall back to an older one by itself: "
            f"move that folder into {aside} and run the same command again"
        ) from None


def error_summary(e: BaseException, limit: int = 300) -> str:
    """One line for an exception: its root cause's type and first line (TensorStore's run to 60 lines)."""
    seen = set()
    while e.__cause__ is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_quiet_markers: set[str] = set()


def quiet_background_errors(marker: str) -> None:
    """Hides what background threads print about a failed read or write whose error mentions `marker`.

    When orbax gives up on a checkpoint, the reads or writes it started go on failing behind it: asyncio logs
    their futures as never retrieved, orbax logs the failure with its traceback from each thread it passes,
    TensorStore's late callbacks find orbax's event loop closed (and on a full disk tensorboardX's writer
    thread dies). The error itself is raised and reported in one line; these ~100-line tracebacks would bury it.
    Process-wide, as they come from other threads and from garbage collection, also after the call returns.
    """
    _quiet_markers.add(marker)
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_not_quieted)  # once: addFilter skips a filter already there
    if getattr(sys.unraisablehook, "quiets_background_errors", False):
        return
    unraisable_hook, thread_hook = sys.unraisablehook, threading.excepthook

    def on_unraisable(u):
        closed_loop = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        if not (closed_loop or _is_quieted(str(u.exc_value))):
            unraisable_hook(u)

    def on_thread_error(args):
        if not _is_quieted(str(args.exc_value)):
            thread_hook(args)

    on_unraisable.quiets_background_errors = True
    sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_error


def _is_quieted(text: str) -> bool:
    return any(marker in text for marker in _quiet_markers)


def _not_quieted(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not _is_quieted(f"{record.getMessage()} {exc!r} {exc.__cause__!r}" if exc else record.getMessage())


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig = CheckpointConfig()):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, cleanup_tmp_directories=True, enable_async_checkpointing=True
        )
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the finished checkpoints, oldest first (read from the folder names, nothing restored)."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Starts an async save; returns once the arrays are copied off the devices."""
        args = {"state": ocp.args.PyTreeSave(state)}  # PyTree args throughout: restore_params reads a part
        if data_state is not None:
            args["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int, target, with_data: bool = True):
        """Restores onto `target`'s shapes and shardings (any mesh); returns (state, data_state)."""
        abstract = jax.tree.map(_abstract, target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        args = {"state": ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)}
        if with_data and (self.directory / str(step) / "data").exists():
            args["data"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out.get("data") if "data" in args else None

    def restore_params(self, step: int, model_cfg, mesh, dtype="float32"):
        """Only the params of a checkpoint, with the model's shardings on `mesh` (no optimizer state, no
        data), held in `dtype` (orbax converts as it reads: no float32 copy of the whole model)."""
        shardings = model.param_shardings(model_cfg, mesh)
        abstract = jax.eval_shape(lambda: model.init_params(model_cfg, jax.random.key(0)))
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), abstract, shardings)
        return self.restore_params_as(step, abstract)

    def restore_params_as(self, step: int, abstract):
        """Only the params of a checkpoint, as the ShapeDtypeStructs `abstract` say (any params pytree: a
        model's, a draft head's)."""
        item = {"params": abstract}
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]

    def set_aside(self, steps: Iterable[int]) -> Path:
        """Moves checkpoints that did not restore to <run_dir>/checkpoints_damaged, so their steps can be saved again.

        Moved, not deleted: a file that went missing may still turn up, and the folder shows what was damaged.
        """
        folder = self.directory.parent / "checkpoints_damaged"
        for step in steps if is_main() else ():  # one process moves them; the others wait for it
            folder.mkdir(exist_ok=True)
            dest, n = folder / str(step), 1
            while dest.exists():
                dest, n = folder / f"{step}.{n}", n + 1
            (self.directory / str(step)).rename(dest)
        barrier("jaxgen-set-aside")
        self.manager.reload()
        return folder

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        # orbax's close() does not wait for the thread that clears temporary folders, started with the manager:
        # still running at interpreter exit, it fails ("cannot schedule new futures after interpreter shutdown")
        cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
        if cleanup is not None:
            cleanup.result()
        self.manager.close()


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if hasattr(x, "sharding") else x
