"""The RL loop: rollouts from the live engine, rewards off the device thread, the policy-gradient update
with the training forward, and the new weights swapped into the same engine.

    python rl.py --config configs/rl-arithmetic.yaml          # or: run_rl(load_config(...), "runs/rl")

One iteration (RL step s):
  1. prompts: `rl.prompts_per_step` records drawn from (training.seed, s) alone (jaxgen.rl.tasks);
  2. rollouts: `rl.group_size` samples a prompt from the engine (`LLM`), seeds from (training.seed, s),
     each sampled token's log-probability under the tempered policy it was drawn from
     (`logprobs_mode="processed"`) and that policy's version (jaxgen.rl.rollouts);
  3. rewards: the config's function over (prompt, completion, fields), on `rl.reward_workers` threads;
  4. the update: advantages (the algorithm's rule: `objectives.ALGORITHMS`), the training
     forward's log-probabilities of the same tokens, the clipped loss (jaxgen.rl.objectives), AdamW;
  5. the swap: `llm.update_params(new params)`: no recompilation, the prefix cache dropped.
With `rl.max_staleness` = K > 0 the rollouts of step s + K are generated (on the engine's policy version s)
while update s runs, so update s takes rollouts made by version max(0, s - K), corrected by the tokens'
importance weights (`rl.correction`); they are saved (`jaxgen.rl.rollouts`) until the checkpoint after their
update, and a resumed run takes them from there rather than generating them again.
The state checkpointed is a `TrainState` (policy, optimizer, step, key); prompts and seeds are functions of
the step, the reference policy is the starting one (rebuilt the same way on resume), so a killed run
resumes where it stopped and ends with the uninterrupted run's parameters.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import Config, DataConfig, LoraConfig, save_config
from jaxgen.distributed import barrier, is_main
from jaxgen.executables import Program
from jaxgen.rl import environments, episodes, objectives, rollouts, tasks
from jaxgen.rl.policy import Policy
from jaxgen.sharding import batch_sharding, check_spans_processes, process_rows, with_mesh
from jaxgen.training.checkpoint import Checkpointer
from jaxgen.training.step import TrainState, apply_grads, create_train_state, make_optimizer, put_batch, state_shardings

BATCH_KEYS = ("tokens", "positions", "mask", "old_logp", "advantages")


@dataclasses.dataclass
class RLResult:
    step: int
    status: str  # "finished", "already finished" or "stopped"
    rewards: list[float]  # mean reward of each step this call ran


def rl_step(state: TrainState, batch: dict, ref_logp, base=None, *, cfg: Config, tx, settings):
    """One policy-gradient update on a rollout batch (B = prompts x group rows, T = prompt + new tokens).
    batch: tokens, positions (B, T) int32; mask, old_logp (B, T - 1) float32; advantages (B,) float32.
    ref_logp: (B, T - 1) the reference policy's log-probabilities (zeros without a KL penalty).
    base: LoRA's frozen base (the state's params are then the adapters, the only thing differentiated)."""

    def objective(params):
        full = Policy.forward_params(params, base)
        logp, entropy = objectives.token_logprobs(
            full, batch["tokens"], batch["positions"], cfg=cfg.model, temperature=cfg.rl.temperature
        )
        loss, metrics = objectives.policy_loss(
            logp, batch["old_logp"], batch["advantages"], batch["mask"], settings, ref_logp_bt=ref_logp
        )
        mask = batch["mask"]
        metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(mask.sum(), 1.0)
        metrics["sampler_gap"] = jnp.max(jnp.abs(logp - batch["old_logp"]) * mask)  # trainer vs sampler
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    state, grad_norm, finite = apply_grads(state, grads, loss, tx)
    return state, metrics | {"loss": loss, "grad_norm": grad_norm, "finite": finite}


def make_rl_update(cfg: Config, mesh, state: TrainState, tx=None, base=None):
    """The jitted, state-donating `update(state, batch, ref_logp)` (rl_step) on `mesh`: the state in its own
    shardings (params and AdamW moments as training shards them), the batch's rows over data and fsdp;
    `base` LoRA's frozen base (an argument in its own shardings, not donated) or None. tx: the optimizer
    (default: the config's AdamW)."""
    r = cfg.rl
    B, T = r.prompts_per_step * r.group_size, r.max_prompt_tokens + r.max_new_tokens
    shapes = {"tokens": (B, T), "positions": (B, T), "mask": (B, T - 1), "old_logp": (B, T - 1), "advantages": (B,)}
    batch_sh = {k: batch_sharding(mesh, shape) for k, shape in shapes.items()}
    state_sh = state_shardings(state)
    # a caller's optimizer is not seen by the store's key: that update is compiled, never stored
    key = f"{cfg.model!r}|{cfg.optimizer!r}|{cfg.training!r}|{cfg.rl!r}" if tx is None else None
    tx = make_optimizer(cfg.optimizer, cfg.training.steps) if tx is None else tx
    step = Program(
        functools.partial(rl_step, cfg=cfg, tx=tx, settings=objectives.settings_of(cfg)), "rl_update", key,
        in_shardings=(state_sh, batch_sh, batch_sh["mask"], jax.tree.map(lambda x: x.sharding, base)),
        out_shardings=(state_sh, None), donate_argnums=0,
    )  # fmt: skip
    step = with_mesh(step, mesh)
    return lambda state, batch, ref_logp: step(state, batch, ref_logp, base)


def rollout_rows(cfg: Config, mesh) -> slice:
    """This process's rows of a step's B = prompts x group rows: those its devices hold in the update (all of
    them for one process). Each process generates, and scores the rewards of, its rows alone, so they must be
    whole groups."""
    n = cfg.rl.group_size
    rows = process_rows(mesh, cfg.rl.prompts_per_step * n)
    if rows.start % n or rows.stop % n:
        raise ValueError(
            f"rl.prompts_per_step={cfg.rl.prompts_per_step} is not allowed on the mesh {dict(mesh.shape)} over "
            f"{jax.process_count()} processes: each process's rows ({rows.start}..{rows.stop}) must be whole groups "
            f"of rl.group_size={n}; a multiple of {jax.process_count()} prompts a step is"
        )
    return rows


def trainer_devices(sampler_devices: int) -> list:
    """The trainer's devices: every process's local devices but its first `sampler_devices` (the engine's);
    ValueError when that leaves none."""
    local = jax.local_device_count()
    if sampler_devices >= local:
        raise ValueError(
            f"rl.sampler_devices={sampler_devices} is not allowed: this process has {local} device(s) and the trainer "
            f"needs one of its own, so at most {local - 1} (0: the engine shares the trainer's devices; on CPU, "
            "JAX_NUM_CPU_DEVICES=8 gives a process 8)"
        )
    by_process = {}
    for d in jax.devices():  # each process's in the order of its local devices
        by_process.setdefault(d.process_index, []).append(d)
    return [d for devices in by_process.values() for d in devices[sampler_devices:]]


def sampler_mesh(cfg: Config):
    """The engine's devices (rl.sampler_devices > 0): this process's first N, data parallel (slots split)."""
    from jaxgen.config import MeshConfig
    from jaxgen.sharding import make_mesh

    n = cfg.rl.sampler_devices
    return make_mesh(MeshConfig(data=n), jax.local_devices()[:n])


def sampler_place(cfg: Config, mesh):
    """A tree of the trainer's arrays (sharded over `mesh`) -> this process's whole copy where its engine runs:
    `engine_params` (one all-gather over the trainer's devices), then, with rl.sampler_devices, one device-to-
    device copy onto the engine's devices (replicated: its slots are split over them, not the weights)."""
    if not cfg.rl.sampler_devices:
        return functools.partial(engine_params, mesh=mesh)
    onto = jax.sharding.NamedSharding(sampler_mesh(cfg), jax.sharding.PartitionSpec())
    return lambda tree: jax.device_put(engine_params(tree, mesh), onto)


def engine_params(params, mesh):
    """This process's whole copy of `params` (sharded over `mesh`, perhaps over several processes) on its first
    device of the mesh, where its engine runs: one all-gather to every device, then this device's replica."""
    full = _replicate(mesh)(params)
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards if s.device == device), full)


