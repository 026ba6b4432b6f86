"""The training run: data, state, the step loop, evaluation, checkpoints, metrics and resuming.

`train(cfg, run_dir)` is what `train.py` calls. Killed (Ctrl-C, SIGTERM, kill -9) and started again
with the same command, it continues from the last checkpoint with the same data order. A newest checkpoint
that does not restore (a truncated or deleted file) is set aside and the run continues from the one before;
a full disk stops the run with one DiskFullError, and the same command continues once there is space.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxgen import model
from jaxgen.config import Config, ConfigError, load_config, save_config
from jaxgen.distributed import any_process, barrier, is_main
from jaxgen.model import lora
from jaxgen.sharding import check_spans_processes, make_mesh, process_rows
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.checkpoint import Checkpointer, has_checkpoint, quiet_background_errors, restore_newest
from jaxgen.training.data.pipeline import (
    PackedConversations,
    PackedSequences,
    PreferencePairs,
    eval_batches,
    train_iterator,
)
from jaxgen.training.data.tokens import load_meta, load_splits
from jaxgen.training.metrics import MetricsWriter, measure_matmul_flops, plot_loss
from jaxgen.training.step import (
    TrainState,
    batch_shapes,
    create_base,
    create_train_state,
    make_eval_step,
    make_train_step,
    put_batch,
)


class NonFiniteError(RuntimeError):
    """Too many non-finite losses or gradients in a row; no checkpoint was written for them."""


class DiskFullError(RuntimeError):
    """The disk filled up while the run was writing; the checkpoints finished before are kept."""


@dataclass
class TrainResult:
    step: int
    status: str  # "finished", "already finished", "stopped" (signal or steps_per_run), "compiled" (compile_only)
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    nonfinite_total: int = 0


def prepare_run_dir(cfg: Config, run_dir: Path) -> Tokenizer:
    """Writes config.yaml and tokenizer.json; refuses a run folder whose checkpoints are of another model or data.

    Without a checkpoint nothing is bound to the old files yet: a first attempt that failed (an empty data
    file, a typo) does not stop the corrected command, which writes them anew.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    resuming = has_checkpoint(run_dir)
    if resuming and (run_dir / "config.yaml").exists():
        old = load_config(run_dir / "config.yaml")
        for section in ("model", "data"):
            if getattr(old, section) != getattr(cfg, section):
                raise ConfigError(
                    f"run folder {run_dir} was trained with a different `{section}` section; "
                    f"resume with the same settings, or pass a new --run-dir"
                )
    tok_path = run_dir / "tokenizer.json"
    if resuming and tok_path.exists():
        tokenizer = Tokenizer.from_folder(run_dir)
    else:
        tokenizer = Tokenizer.from_name(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); allowed: model.vocab_size >= {tokenizer.vocab_size}"
        )
    if is_main():  # one writer; every process has the same tokenizer and config
        tokenizer.save_folder(run_dir)
        save_config(cfg, run_dir / "config.yaml")
    return tokenizer


class _StopFlag:
    """Turns SIGTERM and the first Ctrl-C into a request to save and stop after the current step."""

    def __init__(self):
        self.requested = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)

    def agreed(self) -> bool:
        """Whether any process was asked to stop: all of them then save the same step and stop together."""
        return any_process(self.requested is not None)


class _SilentBar(tqdm):
    """The progress bar of processes other than 0: it neither draws nor writes."""

    @classmethod
    def write(cls, *args, **kwargs):
        pass


class _NoMetrics:
    """What processes other than 0 write: nothing."""

    path = "(process 0's metrics.jsonl)"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def write(self, record: dict) -> None:
        pass


def _say(text: str) -> None:
    if is_main():
        print(text)


def _batch_hash(batch: dict) -> str:
    return hashlib.blake2b(np.ascontiguousarray(batch["inputs"]).tobytes(), digest_size=6).hexdigest()


