"""Training an EAGLE-3 draft head for a frozen target (`draft.target`; `jaxgen.model.eagle`).

    python train.py draft.target=runs/default            # -> runs/default-eagle3

Each step runs the target's teacher-forced forward pass once (no gradient) for the features it taps and
its next-token distributions, then the head's k unrolled draft steps (`eagle.train_forward`); step j's
loss is the cross-entropy against the target's distribution at the token it drafts (restricted to the
draft vocabulary), weighted 0.8^j as in EAGLE-3. The head never sees the data's next tokens as labels:
it learns what the target would say, which is what verification accepts.

A head run folder holds config.yaml, head.json (the tapped layers, the draft vocabulary's target ids, the
target's path and shape), checkpoints/ (the head's params, optimizer state and the data position), and
metrics.jsonl, whose evaluations estimate greedy acceptance on held-out text: accept_j, the share of rows
where drafts 1..j all equal the target's greedy tokens, and tokens_per_step, 1 + their sum (what a step
with k drafts makes at batch 1). Killed and started again, the run resumes from its last checkpoint
(bitwise: the data order is the checkpoint's). `load_head(folder)` (`jaxgen.inference.loading`) gives the
`eagle.Head` that `Generator(..., draft=head)`, the engine and serve.py (serve.draft=folder) draft with.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxgen import model
from jaxgen.config import Config, ConfigError, ModelConfig, save_config
from jaxgen.inference.loading import load_head  # noqa: F401 (the head run's reader, serving's too)
from jaxgen.model import eagle
from jaxgen.training.checkpoint import Checkpointer
from jaxgen.training.data.pipeline import PackedSequences, eval_batches, train_iterator
from jaxgen.training.data.tokens import load_splits
from jaxgen.training.metrics import MetricsWriter
from jaxgen.training.step import make_optimizer

STEP_WEIGHT = 0.8  # step j's loss weighs STEP_WEIGHT ** j (EAGLE-3's)
BATCH = ("inputs", "positions", "segment_ids")


@dataclass
class HeadResult:
    step: int
    status: str  # "finished", "already finished", "stopped"
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "accept", "tokens_per_step"}


def default_run_dir(cfg: Config) -> str:
    """Where a head's run goes by default: beside its target, `<target>-eagle3`."""
    return f"{str(cfg.draft.target).rstrip('/')}-{cfg.draft.kind}"


def losses(head: eagle.Head, target_params, tcfg: ModelConfig, batch: dict, k: int):
    """(weighted loss, {"loss_j" (k,), "match_j" (k,) greedy agreement, "accept" (k,) drafts 1..j all kept})
    of one batch of (B, T) inputs, positions and segment ids; positions past a row's end or its segment are
    masked (`eagle.shift` pads them with zeros)."""
    tokens, positions, segments = batch["inputs"], batch["positions"], batch["segment_ids"]
    x, _, features = model.hidden_states(target_params, tokens, positions, cfg=tcfg, segment_ids=segments,
                                         taps=head.layers)  # fmt: skip
    target_logits = jax.lax.stop_gradient(model.lm_head(target_params, x, tcfg))  # (B, T, V)
    target_greedy = jnp.argmax(target_logits, axis=-1)
    target_logp = jax.nn.log_softmax(jnp.take(target_logits, head.draft_to_target, axis=-1), axis=-1)  # (B, T, Vd)
    logits = eagle.train_forward(head, target_params["embed_vd"], jax.lax.stop_gradient(features), tokens,
                                 positions, segments, k)  # fmt: skip
    t = tokens.shape[1]
    rows = jnp.arange(t)
    total, per_step, match, hits = 0.0, [], [], []
    valid_all = positions >= 0  # rows where every step is valid: the acceptance estimate's
    for j in range(k):
        ahead = j + 1  # step j at row t drafts the token the target predicts at row t + j + 1
        valid = (rows[None] + ahead < t) & (eagle.shift(segments, ahead) == segments) & (positions >= 0)
        labels = eagle.shift(target_logp, ahead)
        ce = -(jnp.exp(labels) * jax.nn.log_softmax(logits[j], axis=-1)).sum(-1)
        count = jnp.maximum(valid.sum(), 1)
        per_step.append(jnp.where(valid, ce, 0.0).sum() / count)
        total = total + STEP_WEIGHT**j * per_step[-1]
        hit = eagle.to_target(head, jnp.argmax(logits[j], axis=-1)) == eagle.shift(target_greedy, ahead)
        match.append((hit & valid).sum() / count)
        hits.append(hit)
        valid_all = valid_all & valid
    kept = jnp.cumprod(jnp.stack(hits), axis=0).astype(bool)  # (k, B, T): drafts 1..j all right
    accept = (kept & valid_all).sum((1, 2)) / jnp.maximum(valid_all.sum(), 1)
    metrics = {"loss_j": jnp.stack(per_step), "match_j": jnp.stack(match), "accept": accept}
    return total, metrics