@functools.cache
def _replicate(mesh):
    """The jitted all-gather of a pytree to every device of `mesh` (made once a mesh: compiled once a structure)."""
    return jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def run_rl(cfg: Config, run_dir: str | Path, progress: bool = True, stop_after: int | None = None) -> RLResult:
    """Runs (or resumes) RL into `run_dir`: checkpoints, config.yaml, tokenizer, metrics.jsonl,
    TensorBoard events and reward.png. stop_after: stop (checkpointed) after this many steps of this call
    (default: training.steps_per_run, as train.py; 0 = run to the end)."""
    from jaxgen.config import ServeConfig
    from jaxgen.inference.budget import check_deterministic
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(cfg.mesh, trainer_devices(cfg.rl.sampler_devices))
    if cfg.model.deterministic:  # the rollout engine's settings and the trainer's mesh (data parallel only),
        # refused before the warm start trains
        check_deterministic(cfg.model, ServeConfig(cache_dtype=cfg.model.dtype), None, mesh)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, seq_len=min(cfg.data.seq_len, cfg.model.max_seq_len))
    )
    records = tasks.load_prompts(cfg.rl, cfg.training.seed)
    reward_fn = tasks.load_reward(cfg.rl)
    check_spans_processes(mesh, f"the mesh {dict(mesh.shape)}")
    if cfg.rl.sampler_devices and is_main():
        print(f"the engine on {cfg.rl.sampler_devices} device(s) of each process, the trainer on the mesh "
              f"{dict(mesh.shape)} of the others")  # fmt: skip
    cfg, tokenizer, start_params = starting_policy(cfg, run_dir, mesh, progress)
    _check_prompts(cfg, tokenizer, records)
    if is_main():  # one writer; every process has the same config and tokenizer
        save_config(cfg, run_dir / "config.yaml")
        tokenizer.save_folder(run_dir)
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    state = create_train_state(cfg, mesh, start_params)
    step = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, _ = ckpt.restore(latest, state, with_data=False)
        step = latest
        if is_main() and step < cfg.training.steps:
            print(f"resuming {run_dir} from step {step}")
    if step >= cfg.training.steps:
        ckpt.close()
        return RLResult(step, "already finished", [])
    try:
        stop_after = cfg.training.steps_per_run if stop_after is None else stop_after
        last = min(cfg.training.steps, step + stop_after) if stop_after else cfg.training.steps
        result = _loop(
            cfg, run_dir, mesh, tokenizer, records, reward_fn, state, start_params, step, ckpt, progress, last
        )
    finally:
        ckpt.close()
    return result