def resolve_init_from(cfg: Config) -> tuple[Config, str | None]:
    """With training.init_from, the model section and tokenizer of that Hugging Face folder, and its family.

    The folder's config.json is read here once; the family (None without init_from) picks the weight mapping.
    """
    folder = cfg.training.init_from
    if folder is None:
        return cfg, None
    from jaxgen import hf

    if not hf.is_hf_folder(folder):
        raise ConfigError(
            f"training.init_from={folder!r} is not allowed: a local Hugging Face model folder "
            "(config.json and *.safetensors) is needed"
        )
    if not (Path(folder) / "tokenizer.json").exists():
        raise ConfigError(f"training.init_from={folder!r} has no tokenizer.json; one is needed to read the data")
    family, model_cfg = hf.read_config(folder)
    lora = cfg.model.lora
    if lora.rank:  # the checkpoints will hold the adapters only: config.yaml names their base for loading
        lora = dataclasses.replace(lora, base=str(Path(folder).resolve()))
    model_cfg = dataclasses.replace(model_cfg, dtype=cfg.model.dtype, lora=lora)
    data = dataclasses.replace(cfg.data, tokenizer=str(Path(folder).absolute()))
    resolved = dataclasses.replace(cfg, model=model_cfg, data=data)
    resolved.check_seq_len(f" (from {folder}/config.json)")
    return resolved, family


def train(cfg: Config, run_dir: str | Path, progress: bool = True, compile_only: bool = False) -> TrainResult:
    """Trains `cfg` in `run_dir` (resuming what is there). compile_only: the train and evaluation steps are
    compiled (into `jaxgen.executables`' store when one is in use) and no step is taken (status "compiled")."""
    run_dir = Path(run_dir)
    cfg, family = resolve_init_from(cfg)
    quiet_background_errors(_NO_SPACE)  # a full disk is reported once, by DiskFullError
    with _disk_full_is_one_error(f"the run folder {run_dir}"):
        tokenizer = prepare_run_dir(cfg, run_dir)
        mesh = make_mesh(cfg.mesh)
        check_spans_processes(mesh, f"the mesh {dict(mesh.shape)}")
        with _disk_full_is_one_error(f"the token cache in {cfg.data.cache_dir}"):
            splits = load_splits(cfg.data, tokenizer)
        packed = {"chat": PackedConversations, "preference": PreferencePairs}.get(cfg.data.source, PackedSequences)
        train_src = packed(splits["train"]["tokens"], splits["train"]["flags"], cfg.data.seq_len)
        eval_src = packed(splits["eval"]["tokens"], splits["eval"]["flags"], cfg.data.seq_len)
        if getattr(train_src, "cut", 0):
            what = "answer(s)" if cfg.data.source == "preference" else "conversation(s)"
            _say(f"data: {train_src.cut} {what} longer than data.seq_len + 1 tokens are cut to their start")
        if cfg.data.source == "preference":
            train_src.width = eval_src.width = max(train_src.width, eval_src.width)  # one shape for both
            _references(cfg, mesh, tokenizer, family, train_src, eval_src, progress)
        rows = process_rows(mesh, cfg.training.batch_size)  # this process loads only its share of each batch
        data_iter = train_iterator(train_src, cfg.training.batch_size, cfg.data.seed, rows)
        held_out = eval_batches(eval_src, cfg.training.batch_size, cfg.data.eval_batches, rows)
        ckpt = Checkpointer(run_dir, cfg.checkpoint)
        try:
            state, step, base = _resume(cfg, run_dir, ckpt, mesh, data_iter, family)
            if state is None:
                result = TrainResult(step=step, status="already finished")
            else:
                run = _Run(cfg, run_dir, mesh, data_iter, held_out, ckpt, base, getattr(train_src, "width", 1))
                result = _compile_steps(run, state, step) if compile_only else _loop(run, state, step, progress)
        except BaseException:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                ckpt.close()
            raise
        with _disk_full_is_one_error(f"a checkpoint in {ckpt.directory}"):
            ckpt.close()
        return result