def make_step(head_static: eagle.Head, tcfg: ModelConfig, tx: optax.GradientTransformation, k: int):
    """The jitted train step: (state, target params, batch) -> (state, metrics); state is donated."""

    def step(state, target_params, batch):
        def objective(params):
            return losses(head_static.replace(params=params), target_params, tcfg, batch, k)

        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss, **metrics}

    return jax.jit(step, donate_argnums=0)


def make_eval(head_static: eagle.Head, tcfg: ModelConfig, k: int):
    return jax.jit(lambda params, target_params, batch: losses(head_static.replace(params=params), target_params,
                                                                tcfg, batch, k))  # fmt: skip


def train_head(cfg: Config, run_dir: str | Path, progress: bool = True) -> HeadResult:
    """Trains (or resumes) the draft head of `cfg.draft` in `run_dir`; the target stays as it is."""
    from jaxgen.inference.loading import load_model  # inference's loader: a run folder or a HF folder

    run_dir = Path(run_dir)
    tcfg, tokenizer, target_params = load_model(cfg.draft.target, param_dtype="float32")
    cfg = dataclasses.replace(cfg, model=tcfg)
    cfg.check_seq_len(f" (the target's, {cfg.draft.target})")
    eagle.check_layers(cfg.draft.layers, tcfg.num_layers)  # before the run folder is made
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / "head.json"
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    resuming = ckpt.latest_step() is not None
    splits = load_splits(cfg.data, tokenizer)
    if resuming:
        meta = json.loads(meta_path.read_text())
        _check_same_target(meta, cfg, tcfg, run_dir)
        d2t = np.asarray(meta["draft_to_target"], np.int32)
    else:
        d2t = eagle.frequent_tokens(splits["train"]["tokens"], tcfg.vocab_size, cfg.draft.vocab_size)
    head = eagle.new_head(tcfg, jax.random.key(cfg.training.seed), cfg.draft.layers, d2t)
    meta = head_meta(head, cfg, tcfg)
    tmp = meta_path.with_name(".head.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(meta_path)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer.save_folder(run_dir)

    source = _source(cfg, splits, tokenizer, tcfg, target_params, run_dir, progress)
    data = train_iterator(source, cfg.training.batch_size, cfg.training.seed)
    held_out = PackedSequences(splits["eval"]["tokens"], splits["eval"]["flags"], cfg.data.seq_len)
    evals = eval_batches(held_out, cfg.training.batch_size, cfg.data.eval_batches)
    tx = make_optimizer(cfg.optimizer, cfg.training.steps)
    state = {"params": head.params, "opt_state": tx.init(head.params), "step": jnp.zeros((), jnp.int32)}
    if resuming:
        state, data_state = ckpt.restore(ckpt.latest_step(), state)
        if data_state is not None:
            data.set_state(data_state)
        print(f"resuming the head from step {int(state['step'])} ({run_dir})", flush=True)
    k = cfg.draft.unroll
    step_fn, eval_fn = make_step(head, tcfg, tx, k), make_eval(head, tcfg, k)
    start, total = int(state["step"]), cfg.training.steps
    result = HeadResult(start, "already finished" if start >= total else "finished")
    writer = MetricsWriter(run_dir)
    stop = {"signal": None}
    old = {s: signal.signal(s, lambda n, f: stop.update(signal=n)) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(total=total, initial=start, disable=not progress, desc="eagle head", unit="step")
    try:
        step = start
        while step < total:
            batch = {key: jnp.asarray(v) for key, v in next(data).items() if key in BATCH}
            state, metrics = step_fn(state, target_params, batch)
            step += 1
            bar.update(1)
            if step % cfg.training.log_every == 0 or step == total:
                loss = float(metrics["loss"])
                result.losses.append(loss)
                writer.write({"step": step, "loss": loss, **_listed(metrics, "match_j")})
                bar.set_postfix(loss=f"{loss:.3f}")
            if step % cfg.training.eval_every == 0 or step == total:
                record = evaluate(eval_fn, state["params"], target_params, evals) | {"step": step}
                result.evals.append(record)
                writer.write(record)
                bar.write(f"step {step}: held-out loss {record['eval_loss']:.4f}, "
                          f"{record['tokens_per_step']:.2f} tokens per target step (greedy, k={k})")  # fmt: skip
            stopping = stop["signal"] or (cfg.training.steps_per_run and step - start >= cfg.training.steps_per_run)
            if step % cfg.checkpoint.every == 0 or step == total or stopping:
                ckpt.save(step, state, data.get_state())
            if stopping and step < total:
                result.status = "stopped"
                break
        result.step = step
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
        ckpt.close()
        writer.close()
    return result


def _listed(metrics: dict, *names) -> dict:
    return {n: [round(float(v), 4) for v in np.asarray(metrics[n])] for n in names}


def evaluate(eval_fn, params, target_params, batches) -> dict:
    """Mean held-out loss, per-step greedy agreement and acceptance, and the tokens per target step they
    estimate (1 + the sum of accept_j: drafts kept while all before them were)."""
    got = [eval_fn(params, target_params, {k: jnp.asarray(v) for k, v in b.items() if k in BATCH}) for b in batches]
    loss = float(np.mean([float(g[0]) for g in got]))
    accept = np.mean([np.asarray(g[1]["accept"]) for g in got], axis=0)
    match = np.mean([np.asarray(g[1]["match_j"]) for g in got], axis=0)
    return {
        "eval_loss": loss, "accept": [round(float(a), 4) for a in accept],
        "eval_match_j": [round(float(m), 4) for m in match], "tokens_per_step": 1.0 + float(accept.sum()),
    }  # fmt: skip


def head_meta(head: eagle.Head, cfg: Config, tcfg: ModelConfig) -> dict:
    return {
        "kind": cfg.draft.kind, "layers": list(head.layers), "target": str(cfg.draft.target),
        "target_d_model": tcfg.d_model, "target_num_layers": tcfg.num_layers, "target_vocab_size": tcfg.vocab_size,
        "draft_to_target": [int(i) for i in np.asarray(head.draft_to_target)],
    }  # fmt: skip


def _check_same_target(meta: dict, cfg: Config, tcfg: ModelConfig, run_dir: Path) -> None:
    seen = (meta["target_d_model"], meta["target_num_layers"], meta["target_vocab_size"], meta["layers"])
    now = (
        tcfg.d_model,
        tcfg.num_layers,
        tcfg.vocab_size,
        list(cfg.draft.layers or eagle.default_layers(tcfg.num_layers)),
    )
    if seen != now:
        raise ConfigError(
            f"head run {run_dir} was trained for a target of (d_model, layers, vocab, tapped) = {tuple(seen)}; "
            f"draft.target={cfg.draft.target} is {tuple(now)}: resume with the same target, or pass a new --run-dir"
        )


def _source(cfg, splits, tokenizer, tcfg, target_params, run_dir: Path, progress: bool):
    """The head's training examples: the corpus's packed windows, or the target's own continuations."""
    if cfg.draft.data == "corpus":
        return PackedSequences(splits["train"]["tokens"], splits["train"]["flags"], cfg.data.seq_len)
    path = run_dir / "generations.npy"
    if not path.exists():
        rows = generate_rows(cfg, splits["train"]["tokens"], tokenizer, tcfg, target_params, progress)
        tmp = path.with_name(".generations.npy.tmp")
        with tmp.open("wb") as f:
            np.save(f, rows)
        tmp.replace(path)
    return Generated(np.load(path))


def generate_rows(cfg: Config, tokens, tokenizer, tcfg, target_params, progress: bool) -> np.ndarray:
    """(generations, seq_len + 1) int32: windows of the corpus whose first quarter is kept as the prompt and
    the rest is the target's greedy continuation (data=generations)."""
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig

    t = cfg.data.seq_len + 1
    prompt = max(t // 4, 1)
    n = cfg.draft.generations
    starts = np.random.default_rng(cfg.training.seed).integers(0, len(tokens) - t, n)
    prompts = [[int(x) for x in tokens[s : s + prompt]] for s in starts]
    gen = Generator(target_params, tcfg, tokenizer, max_batch=32)
    rows = np.zeros((n, t), np.int32)
    sampling = SamplingConfig(max_new_tokens=t - prompt, ignore_eos=True)
    for lo in tqdm(range(0, n, 32), disable=not progress, desc="target generations", unit="batch"):
        for i, c in enumerate(gen.generate(prompts[lo : lo + 32], sampling)):
            seq = prompts[lo + i] + list(c.tokens)
            rows[lo + i, : len(seq)] = seq[:t]
    return rows


class Generated:
    """Training examples from whole rows of tokens (each one document, T + 1 tokens)."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        row = self.rows[int(i)]
        t = len(row) - 1
        return {"inputs": row[:-1], "targets": row[1:], "positions": np.arange(t, dtype=np.int32),
                "segment_ids": np.ones(t, np.int32), "loss_mask": np.ones(t, np.int32)}  # fmt: skip


def sampled_acceptance(head: eagle.Head, target_params, tcfg: ModelConfig, batches, temperatures) -> dict:
    """The first draft's acceptance on held-out `batches` at each temperature: {T: (exact, standard)}, where
    exact is jaxgen's rule with the head's greedy draft (kept when the target draws it: the target's
    probability of that token) and standard is standard speculative sampling with drafts drawn from the
    head's distribution q (expected acceptance, the sum over tokens of min(p, q)). Both at temperature T."""

    @jax.jit
    def one(head, target_params, batch, temperature):  # arguments: constants would be baked into the program
        tokens, positions, segments = batch["inputs"], batch["positions"], batch["segment_ids"]
        x, _, features = model.hidden_states(target_params, tokens, positions, cfg=tcfg, segment_ids=segments,
                                             taps=head.layers)  # fmt: skip
        p = jax.nn.softmax(eagle.shift(model.lm_head(target_params, x, tcfg), 1) / temperature, axis=-1)  # (B, T, V)
        logits = eagle.train_forward(head, target_params["embed_vd"], features, tokens, positions, segments, 1)[0]
        q_draft = jax.nn.softmax(logits / temperature, axis=-1)
        q = jnp.zeros_like(p).at[..., head.draft_to_target].set(q_draft)
        exact = jnp.take_along_axis(p, eagle.to_target(head, jnp.argmax(logits, -1))[..., None], axis=-1)[..., 0]
        standard = jnp.minimum(p, q).sum(-1)
        t = tokens.shape[1]
        valid = (jnp.arange(t)[None] + 1 < t) & (eagle.shift(segments, 1) == segments) & (positions >= 0)
        count = jnp.maximum(valid.sum(), 1)
        return jnp.where(valid, exact, 0).sum() / count, jnp.where(valid, standard, 0).sum() / count

    out = {}
    for temperature in temperatures:
        got = [
            one(head, target_params, {k: jnp.asarray(b[k]) for k in BATCH}, jnp.float32(temperature)) for b in batches
        ]
        out[temperature] = tuple(float(np.mean([float(g[i]) for g in got])) for i in (0, 1))
    return out