def starting_policy(cfg: Config, run_dir: Path, mesh, progress: bool):
    """(cfg with the policy's model section, tokenizer, float32 params): `rl.init_from` (a run or Hugging
    Face folder), or the built-in task's supervised warm start trained into `run_dir/warm_start` (itself
    a train.py run: resumable, skipped once finished)."""
    from jaxgen.inference.loading import load_model

    source = cfg.rl.init_from
    if not source:
        source = run_dir / "warm_start"
        train_cfg = warm_start_config(cfg, source)
        from jaxgen.training.trainer import train

        train(train_cfg, source, progress=progress)
    model_cfg, tokenizer, params = load_model(source, mesh, param_dtype="float32")
    # RL's own adapters, dtype and deterministic mode (not architecture: a Hugging Face folder has none of them)
    model_cfg = dataclasses.replace(model_cfg, dtype=cfg.model.dtype, lora=cfg.model.lora,
                                    deterministic=cfg.model.deterministic)  # fmt: skip
    if cfg.model.deterministic:  # its key blocks must divide the engine's pages
        model_cfg = dataclasses.replace(model_cfg, attention_block=cfg.model.attention_block)
    if model_cfg.lora.rank:  # the checkpoints hold the adapters only: config.yaml names their base for load_run
        lora = dataclasses.replace(model_cfg.lora, base=str(Path(source).resolve()))
        model_cfg = dataclasses.replace(model_cfg, lora=lora)
    return dataclasses.replace(cfg, model=model_cfg), tokenizer, params