def _references(cfg: Config, mesh, tokenizer, family, train_src, eval_src, progress: bool) -> None:
    """Reports the preference data's bad lines and gives both splits the reference's scores (computed with
    the starting model once, then read from the cache: jaxgen.training.reference)."""
    from jaxgen.training.reference import set_references

    bad = load_meta(cfg.data, tokenizer)["bad_lines"]
    if bad["count"]:  # said on every start, from the store's record of them
        shown = "; ".join(bad["first"][:5]) + ("; ..." if bad["count"] > 5 else "")
        kept = train_src.num_pairs + eval_src.num_pairs
        _say(f"data: {bad['count']} bad preference line(s) skipped, {kept} pairs kept: {shown}")

    def start() -> dict:  # the params the first step reads
        params = _init_from_params(cfg, mesh, family)
        if not cfg.model.lora.rank:  # init_from's weights as they are; else the seed's (no optimizer state for them)
            return params if params is not None else create_train_state(cfg, mesh).params
        base = create_base(cfg, mesh, params)  # DoRA's magnitudes start at this base's norms
        return lora.attach(base, create_train_state(cfg, mesh, base).params)

    set_references(cfg, mesh, tokenizer, {"train": train_src, "eval": eval_src}, start, progress)


def _resume(
    cfg: Config, run_dir: Path, ckpt: Checkpointer, mesh, data_iter, family: str | None = None
) -> tuple[TrainState | None, int, dict | None]:
    """(state, step, base) to train from: fresh, or the newest checkpoint that restores; state None: the run
    is finished. base: LoRA's frozen weights (None without LoRA), rebuilt on every start (the checkpoints
    hold the adapters and their optimizer state only): training.init_from's weights or the seed's.

    Whether the run is finished is read from the step folder's name, and then only that checkpoint's params
    are restored to check it: they are what serve.py reads, and a rerun of a finished command need not read
    the optimizer state and data position. A newest checkpoint that does not restore cannot vouch for its step,
    finished or not: training goes on from the newest one that does and does the lost steps again (nothing is
    lost), after setting the damaged ones aside so that their steps can be saved again.
    """
    steps = ckpt.all_steps()
    adapters_only = bool(cfg.model.lora.rank)  # LoRA: the state is the adapters', the base rebuilt
    if not steps:
        params = _init_from_params(cfg, mesh, family)
        if adapters_only:  # DoRA's magnitudes start at the base's norms
            base = create_base(cfg, mesh, params)
            return create_train_state(cfg, mesh, base), 0, base
        return create_train_state(cfg, mesh, params), 0, None
    target = None

    def restore(step):
        nonlocal target
        if step >= cfg.training.steps:
            if adapters_only:  # the adapters are the state's params; the whole (small) state is read to check them
                ckpt.restore(step, create_train_state(cfg, mesh), with_data=False)
            else:
                ckpt.restore_params(step, cfg.model, mesh)
            return None
        target = create_train_state(cfg, mesh) if target is None else target
        return ckpt.restore(step, target)

    step, restored = restore_newest(ckpt, restore, steps)
    if restored is None:
        _say(
            f"{run_dir} already finished: {step} of training.steps={cfg.training.steps} steps done. "
            f"To train further, run the same command with training.steps={step * 2} (or any number > {step})."
        )
        return None, step, None
    state, data_state = restored
    if data_state is not None:
        data_iter.set_state(data_state)
    damaged = [s for s in steps if s > step]
    note = f" (checkpoints {damaged} did not restore: moved to {ckpt.set_aside(damaged)})" if damaged else ""
    _say(f"resuming {run_dir} from step {int(state.step)}{note}")
    base = create_base(cfg, mesh, _init_from_params(cfg, mesh, family)) if adapters_only else None
    return state, int(state.step), base


def _init_from_params(cfg: Config, mesh, family: str | None):
    """The starting weights of training.init_from (None without it); `family` as resolve_init_from read it."""
    if cfg.training.init_from is None:
        return None
    from jaxgen import hf

    params = hf.load_params(cfg.training.init_from, cfg.model, family, mesh)
    _say(f"fine-tuning {family} weights from {cfg.training.init_from}")
    return params


