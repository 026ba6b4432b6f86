"""The training state, optimizer, teacher-forcing loss and the jitted train step.

    state = create_train_state(cfg, mesh)
    step_fn = make_train_step(cfg, mesh, state)
    state, metrics = step_fn(state, batch)     # state is donated

A batch is a dict of (B, T) int32 arrays: inputs, targets, positions, segment_ids, loss_mask.

LoRA fine-tuning (`model.lora.rank > 0`): the state's params are the adapters alone (jaxgen.model.lora),
so the optimizer state and the checkpoints are the adapters' only; the frozen base weights are built by
`create_base` and passed to the step beside the state, never donated, differentiated or changed:

    base = create_base(cfg, mesh, params)      # params: starting weights (None: drawn from the seed)
    state = create_train_state(cfg, mesh, base)  # adapters and their optimizer state (DoRA: m from the base)
    step_fn = make_train_step(cfg, mesh, state, base)
"""

from __future__ import annotations

import functools
import logging

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgen import model, sharding
from jaxgen.config import Config, OptimizerConfig
from jaxgen.executables import Program
from jaxgen.model import lora, param_shardings, quant
from jaxgen.sharding import batch_sharding, with_mesh
from jaxgen.training.loss import head_cross_entropy

log = logging.getLogger(__name__)

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # () int32, optimizer steps taken (skipped ones included)
    params: dict  # float32 master weights (with LoRA: the adapters only)
    opt_state: optax.OptState
    rng: jax.Array  # for stochastic layers; folded with the step, never reused
    nonfinite_in_row: jax.Array  # () int32, consecutive skipped updates
    nonfinite_total: jax.Array  # () int32


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay, after global-norm clipping.

    Weight decay applies to matrices only (not to norms' scales and biases).
    """
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=_decay_mask,
    )  # fmt: skip
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


def _decay_mask(params):
    """True for weight matrices and embeddings; norms' scales and biases are not decayed."""
    matrices = ("w_", "embed_", "head_", "pos_embed_")
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key.startswith(matrices), params)


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to peak * min_lr_ratio at `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def create_train_state(cfg: Config, mesh, params: dict | None = None) -> TrainState:
    """Fresh state, created directly in its shardings (params and optimizer moments alike).

    params: starting weights already in their shardings (fine-tuning); None draws them at random.
    With LoRA `params` is the frozen base (`create_base`'s), read only by DoRA (`model.lora.dora`), whose
    magnitudes start at the base weights' norms; None: the base the seed draws (a run without init_from).
    """
    tx = make_optimizer(cfg.optimizer, cfg.training.steps)

    def rng(which: int):  # 0: the key the params are drawn with, 1: the state's key, 2: the adapters'
        return _seed_key(cfg, which)

    with jax.set_mesh(mesh):
        if cfg.model.lora.rank:  # the adapters are what trains; `params` is the base (see create_base)
            shardings = lora.lora_shardings(cfg.model, mesh)
            base = (params if params is not None else create_base(cfg, mesh)) if cfg.model.lora.dora else None
            params = jax.jit(lambda b: lora.init_lora(cfg.model, rng(2), b), out_shardings=shardings)(base)
        elif params is None:
            shardings = param_shardings(cfg.model, mesh)
            params = jax.jit(lambda: model.init_params(cfg.model, rng(0)), out_shardings=shardings)()
        opt_state = tx.init(params)  # eager, inside the mesh: moments take the params' shardings
        opt_state = jax.tree.map(lambda x: _onto_mesh(mesh, x), opt_state)
        return TrainState(
            step=_replicated(mesh, _zero), params=params, opt_state=opt_state, rng=_replicated(mesh, lambda: rng(1)),
            nonfinite_in_row=_replicated(mesh, _zero), nonfinite_total=_replicated(mesh, _zero),
        )  # fmt: skip


def _seed_key(cfg: Config, which: int):
    """Key `which` of the run's seed; 0 and 1 as before LoRA (so full training draws what it drew)."""
    return jax.random.split(jax.random.key(cfg.training.seed), 3 if which == 2 else 2)[which]


def create_base(cfg: Config, mesh, params: dict | None = None) -> dict | None:
    """The frozen base weights of a LoRA run (None without LoRA), held as `model.lora.base_dtype` says:
    `params` (fine-tuning, already in their shardings) or drawn from the seed as full training draws them
    (so a resumed run rebuilds the same base). int8, nf4: every matrix product's weight quantized
    (`jaxgen.model.quant.frozen_base`)."""
    if not cfg.model.lora.rank:
        return None
    with jax.set_mesh(mesh):
        if params is None:
            shardings = param_shardings(cfg.model, mesh)
            params = jax.jit(lambda: model.init_params(cfg.model, _seed_key(cfg, 0)), out_shardings=shardings)()
        return quant.frozen_base(params, cfg.model.lora.base_dtype)


def _zero():
    return jnp.zeros((), jnp.int32)


def _onto_mesh(mesh, x):
    """x if it is on the mesh already (the moments); stray scalars (optax's counts) replicated onto it."""
    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
        return x
    value = np.asarray(x)
    return _replicated(mesh, lambda: value)


def _replicated(mesh, make):
    """make() on every device of the mesh, other processes' included (device_put reaches only this process's)."""
    return jax.jit(make, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))()


def cross_entropy(logits_btv, targets_bt, mask_bt):
    """Summed next-token negative log-likelihood over unmasked positions, and their count.

    -log softmax(logits)[target] computed as logsumexp(logits) - logits[target], in float32. The target
    logit is picked by a comparison with the vocabulary index rather than a gather: its gradient is then
    an elementwise select that fuses with the softmax's, not a scatter (0.45 s of a 2 s LM-head backward
    on llama-small at 8 x 256 tokens).
    """
    logits = logits_btv.astype(jnp.float32)
    is_target = jnp.arange(logits.shape[-1]) == targets_bt[..., None]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    mask = mask_bt.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def loss_sum(params, batch, cfg: Config, chunked: bool = True):
    """(The objective summed over tokens, (its language-model part, the token count, the router
    losses)). The objective adds, for a mixture of experts, router_aux_coef times the load-balancing
    loss and router_z_coef times the z-loss, each weighted by the token count so that the mean over
    the batch carries them once. chunked: the head and loss in chunks of `training.loss_chunk` tokens
    with the gradient formed on the way (training.loss; for a step that differentiates this), else
    the whole logits at once (evaluation)."""
    m = cfg.model
    args = (params, batch["inputs"], batch["positions"])
    if chunked and cfg.training.loss_chunk:
        x, _, router = model.hidden_states(*args, cfg=m, segment_ids=batch["segment_ids"], with_aux=True)
        chunk = cfg.training.loss_chunk
        total, count = head_cross_entropy(params, x, batch["targets"], batch["loss_mask"], m, chunk)
    else:
        logits, _, router = model.forward(*args, cfg=m, segment_ids=batch["segment_ids"], with_aux=True)
        total, count = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    objective = total
    if m.num_experts:
        objective = total + count * (m.router_aux_coef * router["router_aux"] + m.router_z_coef * router["router_z"])
    return objective, (total, count, router)


def _accumulate_grads(params, batch, cfg: Config, base: dict | None = None):
    """Gradient of the token-summed objective over `grad_accum` micro-batches (lax.scan); returns the
    language-model loss sum, the token count, the gradients and the router losses (micro-batch mean).
    base: LoRA's frozen weights (`params` are then the adapters, the only thing differentiated).

    On a mesh with a data axis (`_replica_axes` says where not), each data replica sums the gradients of its
    own rows over the micro-batches and the replicas' sums are added once, after the last micro-batch: one
    all-reduce over `data` a step, not one per micro-batch. Within a replica, fsdp reduce-scatters each
    micro-batch's gradient onto the parameters' shards (holding it whole would undo what fsdp saves), unless
    `training.accumulate_whole`: then the weights are gathered once (`_gathered_once`), each device is a
    replica of its own rows over data x fsdp, and the sum over both runs once a step (`_onto_shards`)."""
    a = cfg.training.grad_accum
    axes = _replica_axes(cfg, batch["inputs"].shape[0] // a) if a > 1 else ()
    names = _param_names(cfg, base is not None) if "fsdp" in axes else None
    if "fsdp" in axes:
        params = _gathered_once(params, names, cfg)
        base = None if base is None else _gathered_once(base, _param_names(cfg, False), cfg)
    objective = loss_sum if base is None else lambda adapters, b, c: loss_sum(lora.attach(base, adapters), b, c)
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if a == 1:
        (_, (total, count, router)), grads = grad_fn(params, batch, cfg)
        return total, count, grads, router

    def split(x):  # (B, T) -> (A, B/A, T), micro-batch j = rows j, A + j, ... (spread over devices)
        return x.reshape(x.shape[0] // a, a, *x.shape[1:]).swapaxes(0, 1)

    sums = grad_fn if not axes else functools.partial(_per_replica, grad_fn, axes=axes)

    def body(carry, micro):
        total, count, grads, router = carry
        (_, (t, c, r)), g = sums(params, micro, cfg)
        router = jax.tree.map(lambda x, y: x + y / a, router, r)
        return (total + t, count + c, jax.tree.map(lambda s, x: s + x.astype(s.dtype), grads, g), router), None

    lead = (_size(axes),) if axes else ()
    zero = lambda shape, dtype=jnp.float32: _split_over(jnp.zeros((*lead, *shape), dtype), axes)
    carry = (zero(()), zero(()), jax.tree.map(lambda p: zero(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params))
    no_router = {"router_aux": jnp.zeros(()), "router_z": jnp.zeros(())}
    (total, count, grads, router), _ = jax.lax.scan(body, (*carry, no_router), jax.tree.map(split, batch))
    if axes:  # the step's one sum over the replicas
        total, count = total.sum(0), count.sum(0)
    if "fsdp" in axes:  # straight onto the weights' shards
        grads = jax.tree.map(functools.partial(_onto_shards, axes=axes), grads, names)
    elif axes:
        grads = jax.tree.map(lambda x: x.sum(0), grads)
    return total, count, grads, router


def _size(axes: tuple[str, ...]) -> int:
    return int(np.prod([sharding.axis_size(a) for a in axes]))


def _replica_axes(cfg: Config, micro_rows: int) -> tuple[str, ...]:
    """The mesh axes whose devices accumulate their own gradients (`_accumulate_grads`): `data` and, with
    `training.accumulate_whole`, `fsdp` (those of size > 1; data alone where the micro-batch's rows do not
    split over both); none (everything as one, summed every micro-batch) where the rows do not split over
    them, for a mixture of experts (its load-balancing loss is a function of a whole micro-batch's routing,
    which per-replica sums would change), and on a context mesh (ring attention's shard_map under the vmap
    is untried). Where accumulate_whole cannot apply, it says why, once."""
    whole = cfg.training.accumulate_whole and sharding.axis_size("fsdp") > 1
    for wanted in [("data", "fsdp"), ("data",)] if whole else [("data",)]:
        axes = tuple(a for a in wanted if sharding.axis_size(a) > 1)
        if axes and not micro_rows % _size(axes) and not cfg.model.num_experts and sharding.context_size() == 1:
            return axes
        if "fsdp" in wanted:
            _say_once(f"training.accumulate_whole: not applied (micro-batches of {micro_rows} rows over "
                      f"{_size(axes)} data x fsdp devices, num_experts={cfg.model.num_experts}, context "
                      f"{sharding.context_size()}): each micro-batch's gradient is reduce-scattered "
                      "over fsdp")  # fmt: skip
    return ()


@functools.cache
def _say_once(message: str) -> None:
    log.warning(message)


def _gathered_once(params, names, cfg: Config):
    """`params` (or LoRA's frozen base) cast to model.dtype and gathered over fsdp once, outside the micro-batch
    loop (`training.accumulate_whole`), to be used in their place: the gradient with respect to the cast copy
    is the one with respect to the float32 weights (the cast's transpose casts it back), added up in float32
    by `_accumulate_grads`. Quantized weights (`quant.is_q`) stay as they are placed."""
    dtype = jnp.dtype(cfg.model.dtype)

    def whole(p, n):
        if quant.is_q(p):  # int8 or NF4 (a LoRA base): left as placed, gathered where it is used
            return p
        return sharding.constrain(p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, n)

    with sharding.vmapped_over("fsdp"):  # each weight's rule with fsdp left out: whole over fsdp
        return jax.tree.map(whole, params, names, is_leaf=quant.is_q)


def _onto_shards(g, names, axes: tuple[str, ...]):
    """Per-device whole gradients g (R, ...) (R over `axes`: data and fsdp) summed onto the weight's shards
    (`names` its logical axes): a reduce-scatter over fsdp along the dimension fsdp splits (an all-reduce
    where it splits none), then a sum of the shard over data; each device's block in, the weight's shard
    out. Written out (shard_map): left to the partitioner, the sum was an all-reduce of the whole float32
    gradient followed by a slice, twice the bytes (libtpu 0.0.42.1)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = sharding.logical_spec(names, g.shape[1:], mesh)
    # an entry may name fsdp with another axis ("embed": fsdp and context); context is 1 here (_replica_axes)
    split = lambda entry: entry == "fsdp" or (isinstance(entry, tuple) and "fsdp" in entry)
    dim = next((i for i, entry in enumerate(spec) if split(entry)), None)
    block = jax.sharding.PartitionSpec(axes, *(None if split(entry) else entry for entry in spec))

    def local(x):  # (1, ...): this device's whole gradient (split over tensor as the weight is)
        if dim is None:
            return jax.lax.psum(x[0], axes)
        x = jax.lax.psum_scatter(x[0], spec[dim], scatter_dimension=dim, tiled=True)
        return jax.lax.psum(x, "data") if "data" in axes else x

    return jax.shard_map(local, mesh=mesh, in_specs=block, out_specs=spec, check_vma=False)(g)


def _param_names(cfg: Config, adapters: bool):
    """The logical axis names of each trained array, a tuple per array: LoRA's adapters (`adapters`) or the
    model's weights."""
    specs = lora.lora_specs(cfg.model) if adapters else model.param_specs(cfg.model)
    return jax.tree.map(lambda s: s.names, specs, is_leaf=lambda x: isinstance(x, model.ParamSpec))


def _per_replica(grad_fn, params, micro, cfg: Config, axes: tuple[str, ...]):
    """`grad_fn` of each replica's own rows of `micro` ((B', T) -> R x (B' / R, T): replica r's rows are those
    its devices hold), vmapped over the replicas with the mapped axis split over `axes` (data, and fsdp with
    `training.accumulate_whole`): the loss and token sums (R,) and the gradients (R, ...), nothing added across
    replicas. Same structure as `grad_fn`'s result (its router losses, zeros here: `_replica_axes` leaves
    mixtures of experts out, averaged)."""
    rows = jax.tree.map(lambda x: x.reshape(_size(axes), x.shape[0] // _size(axes), *x.shape[1:]), micro)
    with sharding.vmapped_over(*axes):
        (_, (t, c, r)), g = jax.vmap(lambda m: grad_fn(params, m, cfg), spmd_axis_name=axes)(rows)
    t, c, g = jax.tree.map(lambda x: _split_over(x, axes), (t, c, g))
    return (None, (t, c, jax.tree.map(lambda x: x.mean(0), r))), g


def _split_over(x, axes: tuple[str, ...]):
    """A per-replica array (R, ...) held a replica per index of `axes` (the rest as the compiler places it)."""
    if not axes:
        return x
    rest = (jax.sharding.PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes, *rest))


def apply_grads(state: TrainState, grads, loss, tx: optax.GradientTransformation):
    """(the state after one optimizer step, the gradient norm, finite): a non-finite loss or gradient
    skips the update and counts the skip. Shared by the train step and the RL step."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(_):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    # A cond, not `where(finite, new, old)`: the select kept the old params and moments alive beside
    # the new ones, so the update could not run in place (measured 16.9 s -> 13.0 s, gpt2-124m on CPU).
    params, opt_state = jax.lax.cond(finite, update, lambda _: (state.params, state.opt_state), None)
    skipped = (~finite).astype(jnp.int32)
    state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        nonfinite_in_row=(state.nonfinite_in_row + skipped) * skipped,
        nonfinite_total=state.nonfinite_total + skipped,
    )
    return state, grad_norm, finite


def train_step(
    state: TrainState, batch: dict, base: dict | None = None, *, cfg: Config, tx: optax.GradientTransformation
):
    """One optimizer step with teacher forcing; a non-finite loss or gradient skips the update.
    base: LoRA's frozen weights, read only (None: full training)."""
    total, count, grads, router = _accumulate_grads(state.params, batch, cfg, base)
    count = jnp.maximum(count, 1.0)
    loss = total / count  # token-weighted mean over the whole batch
    grads = jax.tree.map(lambda g: g / count, grads)
    state, grad_norm, finite = apply_grads(state, grads, loss, tx)
    lr = lr_schedule(cfg.optimizer, cfg.training.steps)(state.step - 1)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "finite": finite, "lr": lr}
    if cfg.model.num_experts:  # the language-model loss above; the router's own losses beside it
        metrics |= router
    return state, metrics


def eval_step(params, batch, base: dict | None = None, *, cfg: Config):
    params = params if base is None else lora.attach(base, params)
    _, (total, count, _) = loss_sum(params, batch, cfg, chunked=False)  # no gradient: nothing to form on the way
    return total, count


def state_shardings(state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)


PREFERENCE_KEYS = ("answer", "pairs", "reference")  # a preference batch's arrays beside BATCH_KEYS


def batch_shapes(cfg: Config, width: int = 1) -> dict[str, tuple[int, ...]]:
    """The global shape of each array of a training batch: (B, T) token arrays; with a preference objective
    also each target's answer (B, T) and, for the up to `width` pairs a row holds, which it holds (B, width)
    and the reference's scores (B, width, 2) (`data.pipeline.PreferencePairs`, jaxgen.training.preference)."""
    b, t = cfg.training.batch_size, cfg.data.seq_len
    shapes = {k: (b, t) for k in BATCH_KEYS}
    if cfg.training.objective == "sft":
        return shapes
    return shapes | {"answer": (b, t), "pairs": (b, width), "reference": (b, width, 2)}


def make_train_step(cfg: Config, mesh, state: TrainState, base: dict | None = None, fn=None, shapes=None):
    """The jitted, state-donating step `step(state, batch)`, with the state's and the batch's shardings
    fixed; with LoRA's `base` (see create_base), the step reads it (not donated) on every call. fn: the step
    (default `train_step`; a preference objective's is `preference.preference_step`); shapes: the batch's
    (default `batch_shapes(cfg)`)."""
    tx = make_optimizer(cfg.optimizer, cfg.training.steps)
    batch_sh = {k: batch_sharding(mesh, shape) for k, shape in (shapes or batch_shapes(cfg)).items()}
    state_sh = state_shardings(state)
    in_sh = (state_sh, batch_sh) if base is None else (state_sh, batch_sh, _shardings(base))
    fn = fn or train_step
    step = Program(functools.partial(fn, cfg=cfg, tx=tx), fn.__name__, step_key(cfg, fn), in_shardings=in_sh,
                   out_shardings=(state_sh, None), donate_argnums=0)  # fmt: skip
    return with_mesh(step, mesh) if base is None else _with_base(step, base, mesh)


def make_eval_step(cfg: Config, mesh, state: TrainState, base: dict | None = None, fn=None, shapes=None):
    """The jitted `eval(params, batch) -> (loss sum, token count)`; with LoRA, params are the adapters. fn:
    the evaluation (default `eval_step`; a preference objective's, `preference.preference_eval`, returns
    (loss sum, pairs, correctly ranked pairs)); shapes: as make_train_step's."""
    batch_sh = {k: batch_sharding(mesh, shape) for k, shape in (shapes or batch_shapes(cfg)).items()}
    params_sh = state_shardings(state).params
    in_sh = (params_sh, batch_sh) if base is None else (params_sh, batch_sh, _shardings(base))
    fn = fn or eval_step
    fn = Program(functools.partial(fn, cfg=cfg), fn.__name__, step_key(cfg, fn), in_shardings=in_sh)
    return with_mesh(fn, mesh) if base is None else _with_base(fn, base, mesh)


def step_key(cfg: Config, fn) -> str:
    """What a train or evaluation step closes over, as text (`jaxgen.executables.Program`'s key): the function
    and the config sections the step reads (the optimizer is built from them)."""
    return f"{fn.__module__}.{fn.__qualname__}|{cfg.model!r}|{cfg.optimizer!r}|{cfg.training!r}|{cfg.preference!r}"


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _with_base(jitted, base: dict, mesh):
    """fn(x, batch) calling jitted(x, batch, base) under the mesh; `.jitted` is the jitted function (for
    `.lower()`, which then takes the base as its third argument)."""
    call = with_mesh(lambda x, batch: jitted(x, batch, base), mesh)
    call.jitted = jitted
    return call


def put_batch(batch: dict, mesh, global_batch: int | None = None, keys: tuple[str, ...] | None = None) -> dict:
    """Places this process's numpy rows (`process_rows` of the global batch) as global arrays sharded over
    the batch axis. global_batch: rows in all (default: this process's rows, i.e. a single process).
    keys: the arrays of `batch` placed (default: a training batch's, with a preference batch's reference)."""
    keys = keys or tuple(k for k in (*BATCH_KEYS, *PREFERENCE_KEYS) if k in batch)
    out = {}
    for k in keys:
        local = batch[k]
        global_shape = (global_batch or local.shape[0], *local.shape[1:])
        out[k] = jax.make_array_from_process_local_data(batch_sharding(mesh, global_shape), local, global_shape)
    return out