def warm_start_config(cfg: Config, folder: str | Path) -> Config:
    """The warm start's train.py config: the RL config's model and tokenizer, on the task's prompt/response pairs
    (loss on the answer) or, for an environment's task, its conversations (chat SFT: loss on the model's turns),
    written to `folder/warm_start.jsonl`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "warm_start.jsonl"
    environment = environments.environment_class(cfg.rl)
    if not path.exists() and is_main():  # one writer: the others would read a file half written
        if environment is None:
            records = tasks.warm_start_records(cfg.training.seed, cfg.rl.max_operand)
        elif hasattr(environment, "warm_start"):
            records = environment.warm_start(cfg.training.seed + 7919)
        else:
            raise ValueError(f"rl.environment={cfg.rl.environment!r} has no warm_start conversations: "
                             "give rl.init_from")  # fmt: skip
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    barrier("jaxgen-rl-warm-start-data")
    single = {"source": "jsonl", "prompt_field": "prompt", "response_field": "response"}
    fields = single if environment is None else {"source": "chat"}
    data = DataConfig(paths=(str(path),), tokenizer=cfg.data.tokenizer, seq_len=cfg.data.seq_len,
                      seed=cfg.training.seed, cache_dir=cfg.data.cache_dir, **fields)  # fmt: skip
    optimizer = dataclasses.replace(cfg.optimizer, learning_rate=cfg.rl.warm_start_learning_rate)
    training = dataclasses.replace(cfg.training, steps=cfg.rl.warm_start_steps, eval_every=cfg.rl.warm_start_steps)
    checkpoint = dataclasses.replace(cfg.checkpoint, every=max(cfg.rl.warm_start_steps // 4, 1))
    # the whole model (RL's LoRA adapts it); packed documents, which deterministic mode does not take
    model_cfg = dataclasses.replace(cfg.model, lora=LoraConfig(), deterministic=False)
    return dataclasses.replace(cfg, name=f"{cfg.name}-warm-start", model=model_cfg, data=data, optimizer=optimizer,
                               training=training, checkpoint=checkpoint)  # fmt: skip


def _check_prompts(cfg: Config, tokenizer, records: list[dict]) -> None:
    """Every prompt fits rl.max_prompt_tokens (an environment's: the opening it renders for the record, the chat
    template's generation prompt included), before any rollout."""
    limit = cfg.rl.max_prompt_tokens
    total = limit + cfg.rl.max_new_tokens
    if total > cfg.model.max_seq_len:
        raise ValueError(f"rl.max_prompt_tokens + rl.max_new_tokens = {total} is not allowed: at most "
                         f"model.max_seq_len={cfg.model.max_seq_len}")  # fmt: skip
    environment = environments.environment_class(cfg.rl)
    chat = episodes.Chat(tokenizer) if environment else None
    for i, record in enumerate(records):
        if environment is None:
            n = len(tokenizer.encode(record["prompt"]))
        else:
            env = environment(record, tools=cfg.rl.tools)
            n = len(chat.opening(episodes.opening(env), episodes.tools_of(env)))
        if n > limit:
            raise ValueError(f"prompt {i} ({record['prompt'][:40]!r}...) has {n} tokens; rl.max_prompt_tokens={limit}")


def _loop(cfg, run_dir, mesh, tokenizer, records, reward_fn, state, start_params, step, ckpt, progress, last):
    from tqdm import tqdm

    from jaxgen.training.metrics import MetricsWriter

    r = cfg.rl
    policy = Policy.of(cfg, mesh, start_params)
    update = make_rl_update(cfg, mesh, state, base=policy.base)
    B = r.prompts_per_step * r.group_size
    score_ref = with_mesh(Program(
        lambda p, t, pos: objectives.token_logprobs(p, t, pos, cfg=cfg.model, temperature=r.temperature)[0],
        "rl_reference_logprobs", f"{cfg.model!r}|{r.temperature!r}",
        out_shardings=batch_sharding(mesh, (B, r.max_prompt_tokens + r.max_new_tokens - 1)),
    ), mesh)  # fmt: skip
    # Several processes: each generates (and rewards) its own rows of the step on its own engine, data parallel
    # like the update; the rewards are gathered so that every process forms the same advantages.
    rows = rollout_rows(cfg, mesh)
    place = sampler_place(cfg, mesh)
    pool = {"cache_dtype": cfg.model.dtype} if cfg.model.deterministic else {}  # its keys as the trainer's
    llm = policy.engine(state, tokenizer, place, slots=rows.stop - rows.start, data_parallel=max(r.sampler_devices, 1),
                        num_pages=rollout_pages(cfg, rows=rows.stop - rows.start), max_logprobs=0, **pool)  # fmt: skip
    sent = sum(x.nbytes for x in jax.tree.leaves(state.params))  # bytes a swap: each engine gets them whole
    workers = concurrent.futures.ThreadPoolExecutor(r.reward_workers, thread_name_prefix="reward")
    sampler = rollouts.Sampler(cfg, llm, policy, records, reward_fn, workers, rows)
    shape = (rows.stop - rows.start, r.max_prompt_tokens + r.max_new_tokens)
    ahead = {}  # step -> its rollouts, generated before its update (rl.max_staleness > 0)
    rewards_seen = []
    main = is_main()  # only process 0 writes metrics and shows the bar
    bar = tqdm(total=cfg.training.steps, initial=step, disable=not (progress and main), unit="step",
               dynamic_ncols=True)  # fmt: skip
    with MetricsWriter(run_dir) if main else contextlib.nullcontext() as metrics, workers:
        for j in range(step, min(step + r.max_staleness, cfg.training.steps)):  # saved ones when resuming
            ahead[j] = _ahead(sampler, run_dir, j, step, shape)
        while step < last:
            started = time.perf_counter()
            rollout = ahead.pop(step) if r.max_staleness else sampler.rollout(step, step)
            made = None if r.max_staleness else rollout  # the rollouts generated in this iteration
            t0 = time.perf_counter()
            times = {}
            local = {k: rollout.batch[k] for k in BATCH_KEYS}
            batch = put_batch(local | {"ref": np.zeros_like(local["mask"])}, mesh, B, keys=(*BATCH_KEYS, "ref"))
            ref = batch.pop("ref")  # no KL penalty: zeros, unread
            if r.kl_coef:
                ref = score_ref(policy.reference, batch["tokens"], batch["positions"])
            times["score_s"] = time.perf_counter() - t0
            state, m = update(state, batch, ref)  # dispatched: the rollouts made next run beside it
            following = step + r.max_staleness
            if r.max_staleness and following < cfg.training.steps:  # on the engine's policy, version `step`
                made = ahead[following] = _ahead(sampler, run_dir, following, step, shape)
            t0 = time.perf_counter()
            m = jax.device_get(m)
            times["update_s"] = time.perf_counter() - t0  # what generation did not hide of it
            t0 = time.perf_counter()
            policy.swap(llm, state, place)
            times["swap_s"] = time.perf_counter() - t0
            times["swap_bytes_per_s"] = sent / max(times["swap_s"], 1e-9)
            step += 1
            record = _record(step, rollout, made, m, times, time.perf_counter() - started)
            if main:
                metrics.write(record)
            rewards_seen.append(record["reward"])
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward']:.3f}±{record['reward_std']:.2f}", kl=f"{record['kl']:.4f}",
                            entropy=f"{record['entropy']:.2f}", tok_s=f"{record['tokens_per_s']:.0f}")  # fmt: skip
            if step % cfg.checkpoint.every == 0 or step == last:
                ckpt.wait()  # the checkpoint before is finished: the rollouts of its steps are never needed again
                done = ckpt.latest_step()
                ckpt.save(step, state)  # (a run keeps its last interval's rollouts: a few small files)
                if done is not None:
                    rollouts.prune(run_dir, below=done)
    bar.close()
    if main:
        plot_reward(run_dir)
    barrier("jaxgen-rl-end")  # the others wait for process 0's plot rather than at JAX's shutdown barrier
    return RLResult(step, "finished" if step >= cfg.training.steps else "stopped", rewards_seen)