@dataclass
class _Run:
    """What the step loop works with, besides the train state."""

    cfg: Config
    run_dir: Path
    mesh: object
    data_iter: object
    held_out: list
    ckpt: Checkpointer
    base: dict | None = None  # LoRA's frozen weights (see jaxgen.training.step.create_base)
    width: int = 1  # preference tuning: the most pairs a row holds (`PreferencePairs.width`)


def _step_fns(run: _Run, state: TrainState):
    """The jitted (train step, evaluation) of the run's objective."""
    cfg = run.cfg
    steps, shapes = (None, None), None  # the defaults: next-token cross-entropy
    if cfg.training.objective != "sft":
        from jaxgen.training.preference import preference_eval, preference_step

        steps, shapes = (preference_step, preference_eval), batch_shapes(cfg, run.width)
    step_fn = make_train_step(cfg, run.mesh, state, run.base, steps[0], shapes)
    return step_fn, make_eval_step(cfg, run.mesh, state, run.base, steps[1], shapes)


def _compile_steps(run: _Run, state: TrainState, start: int) -> TrainResult:
    """The train and evaluation steps compiled for the run's first batch (its shapes), not run."""
    step_fn, eval_fn = _step_fns(run, state)
    batch = put_batch(next(run.data_iter), run.mesh, run.cfg.training.batch_size)
    base = () if run.base is None else (run.base,)
    with jax.set_mesh(run.mesh):
        step_fn.jitted.compile(state, batch, *base)
        eval_fn.jitted.compile(state.params, batch, *base)
    return TrainResult(step=start, status="compiled")


def _loop(run: _Run, state: TrainState, start: int, progress: bool) -> TrainResult:
    cfg = run.cfg
    step_fn, eval_fn = _step_fns(run, state)
    rates = _Rates(cfg)
    result = TrainResult(step=start, status="finished")
    end = cfg.training.steps
    if cfg.training.steps_per_run:
        end = min(end, start + cfg.training.steps_per_run)
    main = is_main()  # only process 0 writes metrics and shows the bar
    bar_kind, progress = (tqdm, progress) if main else (_SilentBar, False)
    bar = bar_kind(total=cfg.training.steps, initial=start, desc="train", unit="step", disable=not progress)
    metrics = MetricsWriter(run.run_dir) if main else _NoMetrics()
    with bar, metrics, _StopFlag() as stop:
        for step in range(start + 1, end + 1):
            batch = next(run.data_iter)
            t0 = time.perf_counter()
            state, m = step_fn(state, put_batch(batch, run.mesh, cfg.training.batch_size))
            m = jax.device_get(m)
            record = rates.record(step, m, time.perf_counter() - t0, batch)
            if not m["finite"]:
                record["skipped_nonfinite"] = int(state.nonfinite_in_row)
            result.losses.append(record["loss"])
            if step % cfg.training.eval_every == 0 or step == cfg.training.steps:
                record |= _evaluate_now(eval_fn, state, run, step, result, bar)
            with _disk_full_is_one_error(f"{metrics.path}"):
                metrics.write(record)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.1%}"
            )
            bar.update(1)
            if not m["finite"]:
                _check_nonfinite(state, cfg, bar)
            result.step = step
            stopping = stop.agreed()
            if stopping or step == end or step % cfg.checkpoint.every == 0:
                with _disk_full_is_one_error(f"a checkpoint in {run.ckpt.directory}"):
                    run.ckpt.save(step, state, run.data_iter.get_state())
            if stopping:
                result.status = "stopped"
                why = stop.requested or "another process was stopped"
                bar.write(f"{why}: saved a checkpoint at step {step}; run the same command to continue")
                break
    return _finish_run(run, state, result)