def _ahead(sampler: rollouts.Sampler, run_dir: Path, step: int, version: int, shape) -> rollouts.Rollout:
    """Step's rollouts made before its update: those a killed run saved (made by the policy version an
    uninterrupted run uses, `step - rl.max_staleness`, under this config), else made now by the engine's
    `version`, and saved. Processes take theirs back only when every one of them can (one small all-gather):
    else all generate, since generating gathers the rewards of every process."""
    wanted = max(0, step - sampler.cfg.rl.max_staleness)
    saved = rollouts.Rollout.load(run_dir, step, shape, rollouts.fingerprint(sampler.cfg))
    usable = saved is not None and saved.version == wanted
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        usable = bool(np.all(multihost_utils.process_allgather(np.asarray(usable, np.int32))))
    if usable:
        return saved
    rollout = sampler.rollout(step, version)
    rollout.save(run_dir)
    return rollout


def _record(step: int, rollout: rollouts.Rollout, made, m: dict, times: dict, step_s: float) -> dict:
    """A step's metrics line: the update's rollouts' rewards and staleness, the loss's metrics and importance
    weights, and the seconds of its parts (generate_s, reward_s, tokens_per_s: of the rollouts generated in
    this iteration, `made`: the next ones with rl.max_staleness > 0; none in a run's last steps); multi-turn
    rollouts add their episodes' mean turns and tool calls and how they ended (end_done, end_turns, end_length)."""
    rewards, mask = rollout.rewards, rollout.batch["mask"] > 0
    fresh = made is not None and not made.loaded  # taken back from disk: made by another process
    gen_s, reward_s, tokens = (made.generate_s, made.reward_s, made.new_tokens) if fresh else (0.0, 0.0, 0)
    staleness = step - 1 - rollout.batch["version"][mask]
    return {
        "step": step, "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "loss": float(m["loss"]), "entropy": float(m["entropy"]), "kl": float(m.get("kl", 0.0)),
        "clip_frac": float(m["clip_frac"]), "sampler_gap": float(m["sampler_gap"]),
        "ratio": float(m["ratio"]), "ratio_max": float(m["ratio_max"]), "corrected": float(m["corrected"]),
        "staleness": float(staleness.mean()) if staleness.size else 0.0, "version": rollout.version,
        "grad_norm": float(m["grad_norm"]), "tokens_per_s": tokens / gen_s if gen_s else 0.0, "step_s": step_s,
        "generate_s": gen_s, "reward_s": reward_s,
    } | times | {k: float(v) for k, v in rollout.stats.items()}  # fmt: skip