class _Rates:
    """Per-step record: loss, gradient norm, learning rate, tokens/s and MFU against the matmul rate."""

    def __init__(self, cfg: Config):
        self.tokens_per_step = cfg.training.batch_size * cfg.data.seq_len
        flops = lora.train_flops_per_token if cfg.model.lora.rank else model.flops_per_token
        self.flops_per_step = flops(cfg.model, cfg.data.seq_len) * self.tokens_per_step
        self.peak = cfg.training.peak_flops or measure_matmul_flops()

    def record(self, step: int, m: dict, dt: float, batch: dict) -> dict:
        out = {
            "step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
            "tokens_per_s": self.tokens_per_step / dt, "mfu": self.flops_per_step / dt / self.peak, "step_time_s": dt,
            "data": _batch_hash(batch),
        }  # fmt: skip
        extra = ("router_aux", "router_z", "rewards_chosen", "rewards_rejected", "margin", "accuracy", "pairs")
        return out | {k: float(m[k]) for k in extra if k in m}  # mixture of experts; preference tuning


def _evaluate_now(eval_fn, state, run: _Run, step: int, result: TrainResult, bar) -> dict:
    loss, *accuracy = _evaluate(eval_fn, state, run.held_out, run.mesh, run.cfg.training.batch_size)
    result.eval_losses.append((step, loss))
    if accuracy:  # preference tuning: its loss and the share of held-out pairs ranked right
        bar.write(f"step {step}: held-out {run.cfg.training.objective} loss {loss:.4f}, accuracy {accuracy[0]:.1%}")
        return {"eval_loss": loss, "eval_accuracy": accuracy[0]}
    ppl = math.exp(min(loss, 50.0))
    bar.write(f"step {step}: held-out loss {loss:.4f}, perplexity {ppl:.2f}")
    return {"eval_loss": loss, "eval_ppl": ppl}


def _finish_run(run: _Run, state: TrainState, result: TrainResult) -> TrainResult:
    result.nonfinite_total = int(state.nonfinite_total)
    if result.step < run.cfg.training.steps and result.status == "finished":
        result.status = "stopped"
        _say(f"stopped after training.steps_per_run={run.cfg.training.steps_per_run} steps at step {result.step}")
    with _disk_full_is_one_error(f"a checkpoint in {run.ckpt.directory}"):
        run.ckpt.wait()
    if is_main():
        print(f"loss curve: {plot_loss(run.run_dir)}")
    barrier("jaxgen-train-end")  # the others wait for process 0's plot rather than at JAX's shutdown barrier
    return result


def _check_nonfinite(state, cfg: Config, bar) -> None:
    in_row = int(state.nonfinite_in_row)
    bar.write(f"step {int(state.step)}: non-finite loss or gradient, update skipped ({in_row} in a row)")
    if in_row >= cfg.training.max_nonfinite_in_row:
        raise NonFiniteError(
            f"{in_row} non-finite losses or gradients in a row (training.max_nonfinite_in_row="
            f"{cfg.training.max_nonfinite_in_row}) at step {int(state.step)}; stopping without saving. "
            "Lower optimizer.learning_rate or check the data; the last good checkpoint is kept."
        )


def _evaluate(eval_fn, state, batches, mesh, batch_size: int) -> tuple[float, ...]:
    """(loss per token; a preference objective's per pair, and the share of pairs ranked right)."""
    sums = None
    for batch in batches:
        got = [float(x) for x in jax.device_get(eval_fn(state.params, put_batch(batch, mesh, batch_size)))]
        sums = got if sums is None else [a + b for a, b in zip(sums, got, strict=True)]
    total, count, *rest = sums
    return (total / max(count, 1.0), *(r / max(count, 1.0) for r in rest))


@contextlib.contextmanager
def _disk_full_is_one_error(what: str):
    """Turns "no space left on device", from Python or from TensorStore inside orbax, into one DiskFullError."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        cause = _disk_full_cause(e)
        if cause is None:
            raise
        raise DiskFullError(
            f"disk full while writing {what}: {cause}; free space and run the same command to resume"
        ) from None


_NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


def _disk_full_cause(e: BaseException | None) -> str | None:
    for _ in range(32):  # the chain of causes; bounded, as a chain can loop
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return str(e)
        if _NO_SPACE in str(e):  # TensorStore's errors are ValueErrors with the OS message
            return _NO_SPACE
        e = e.__cause__ or e.__context__
    return None