def rollout_pages(cfg: Config, page_size: int = 16, rows: int | None = None) -> int:
    """The engine's page pool: every rollout of a step (or `rows` of them: a process's share) at full length
    at once, and a page a slot to spare. Sized to the step rather than the serving default (a gigabyte)."""
    r = cfg.rl
    per_row = -(-(r.max_prompt_tokens + r.max_new_tokens) // page_size)
    return (r.prompts_per_step * r.group_size if rows is None else rows) * (per_row + 1)


def plot_reward(run_dir: str | Path) -> Path:
    """Writes `<run_dir>/reward.png`: the mean reward per RL step and its moving average over 10 steps."""
    from jaxgen.training.metrics import read_metrics, save_plot

    by_step = {r["step"]: r for r in read_metrics(run_dir) if r.get("reward") is not None}
    steps = sorted(by_step)
    mean = np.asarray([by_step[s]["reward"] for s in steps])
    window = min(10, max(len(mean), 1))
    smooth = np.convolve(mean, np.ones(window) / window, mode="valid") if len(mean) else mean

    def draw(ax):
        ax.plot(steps, mean, lw=1, alpha=0.5, label="mean reward of the step's samples")
        ax.plot(steps[window - 1 :], smooth, lw=2, label=f"moving average over {window} steps")

    return save_plot(Path(run_dir) / "reward.png", draw, "reward", "RL step", "reward")
