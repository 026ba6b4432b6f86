"""Will it fit? Per-device memory of a config on a mesh, from the real programs compiled for fake devices.

    python -m jaxgen.plan --config configs/llama-3.1-8b.yaml --mesh fsdp=8 --device h100-80gb
    python -m jaxgen.plan --config configs/llama-3.2-1b.yaml --mesh data=2,fsdp=4 --device v5p model.remat=full
    python -m jaxgen.plan --config configs/llama-3.1-8b.yaml --mesh tensor=8 --engine --quantize int8 \
        serve.slots=64 serve.kv_memory_gb=40 serve.cache_dtype=bfloat16   # the serving engine's steps
    python -m jaxgen.plan --config configs/llama-3.2-1b.yaml --max-seq --mesh fsdp=8 --mesh fsdp=2,context=4 \
        --device h100-80gb,v5p --remat none,full     # the longest sequence that fits (search_longest)

The train step, and the prefill and decode programs of the generator for `--slots` x `--cache-len`, are
lowered and compiled on a mesh of fake CPU devices from `jax.ShapeDtypeStruct` inputs carrying their
shardings: nothing is allocated, so a 70B model plans on a laptop. Parameters, optimizer state, the KV
cache and gradients are counted exactly from shapes and shardings; activations and other temporaries
are XLA:CPU's buffer assignment for the same program (an estimate of what a GPU or TPU compiler
assigns: same algorithm, different fusion and scheduling). Fused attention kernels (cudnn, splash) are
planned with `blockwise`, which keeps the same O(T) residuals; `dense` is planned as itself.

Prefill and decode run their layers unrolled (a Python loop: each layer its own cache buffers), so their
compile time grows with depth. A model deeper than 4 layers is compiled at 3 and 4 layers and every byte
count extrapolated along the line through them (`by_depth`): inference keeps no per-layer residuals, so
parameters and cache grow by one layer's share a layer, exactly, and temporaries by a fixed amount a layer.
tests/test_plan_prefill.py checks it against the full compile of a 5-layer model, with and without a
context axis (tolerance 1%; jax 0.10.2: equal to the byte; 0.12: 0.6% under). Not 2 and 3 layers: on jax
0.12 XLA:CPU's 2-layer program reuses buffers the deeper ones do not (its second layer adds 13% less),
a line from it falls ever lower with depth. Against full compiles of Llama 3.1 8B (32
layers) at 188k tokens and 3.2 1B at 128k: within 0.01% (24 s against 140 s to compile the 8B); at 8k
tokens the 1B's full program holds one more buffer: 2.1% under (docs/accelerators.md). It assumes layers
alike in memory.

Serving: `--engine` plans the serving engine's own steps instead (`engine_programs`: its largest prefill call
and its decode chunk over the paged cache, with the page pool, grammar table and decode state the engine
allocates, all from `serve.*`), and `--quantize int8` holds the weights as `serve.quantize=int8` does.

On a mesh with a context axis the prefill planned by `--max-seq` is the Generator's (`inference.decode.
prefill`: the whole prompt at once, `fresh=True`, ring or allgather attention over the split prompt, the
cache split over context); elsewhere the engine's chunked prefill (`--prefill-chunk`). The search itself
lives in `jaxgen.plan_length`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys

from jaxgen.plan_length import MAX_SEQ_TOP, REMATS, at_length, format_max_seq, max_seq_table, size_text

# device kind -> (bytes of memory per device, backend); vendors' decimal figures
DEVICES = {
    "h100-80gb": (80e9, "gpu"), "h200-141gb": (141e9, "gpu"), "a100-80gb": (80e9, "gpu"), "a100-40gb": (40e9, "gpu"),
    "v4": (32e9, "tpu"), "v5e": (16e9, "tpu"), "v5p": (95e9, "tpu"), "v6e": (32e9, "tpu"),
}  # fmt: skip
HEADROOM = 0.9  # of a device's memory a plan may use: the runtime, fragmentation, compiled code
MAX_DEVICES = 4096  # fake CPU devices: XLA makes 4096 in seconds; far more take minutes or crash it
# the largest --slots, --cache-len and --prefill-chunk: positions and page offsets are int32
LIMITS = {"slots": 2**20, "cache_len": 2**24, "prefill_chunk": 2**24}


@dataclasses.dataclass
class Program:
    """Per-device bytes of one compiled program: exact parts from shapes, temporaries from XLA."""

    name: str
    parts: dict[str, float]  # e.g. parameters, optimizer state, gradients, KV cache
    temporaries: float  # XLA's temp buffers: activations, gradients, workspace
    arguments: float  # what the program takes (parameters, state, cache, batch)
    holds: str = "activations, gradients, workspace"  # what the temporaries are

    outputs: float = 0.0  # what it returns beyond what it writes over its (donated) arguments
    reference: bool = False  # shown for comparison only (a LoRA run's full fine-tune): not in the verdict
    costs: object = None  # the compiler's counts per device (`targets.roofline.Costs`), where asked for
    oom: str | None = None  # the compiler's own out-of-memory message (a target's compiler refused the program)

    @property
    def peak(self) -> float:
        return self.arguments + self.temporaries + self.outputs


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1} (and 'context' when given)."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in (*sizes, "context") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh item {item!r} is not allowed: data=N, fsdp=N, tensor=N or context=N with N >= 1")
        sizes[name] = int(value)
    if math.prod(sizes.values()) > MAX_DEVICES:
        raise ValueError(f"--mesh {text} is not allowed: {math.prod(sizes.values())} devices; at most {MAX_DEVICES}")
    return sizes


def per_device_bytes(tree) -> float:
    """Bytes each device holds of abstract arrays with shardings (the largest shard, as XLA pads)."""
    total = 0
    for x in _leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * x.dtype.itemsize
    return float(total)


def _leaves(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def abstract_params(model_cfg, mesh, dtype="float32"):
    """The parameters as ShapeDtypeStructs in their shardings (`dtype`: how they are held)."""
    import jax

    from jaxgen.model import param_shardings
    from jaxgen.model.params import param_specs

    shardings = param_shardings(model_cfg, mesh)
    specs = param_specs(model_cfg)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, jax.numpy.dtype(dtype), sharding=sh),
        specs, shardings, is_leaf=lambda x: hasattr(x, "init"),
    )  # fmt: skip


def _per_layer(params, mesh):
    """Abstract params as decoding holds them (`model.unstack_layers`): `layers` a list of per-layer
    weights, each sharded as its stacked (L, ...) array is past the L axis."""
    import jax

    def one(x):
        spec = tuple(x.sharding.spec)[1:]
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)

    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    return params | {"layers": [jax.tree.map(one, params["layers"]) for _ in range(num_layers)]}


class _NoMemory:
    """The memory analysis of a program its compiler refused for want of memory: every figure unknown."""

    def __init__(self, message: str):
        self.message = message
        self.temp_size_in_bytes = self.argument_size_in_bytes = math.inf
        self.output_size_in_bytes = self.alias_size_in_bytes = 0.0


def _compile(fn, *args, options: dict | None = None):
    """(memory analysis, `roofline.Costs`, optimised HLO text) of `fn` compiled for `args` (abstract, on
    their devices), with the compiler's `options`. A target's compiler refuses a program that does not fit:
    then (`_NoMemory`, None, "")."""
    import jax

    from jaxgen.targets.roofline import costs_of

    try:
        compiled = fn.lower(*args).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _NoMemory(str(e).strip().splitlines()[0]), None, ""
    return compiled.memory_analysis(), costs_of(compiled), compiled.as_text()


def _oom(mem) -> str | None:
    return getattr(mem, "message", None)


def train_programs(cfg, mesh, costs: bool = False) -> list[Program]:
    """The train step as configured; a LoRA run's beside the full fine-tune's of the same model, for scale."""
    if not cfg.model.lora.rank:
        return [train_program(cfg, mesh, costs=costs)]
    full = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora, rank=0))
    )
    return [train_program(full, mesh, reference=True), train_program(cfg, mesh, costs=costs)]


def train_program(cfg, mesh, reference: bool = False, costs: bool = False) -> Program:
    """The real train step (`training.step.train_step`), compiled for abstract state and batch: for a LoRA
    run (`model.lora.rank`) the adapters and their moments are the state and the frozen base rides beside.
    `costs`: also the compiler's counts of the step (`train_costs`: two more compiles)."""
    params, opt_state, base, mem = _train_step(cfg, mesh)[:4]
    param_bytes = per_device_bytes(params)
    lora = cfg.model.lora
    if lora.rank:
        name = f"train step (LoRA rank {lora.rank}, {lora.base_dtype} base)"
        parts = {
            f"base ({lora.base_dtype}, frozen)": per_device_bytes(base),
            "adapters (float32)": param_bytes,
            "optimizer state": per_device_bytes(opt_state),
            "gradients (adapters)": param_bytes,
        }
    else:
        name = "train step (full fine-tune, for comparison)" if reference else "train step"
        parts = {
            "parameters (float32)": param_bytes,
            "optimizer state": per_device_bytes(opt_state),
            "gradients (float32)": param_bytes,
        }
    return Program(
        name, parts, float(mem.temp_size_in_bytes), float(mem.argument_size_in_bytes), outputs=_new_outputs(mem),
        reference=reference, costs=train_costs(cfg, mesh) if costs and not _oom(mem) else None, oom=_oom(mem),
    )  # fmt: skip


def _train_step(cfg, mesh, unrolled: bool = False):
    """(params, opt_state, base, memory analysis, costs, HLO text) of the train step compiled on `mesh` for
    abstract inputs; `unrolled`: its layers a Python loop (params' `layers` a list) instead of a `lax.scan`."""
    import jax

    from jaxgen.training import step as train

    tx = train.make_optimizer(cfg.optimizer, cfg.training.steps)
    state, base = abstract_train_state(cfg, mesh, unrolled)
    params, opt_state = state.params, state.opt_state
    batch = abstract_batch(cfg, mesh)
    shardings = functools.partial(jax.tree.map, lambda x: x.sharding)
    step = jax.jit(
        functools.partial(train.train_step, cfg=_plannable(cfg, mesh), tx=tx),
        in_shardings=(shardings(state), shardings(batch), shardings(base)), out_shardings=(shardings(state), None),
        donate_argnums=0,
    )  # fmt: skip
    options = COUNTING_OPTIONS if unrolled and jax.default_backend() == "tpu" else None
    with jax.set_mesh(mesh):
        mem, costs, text = _compile(step, state, batch, base, options=options)
    return params, opt_state, base, mem, costs, text


# libtpu's options for the compiles whose counts `train_costs` reads: no windowed einsum, which splits a product
# whose weight is gathered (or gradient reduce-scattered) over a wide fsdp axis into a loop of partial products;
# the compiler counts a loop's body once, and Llama 3.1 70B over fsdp=32 then counted 0.55x its products'
# flops (an estimated MFU above 100%). The same products, unsplit: the same flops, counted whole.
COUNTING_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


def abstract_train_state(cfg, mesh, unrolled: bool = False):
    """(TrainState, LoRA's frozen base or None) as ShapeDtypeStructs in the shardings `create_train_state`
    and `create_base` give them on `mesh` (a target's compile-only devices too); `unrolled`: as
    `_train_step`'s."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgen.training import step as train

    tx = train.make_optimizer(cfg.optimizer, cfg.training.steps)
    lora = cfg.model.lora
    base = _abstract_base(cfg.model, mesh) if lora.rank else None
    params = abstract_adapters(cfg.model, mesh) if lora.rank else abstract_params(cfg.model, mesh)
    if unrolled:
        params = _per_layer(params, mesh)
        base = _per_layer(base, mesh) if base is not None else None
    scalar = jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    opt_state = _like_params(jax.eval_shape(tx.init, params), params, scalar.sharding)
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = train.TrainState(
        step=scalar, params=params, opt_state=opt_state, rng=key.update(sharding=scalar.sharding),
        nonfinite_in_row=scalar, nonfinite_total=scalar,
    )  # fmt: skip
    return state, base


def abstract_batch(cfg, mesh) -> dict:
    """A next-token training batch as ShapeDtypeStructs in `put_batch`'s shardings on `mesh`."""
    import jax

    from jaxgen.sharding import batch_sharding
    from jaxgen.training import step as train

    shape = (cfg.training.batch_size, cfg.data.seq_len)
    token = jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=batch_sharding(mesh, shape))
    return dict.fromkeys(train.BATCH_KEYS, token)


def train_costs(cfg, mesh):
    """The compiler's counts (`roofline.Costs`, per device) of one train step of `cfg` on `mesh`. The
    compiler counts a loop's body once, so the step is compiled with its layers unrolled at 1 and 2 layers
    and extrapolated in depth, and with one micro-batch of `batch_size / grad_accum` rows, times
    `grad_accum` (the optimizer's update, counted that many times, is a small share). Attention other than
    dense is a custom call or a loop over key blocks, which the compiler does not count whole: its flops
    are added as the model's (`kernel_attention_flops`)."""
    from jaxgen.targets.roofline import along_depth

    accum = cfg.training.grad_accum
    micro = dataclasses.replace(cfg.training, grad_accum=1, batch_size=cfg.training.batch_size // accum)
    at = lambda depth: _train_step(
        dataclasses.replace(cfg, training=micro, model=dataclasses.replace(cfg.model, num_layers=depth)),
        mesh, unrolled=True,
    )[4]  # fmt: skip
    costs = along_depth(at(1), at(2), cfg.model.num_layers).scaled(accum)
    return dataclasses.replace(costs, flops=costs.flops + kernel_attention_flops(cfg, mesh))


def kernel_attention_flops(cfg, mesh) -> float:
    """Per device, the flops of one train step's attention that the compiler's count misses: all of it
    where a fused kernel runs it (a custom call: splash, cuDNN), nearly all where blockwise, ring or
    allgather attention runs it as a loop over key blocks (whose body the count holds once); 0 for dense
    attention, a product the compiler counts whole. Added as the model's count (`flops_per_token`'s 12 L T
    N H a token: the whole T x T square, forward and backward), plus the forward again under remat."""
    import jax

    from jaxgen.model import kernels

    impl = kernels.fit_length(kernels.choose(cfg.model, jax.default_backend()), cfg.data.seq_len, cfg.model)
    if impl == "dense":
        return 0.0
    m, t = cfg.model, cfg.data.seq_len
    passes = 12.0 + (4.0 if m.remat != "none" else 0.0)
    tokens = cfg.training.batch_size * t
    return passes * m.num_layers * t * m.num_heads * m.head_size * tokens / mesh.devices.size


def abstract_adapters(model_cfg, mesh):
    """A LoRA run's adapters as float32 ShapeDtypeStructs in their shardings."""
    import jax

    from jaxgen.model import lora

    specs, shardings = lora.lora_specs(model_cfg), lora.lora_shardings(model_cfg, mesh)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, jax.numpy.float32, sharding=sh),
        specs, shardings, is_leaf=lambda x: hasattr(x, "init"),
    )  # fmt: skip


def _abstract_base(model_cfg, mesh):
    """A LoRA run's frozen base as `model.lora.base_dtype` holds it (`training.step.create_base`); int8 and
    nf4: the shapes and shardings of `quant.frozen_base` over the sharded float32 weights."""
    import jax

    from jaxgen.model import quant

    kind = model_cfg.lora.base_dtype
    if kind not in ("int8", "nf4"):
        return abstract_params(model_cfg, mesh, kind)
    params = abstract_params(model_cfg, mesh)
    hold = functools.partial(quant.frozen_base, kind=kind)
    with jax.set_mesh(mesh):
        placed = jax.jit(hold).lower(params).compile().output_shardings
    shapes = jax.eval_shape(hold, params)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, placed)


def _new_outputs(mem) -> float:
    return float(max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0))


def _like_params(opt_shapes, params, replicated):
    """The optimizer state's abstract leaves in the shardings training gives them: a moment (its path
    ends with a parameter's path) like that parameter, anything else (counts) replicated."""
    import jax

    by_path = {_keys(path): x.sharding for path, x in jax.tree_util.tree_leaves_with_path(params)}

    def place(path, x):
        keys = _keys(path)
        for start in range(len(keys)):
            if keys[start:] in by_path:
                return x.update(sharding=by_path[keys[start:]])
        return x.update(sharding=replicated)

    return jax.tree_util.tree_map_with_path(place, opt_shapes)


def _keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _plannable(cfg, mesh):
    """The config compiled on fake CPU devices (its model as `_plannable_model` plans it on `mesh`)."""
    return dataclasses.replace(cfg, model=_plannable_model(cfg.model, mesh, on=mesh))


def inference_programs(
    model_cfg, mesh, slots: int, cache_len: int, chunk: int, dtype: str, decode: bool = True,
    quantize: str = "none",
) -> list[Program]:  # fmt: skip
    """A prefill chunk of `chunk` tokens per slot at the end of a `cache_len` cache, and (`decode`) one
    decode step, with weights and cache in `dtype` (what serving holds; see `--param-dtype`): the engine's
    programs. `quantize`: "int8" holds the matrix products' weights in int8 as `serve.quantize=int8` does
    ("int8+embedding": the embedding and head too, `serve.quantize_embedding`). A model deeper than
    PROBE_DEPTHS[-1] layers is compiled at PROBE_DEPTHS and extrapolated (`by_depth`)."""
    one = lambda m: _inference_programs(m, mesh, slots, cache_len, chunk, dtype, decode, quantize)
    return by_depth(one, model_cfg)


def _inference_programs(model_cfg, mesh, slots, cache_len, chunk, dtype, decode, quantize="none") -> list[Program]:
    import jax

    from jaxgen import model
    from jaxgen.sharding import batch_sharding

    model_cfg = dataclasses.replace(_plannable_model(model_cfg, on=mesh), dtype=dtype)
    params, weights = _held(_per_layer(abstract_params(model_cfg, mesh, dtype), mesh), dtype, quantize)
    cache = _abstract_cache(model_cfg, mesh, slots, cache_len, dtype)

    def step(params, tokens, positions, cache):  # what the generator and engine run: the head at the last token only
        x, cache = model.hidden_states(params, tokens, positions, cache, cfg=model_cfg)
        return model.lm_head(params, x[:, -1:], model_cfg), cache

    step = jax.jit(step, donate_argnums=3)
    out, chunk = [], min(chunk, cache_len)
    wanted = [(f"prefill ({chunk} tokens x {slots} slots)", chunk)] + [(f"decode step ({slots} slots)", 1)] * decode
    for name, t in wanted:
        tokens = jax.ShapeDtypeStruct((slots, t), jax.numpy.int32, sharding=batch_sharding(mesh, (slots, t)))
        with jax.set_mesh(mesh):
            mem, costs, _ = _compile(step, params, tokens, tokens, cache)
        parts = {weights: per_device_bytes(params), f"KV cache ({dtype})": per_device_bytes(cache)}
        temps, args = float(mem.temp_size_in_bytes), float(mem.argument_size_in_bytes)
        program = Program(name, parts, temps, args, "activations, workspace", _new_outputs(mem), costs=costs)
        out.append(dataclasses.replace(program, oom=_oom(mem)))
    return out


def _held(params, dtype: str, quantize: str):
    """(abstract params as serving holds them, their part's name): `quantize` "none", "int8" or
    "int8+embedding" (`abstract_quantized`)."""
    if quantize == "none":
        return params, f"parameters ({dtype})"
    return abstract_quantized(params, embedding=quantize == "int8+embedding"), f"parameters (int8 + {dtype})"


def abstract_quantized(params, embedding: bool = False):
    """Abstract params (with shardings) as `quant.quantize_params` makes them: each matrix product's weight a
    `QArray` of int8 values (output-major where `dense` reads them so, split as the float weight was) and
    float32 scales (split as the weight on its kept axes)."""
    import jax

    from jaxgen.model import quant

    unplaced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32), params)
    shapes = jax.eval_shape(lambda p: quant.quantize_params(p, embedding=embedding), unplaced)

    def placed(shape, w):
        if not quant.is_q(shape):
            return w
        spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
        if shape.in_dims is None:
            q_sharding = w.sharding
        else:
            q_sharding = quant.out_major_sharding(w, shape.q.ndim - 2, len(shape.in_dims))
        kept = [axes if n > 1 else None for axes, n in zip(spec, shape.scale.shape, strict=True)]
        scale = jax.sharding.NamedSharding(w.sharding.mesh, jax.sharding.PartitionSpec(*kept))
        return shape.replace(q=shape.q.update(sharding=q_sharding), scale=shape.scale.update(sharding=scale))

    return jax.tree.map(placed, shapes, params, is_leaf=quant.is_q)


def engine_programs(cfg, mesh, dtype: str, quantize: str = "none") -> list[Program]:
    """The serving engine's own steps as `cfg.serve` sets it up (`jaxgen.inference.engine`): its largest
    prefill call (`steps.admit_rows` at the largest (rows, columns) of `scheduler.call_shapes`) and its decode
    chunk (`steps.decode_chunk`: `serve.chunk_steps` steps of every slot over the paged cache), with weights in
    `dtype` (`quantize` as `inference_programs` takes it), the page pool and the rest of the decode state
    (sampling settings, per-slot token buffers, penalty counts, the grammar table) as the engine allocates
    them. Extrapolated in depth as `inference_programs` is (`by_depth`), with the page count of the whole
    model (`serve.kv_memory_gb` holds fewer pages of more layers)."""
    from jaxgen.inference.budget import check_settings

    check_engine_plan(cfg.serve)
    pages, _ = check_settings(cfg.model, cfg.serve)  # the engine's refusals but memory (this plan's question)
    if quantize == "none" and cfg.serve.quantize == "int8":
        quantize = "int8+embedding" if cfg.serve.quantize_embedding else "int8"
    one = lambda m: _engine_programs(dataclasses.replace(cfg, model=m), mesh, dtype, quantize, pages)
    return by_depth(one, cfg.model)


def check_engine_plan(serve) -> None:
    """ValueError (one line) for engine settings `engine_programs` does not plan: a draft model or head, a
    LoRA bank, and the serving mesh's sizes (the plan's mesh is --mesh)."""
    unplanned = {"draft": (serve.draft, None), "max_loras": (serve.max_loras, 0),
                 "data_parallel": (serve.data_parallel, 1), "tensor_parallel": (serve.tensor_parallel, 1)}  # fmt: skip
    for name, (value, default) in unplanned.items():
        if value != default:
            what = "the mesh is --mesh" if name.endswith("parallel") else "not planned yet"
            raise ValueError(f"serve.{name}={value!r} is not allowed with --engine: {what}")


def _engine_programs(cfg, mesh, dtype: str, quantize: str, num_pages: int) -> list[Program]:
    import jax
    import numpy as np

    from jaxgen import model
    from jaxgen.inference import steps
    from jaxgen.inference.pages import PagePolicy
    from jaxgen.inference.scheduler import call_shapes

    serve = cfg.serve.for_programs
    model_cfg = dataclasses.replace(_plannable_model(cfg.model, on=mesh), dtype=dtype)
    params, weights = _held(abstract_params(model_cfg, mesh, dtype), dtype, quantize)
    params = _placed(lambda p: model.decode_params(p, serve.slots, model_cfg), mesh, params)
    max_pages = PagePolicy(num_pages, serve.page_size, serve.slots, model_cfg.max_seq_len, serve.chunk_steps,
                           False).max_pages  # fmt: skip
    state = _placed(lambda: steps.init_state(model_cfg, serve, num_pages, max_pages), mesh)
    spec = _placed(lambda: steps.init_spec(model_cfg, serve, None, num_pages, max_pages), mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # what the host uploads
    retire = like(np.zeros(serve.slots, bool))
    longest = min(serve.prefill_chunk, model_cfg.max_seq_len - 2)
    r, c = max(call_shapes(serve.prefill_chunk, serve.slots, longest), key=lambda shape: shape[0] * shape[1])
    rows = jax.tree.map(like, steps.pack_rows([], r, c, model_cfg, bool(serve.max_loras)))
    admit = jax.jit(functools.partial(steps.admit_rows, cfg=model_cfg), donate_argnums=(1, 2))
    chunk = jax.jit(functools.partial(steps.decode_chunk, cfg=model_cfg), donate_argnums=1)
    pool, table = per_device_bytes(state.cache), per_device_bytes(state.grammar_table)
    parts = {weights: per_device_bytes(params), f"KV pages ({num_pages}, {serve.cache_dtype})": pool,
             f"grammar table ({state.grammar_table.shape[0]} states)": table,
             "decode state (the rest)": per_device_bytes(state) + per_device_bytes(spec) - pool - table}  # fmt: skip
    calls = [
        (f"engine prefill ({r} rows x {c} tokens)", admit, (params, state, spec, rows, retire)),
        (f"engine decode chunk ({serve.slots} slots x {serve.chunk_steps} steps)", chunk,
         (params, state, like(np.int32(0)), retire)),
    ]  # fmt: skip
    out = []
    for name, fn, args in calls:
        with jax.set_mesh(mesh):
            mem, costs, _ = _compile(fn, *args)
        temps, arguments = float(mem.temp_size_in_bytes), float(mem.argument_size_in_bytes)
        program = Program(name, parts, temps, arguments, "activations, workspace", _new_outputs(mem), costs=costs)
        out.append(dataclasses.replace(program, oom=_oom(mem)))
    return out


def _placed(fn, mesh, *args):
    """What `fn(*args)` returns, as ShapeDtypeStructs in the shardings the compiler gives it on `mesh` (the
    engine makes its state and decode-layout weights by jitted calls under its mesh: `Runner`)."""
    import jax

    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    shapes = jax.eval_shape(fn, *args)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        compiled.output_shardings)  # fmt: skip


def _abstract_cache(model_cfg, mesh, slots: int, cache_len: int, dtype: str):
    """The contiguous KV cache as ShapeDtypeStructs, placed as `KVCache.constrain` places it."""
    import jax

    from jaxgen.model.kvcache import K_NAMES, POS_NAMES, V_NAMES, KVCache
    from jaxgen.sharding import named_sharding

    shapes = jax.eval_shape(lambda: KVCache.init(model_cfg, slots, cache_len, dtype))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(buffers, names):  # each layer's and block's buffer
        return jax.tree.map(lambda x: x.update(sharding=named_sharding(mesh, names, x.shape)), buffers)

    return shapes.replace(
        k=placed(shapes.k, K_NAMES),
        v=placed(shapes.v, V_NAMES),
        pos=shapes.pos.update(sharding=named_sharding(mesh, POS_NAMES, shapes.pos.shape)),
        end=shapes.end.update(sharding=replicated),
    )


def prefill_program(model_cfg, mesh, rows: int, t: int, chunk: int, dtype: str) -> Program:
    """The prefill of a `t`-token prompt in each of `rows` rows into a cache of `t` slots, as serving runs it
    on `mesh`: on a mesh with a context axis the Generator's (`inference.decode.prefill`: the whole prompt at
    once, `fresh=True`, attention ring or allgather over the split prompt, the cache split over `context`);
    elsewhere the engine's, in chunks of `chunk` tokens (its last chunk, the largest). Extrapolated in depth
    from PROBE_DEPTHS layers (`by_depth`)."""
    from jaxgen.sharding import context_size

    if context_size(mesh) == 1:
        return inference_programs(model_cfg, mesh, rows, t, min(chunk, t), dtype, decode=False)[0]
    return by_depth(lambda m: [_fresh_prefill(m, mesh, rows, t, dtype)], model_cfg)[0]


def _fresh_prefill(model_cfg, mesh, rows: int, t: int, dtype: str) -> Program:
    """`inference.decode.prefill` compiled as the Generator jits it (one sample per prompt)."""
    import jax

    from jaxgen.inference import decode
    from jaxgen.sharding import batch_sharding

    model_cfg = dataclasses.replace(_plannable_model(model_cfg, mesh, on=mesh), dtype=dtype)
    params = _per_layer(abstract_params(model_cfg, mesh, dtype), mesh)
    tokens = jax.ShapeDtypeStruct((rows, t), jax.numpy.int32, sharding=batch_sharding(mesh, (rows, t)))
    per_row = jax.ShapeDtypeStruct((rows,), jax.numpy.int32, sharding=batch_sharding(mesh, (rows,)))
    run = jax.jit(decode.prefill, static_argnames=("cfg", "cache_len", "cache_dtype"))
    with jax.set_mesh(mesh):
        lowered = run.lower(params, tokens, tokens, per_row, per_row, cfg=model_cfg, cache_len=t, cache_dtype=dtype)
        compiled = lowered.compile()
    mem = compiled.memory_analysis()
    cache = _abstract_cache(model_cfg, mesh, rows, t, dtype)
    cache_bytes = per_device_bytes(cache)
    parts = {f"parameters ({dtype})": per_device_bytes(params), f"KV cache ({dtype}, returned)": cache_bytes}
    name = f"prefill ({t} tokens x {rows} rows, whole prompt, {model_cfg.attention_impl} over context)"
    temps, args = float(mem.temp_size_in_bytes), float(mem.argument_size_in_bytes)
    return Program(name, parts, temps, args, holds="activations, workspace", outputs=_new_outputs(mem))


PROBE_DEPTHS = (3, 4)  # layers an inference program of a deeper model is compiled with (`by_depth`)


def by_depth(compile_at, model_cfg) -> list[Program]:
    """`compile_at(model_cfg)` (-> Programs whose layers run unrolled: prefill, decode) for a model of L
    layers, from compiles of the same model at the two PROBE_DEPTHS, every byte count extrapolated along
    the line through them: inference keeps no per-layer residuals, so parameters and cache grow by one
    layer's share a layer (exactly) and temporaries by a fixed amount a layer (XLA:CPU keeps each layer's
    gathered weights). A model no deeper than the second depth is compiled as it is. Assumes layers alike
    in memory (MoE or local/global patterns: the first layers' kinds). Tested: equal to the full compile
    of a 5-layer model to 1% (tests/test_plan_prefill.py)."""
    from jaxgen.targets.roofline import along

    depth = model_cfg.num_layers
    if depth <= PROBE_DEPTHS[-1]:
        return compile_at(model_cfg)
    (d0, d1), slope = PROBE_DEPTHS, depth - PROBE_DEPTHS[0]
    lows, highs = (compile_at(dataclasses.replace(model_cfg, num_layers=d)) for d in PROBE_DEPTHS)
    line = lambda a, b: a + (b - a) * slope / (d1 - d0)
    out = []
    for lo, hi in zip(lows, highs, strict=True):
        parts = {k: line(lo.parts[k], hi.parts[k]) for k in lo.parts}
        if lo.oom or hi.oom:  # refused at a probe depth: refused deeper too
            out.append(dataclasses.replace(hi, parts=parts, costs=None, oom=hi.oom or lo.oom))
            continue
        fields = {f: line(getattr(lo, f), getattr(hi, f)) for f in ("temporaries", "arguments", "outputs")}
        if lo.costs is not None:
            fields["costs"] = along(lo.costs, hi.costs, line)
        out.append(dataclasses.replace(lo, parts=parts, **fields))
    return out


def _plannable_model(model_cfg, mesh=None, on=None):
    """The model compiled on fake CPU devices: a fused kernel (cudnn, splash) planned as blockwise; on a
    mesh with a context axis ring and allgather kept and auto as ring (what `kernels.choose` picks there),
    elsewhere blockwise (also without `mesh`: the cached prefill and decode, which attend over the cache).
    On a target's devices (`on`: a mesh of them) the model is compiled as configured: its compiler
    lowers the real kernels."""
    if on is not None and on.devices.flat[0].platform != "cpu":
        return model_cfg
    impl = model_cfg.attention_impl
    if impl in ("dense", "blockwise"):
        return model_cfg
    if mesh is not None and "context" in mesh.axis_names:
        impl = {"auto": "ring", "ring": "ring", "allgather": "allgather"}.get(impl, "blockwise")
    else:
        impl = "blockwise"
    return dataclasses.replace(model_cfg, attention_impl=impl)


def advice(cfg, program: Program, capacity: float, mesh_sizes: dict) -> list[str]:
    """What to change when `program` does not fit in `capacity` bytes."""
    if program.peak <= capacity:
        return []
    tips = []
    if program.reference:
        return []
    if program.name.startswith("train step"):
        if cfg.model.remat == "none":
            tips.append("model.remat=full (or dots_no_batch): recompute activations in the backward pass")
        if cfg.model.attention_impl == "dense":
            tips.append("model.attention_impl=auto: no (T, T) score matrix kept for the backward pass")
        tips.append(f"a larger fsdp axis (now {mesh_sizes['fsdp']}): parameters, gradients and moments split further")
        tips.append(f"a smaller training.batch_size (now {cfg.training.batch_size}) with training.grad_accum")
    elif program.name.startswith("engine"):
        tips.append("fewer serve.slots, a smaller serve.kv_memory_gb (or serve.num_pages) or serve.prefill_chunk, "
                    "serve.cache_dtype=bfloat16 or int8, --quantize int8, or a tensor axis")  # fmt: skip
    else:
        tips.append("fewer --slots or a shorter --cache-len, bfloat16 weights and cache, or a tensor axis")
    return tips


def run_plan(cfg, mesh_sizes: dict, device: str, slots: int, cache_len: int, chunk: int, param_dtype: str,
             target=None, quantize: str = "none", engine: bool = False):  # fmt: skip
    """(programs, capacity in bytes) for `cfg` on a mesh of `mesh_sizes`: fake CPU devices of `device`'s
    memory, or a `targets.catalog.Target`'s compile-only devices (its compiler's memory analysis, and its
    counts for the roofline: `Program.costs`). `engine`: the serving engine's steps as `cfg.serve` sets it
    up (`engine_programs`) in place of a prefill and a decode step over a contiguous cache."""
    from jaxgen.targets.devices import backend_of, target_mesh, traced_for

    mesh = target_mesh(target, mesh_sizes)
    with traced_for(backend_of(target)):
        programs = train_programs(cfg, mesh, costs=target is not None)
        if engine:  # serve.param_dtype where it names one
            dtype = param_dtype if cfg.serve.param_dtype == "auto" else cfg.serve.param_dtype
            programs += engine_programs(cfg, mesh, dtype, quantize)
        else:
            programs += inference_programs(cfg.model, mesh, slots, cache_len, chunk, param_dtype, quantize=quantize)
    memory = DEVICES[device][0] if target is None else target.chip.hbm_bytes
    return programs, memory * HEADROOM


# --- The longest sequence (--max-seq): the programs the search in jaxgen.plan_length probes -----------


def seq_granule(cfg, mesh) -> int:
    """The step of the search: what attention needs T to be a multiple of. Ring and allgather on a context
    mesh: 2 x context x block (zig-zag halves of whole blocks, `context.check_fit`); else the block
    (blockwise pads any T up to one; a multiple keeps the probes comparable)."""
    from jaxgen.sharding import context_size

    block, c = cfg.model.attention_block, context_size(mesh)
    impl = _plannable(cfg, mesh).model.attention_impl
    return 2 * c * block if c > 1 and impl in ("ring", "allgather") else block


def probe_fn(cfg, mesh, program: str, chunk: int, dtype: str, log=None):
    """T -> peak bytes per device of `program` (train or prefill) at sequence length T, memoized (`.memo`;
    `.compiles[0]`: programs compiled): the train step with data x fsdp rows of T tokens (one sequence per
    batch shard); the prefill of a T-token prompt in as many rows into a cache of T (`prefill_program`: on a
    context mesh the whole prompt at once, else in chunks of `chunk` tokens)."""
    import time

    rows = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    memo, compiles = {}, [0]
    per_probe = 1 if program == "train" or cfg.model.num_layers <= PROBE_DEPTHS[-1] else len(PROBE_DEPTHS)

    def peak_at(t: int) -> float:
        if t not in memo:
            began = time.perf_counter()
            run = at_length(cfg, t, rows)
            if program == "train":
                memo[t] = train_program(run, mesh).peak
            else:
                memo[t] = prefill_program(run.model, mesh, rows, t, chunk, dtype).peak
            compiles[0] += per_probe
            if log:
                log(f"  {program} T={t}: {size_text(memo[t]).strip()} per device ({time.perf_counter() - began:.0f} s)")
        return memo[t]

    peak_at.memo, peak_at.compiles = memo, compiles
    return peak_at


def format_plan(cfg, programs, capacity, mesh_sizes, device, target=None) -> str:
    """The plan as text: who compiled it on the first line, then each program's parts and verdict, and
    (on a target) the roofline estimate from its compiler's counts (`roofline_lines`)."""
    from jaxgen.model import count_params
    from jaxgen.targets.devices import compiler_name

    n = math.prod(mesh_sizes.values())
    params = count_params(cfg.model)
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    mesh = ", ".join(f"{k}={v}" for k, v in mesh_sizes.items())
    memory = DEVICES[device][0] if target is None else target.chip.hbm_bytes
    compiler = "XLA:CPU" if target is None else compiler_name(target).split(" for ")[0]
    lines = [
        f"compiled by {compiler_name(target)}",
        f"{count} parameters on {n} x {device if target is None else target.name} (mesh {mesh}); usable per "
        f"device {size_text(capacity).strip()} ({HEADROOM:.0%} of {memory / 1e9:.0f} GB)",
    ]
    for p in programs:
        verdict = "fits" if p.peak <= capacity else "DOES NOT FIT"
        lines.append(f"\n{p.name}: {size_text(p.peak).strip()} per device, {verdict}")
        if p.oom:
            lines[-1] = f"\n{p.name}: DOES NOT FIT, {compiler} ran out of memory: {p.oom}"
        for name, value in p.parts.items():
            lines.append(f"  {name:<28} {size_text(value)}")
        if p.oom:
            lines += [f"  -> {tip}" for tip in advice(cfg, p, capacity, mesh_sizes)]
            continue
        lines.append(f"  {f'temporaries ({compiler})':<28} {size_text(p.temporaries)}   {p.holds}")
        if p.outputs:
            lines.append(f"  {f'outputs ({compiler})':<28} {size_text(p.outputs)}   returned beside the donated state")
        if target is not None and p.costs is not None:
            lines += ["  " + line for line in roofline_lines(cfg, p, target, n)]
        lines += [f"  -> {tip}" for tip in advice(cfg, p, capacity, mesh_sizes)]
    return "\n".join(lines)


def roofline_lines(cfg, program: Program, target, devices: int) -> list[str]:
    """What `program`'s counts on `target` come to at the chip's published peaks: an estimate (a lower
    bound on the step time: perfect overlap, peak rates), with the model's own FLOPs (training: MFU) or
    bytes (decode: the HBM floor of reading every weight and the cache once) beside it."""
    from jaxgen.model import flops_per_token
    from jaxgen.targets.roofline import estimate

    est, chip, c = estimate(program.costs, target.chip), target.chip, program.costs
    ms = lambda sec: f"{sec * 1e3:.3g} ms"
    out = [
        f"estimate (roofline of {chip.kind}, not measured): {ms(est.seconds)} per step, {est.bound}-bound "
        f"(compute {ms(est.compute)}, HBM {ms(est.memory)}, network {ms(est.network)}); per device "
        f"{c.flops / 1e12:.3g} TFLOP, {c.bytes / 1e9:.3g} GB read and written, {c.network / 1e9:.3g} GB sent"
    ]
    if program.name.startswith("train step"):
        tokens = cfg.training.batch_size * cfg.data.seq_len
        model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        mfu = model_flops / (est.seconds * chip.peak_flops * devices)
        out.append(
            f"  {tokens / est.seconds / devices:,.0f} tokens/s per chip, MFU {mfu:.0%}; the model's 6N + attention "
            f"FLOPs are {model_flops / devices / max(c.flops, 1):.2f} of what the program does"
        )
    elif program.name.startswith("decode step"):
        floor = sum(program.parts.values()) / chip.hbm_bandwidth
        ratio = est.seconds / floor
        out.append(f"  HBM floor (weights and cache read once): {ms(floor)}; the estimate is {ratio:.2f}x it")
    elif program.name.startswith("engine decode chunk"):  # a while loop over the chunk's steps
        out.append("  (the compiler counts the chunk's loop body once: about one decode step of every slot)")
    if any(k.startswith("parameters (int8") for k in program.parts):  # --quantize: did the compiler keep them?
        out.append(f"  matrix products of int8 by int8 in the compiled program: {c.int8_products}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxgen.plan",
        description="Per-device memory of training and serving a config on a mesh, from programs compiled "
        "for fake CPU devices (nothing is allocated). Overrides as in train.py: model.remat=full ...",
    )
    parser.add_argument("--config", required=True, help="a YAML config, e.g. configs/llama-3.1-8b.yaml")
    parser.add_argument("--mesh", action="append", help="data=D,fsdp=F,tensor=T,context=C (default: fsdp=8); "
                        "with --max-seq it may be given again, one table row group per mesh")  # fmt: skip
    parser.add_argument("--device", default="h100-80gb", help=f"memory per device: {', '.join(DEVICES)} "
                        "(default h100-80gb); with --max-seq a comma list")  # fmt: skip
    parser.add_argument("--target", default=None, help="compile for this hardware with its own compiler instead "
                        "of fake CPU devices (memory from the compiler, plus a roofline estimate): "
                        f"{', '.join(_target_names())}; the mesh must use all its chips")  # fmt: skip
    parser.add_argument("--slots", type=int, default=None, help="decode slots (rows) for serving (default 64)")
    parser.add_argument("--cache-len", type=int, default=None, help="KV cache length (default: data.seq_len)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill tokens per slot per call (512)")
    parser.add_argument("--param-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="weights and KV cache for serving (training keeps float32 master weights)")  # fmt: skip
    parser.add_argument("--quantize", default="none", choices=["none", "int8", "int8+embedding"],
                        help="serving's weights as serve.quantize holds them: int8 matrix products (+embedding: "
                        "the embedding and head too), the rest in --param-dtype (default none)")  # fmt: skip
    parser.add_argument("--engine", action="store_true",
                        help="plan the serving engine's own steps (its largest prefill call and its decode chunk over "
                        "the paged cache) as serve.* sets it up (serve.slots, serve.num_pages or serve.kv_memory_gb, "
                        "serve.cache_dtype, serve.quantize, serve.param_dtype (auto: --param-dtype), ...: give them as "
                        "overrides) instead of a prefill and a decode step over a contiguous cache of --slots x "
                        "--cache-len")  # fmt: skip
    parser.add_argument(
        "--max-seq", nargs="?", type=int, const=MAX_SEQ_TOP, default=None, metavar="TOP",
        help="instead of one plan, search the longest sequence whose train step (and prefill) fits per device, "
        f"up to TOP tokens (default {MAX_SEQ_TOP}), for each --mesh, --remat and --device: the train step has "
        "data x fsdp rows (one sequence per batch shard); the prefill feeds a prompt of that length in "
        "--prefill-chunk chunks into a cache of its length (on a context mesh: the whole prompt at once, as the "
        "Generator prefills there). Lengths are multiples of what attention needs "
        "(2 x context x model.attention_block for ring and allgather, else the block). Each probe compiles "
        "one program (tens of seconds for a 1B model): doubling from data.seq_len (or a jump along the line "
        "through the last two probes), then bisection at the secant point: about 4-8 compiles per mesh and "
        "remat, shared across devices, and as many for the prefill per mesh (two compiles each: 3 and 4 layers)",
    )  # fmt: skip
    parser.add_argument("--remat", default=None, help="with --max-seq: model.remat policies to compare, a comma "
                        f"list of {', '.join(REMATS)} (default: the config's)")  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="with --max-seq: search the train step only "
                        "(each prefill probe: two compiles, at 3 and 4 layers)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. training.batch_size=16")
    return parser


def _target_names() -> list[str]:
    from jaxgen.targets.catalog import TARGETS

    return list(TARGETS)


def check_args(args) -> None:
    """Raises ValueError (one line: the option, the value, what is allowed) for a bad combination of options."""
    if args.target is not None:
        from jaxgen.targets import catalog, devices

        target = catalog.get(args.target)
        if args.max_seq is not None:
            raise ValueError("--target is not allowed with --max-seq (yet): the search compiles on fake CPU devices")
        if reason := devices.unavailable(target):
            raise ValueError(reason)
    devices = args.device.split(",")
    for device in devices:
        if device not in DEVICES:
            raise ValueError(f"--device {device!r} is not allowed: one of {', '.join(DEVICES)}")
    for name, top in LIMITS.items():
        value = getattr(args, name)
        if value is not None and not 1 <= value <= top:
            raise ValueError(f"--{name.replace('_', '-')}={value} is not allowed: an integer from 1 to {top}")
    if args.max_seq is None:
        one_plan = "is only allowed with --max-seq (one plan: model.remat=...)"
        for given, what in ((len(args.mesh or ()) > 1, "more than one --mesh is only allowed with --max-seq"),
                            (len(devices) > 1, "more than one --device is only allowed with --max-seq"),
                            (args.remat is not None, f"--remat {one_plan}"),
                            (args.no_prefill, f"--no-prefill {one_plan}")):  # fmt: skip
            if given:
                raise ValueError(what)
        engine = {"slots": "serve.slots", "cache_len": "model.max_seq_len", "prefill_chunk": "serve.prefill_chunk"}
        for name, setting in engine.items() if args.engine else ():
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is not allowed with --engine: the engine's is {setting}")
        return
    if args.quantize != "none":
        raise ValueError(f"--quantize {args.quantize} is not allowed with --max-seq: the search plans float weights")
    if args.engine:
        raise ValueError("--engine is not allowed with --max-seq: the search plans the Generator's prefill")
    if not 1 <= args.max_seq <= LIMITS["cache_len"]:
        raise ValueError(f"--max-seq={args.max_seq} is not allowed: an integer from 1 to {LIMITS['cache_len']}")
    for name in ("slots", "cache_len"):
        if getattr(args, name) is not None:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} is not allowed with --max-seq: the search sets it (data x fsdp rows, "
                             "a cache of the sequence's length)")  # fmt: skip
    for policy in (args.remat or "none").split(","):
        if policy not in REMATS:
            raise ValueError(f"--remat {policy!r} is not allowed: a comma list of {', '.join(REMATS)}")


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides may stand among the flags
    try:
        meshes = [parse_mesh(m) for m in args.mesh or ["fsdp=8"]]
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_platforms", "cpu")  # fake devices, whatever this machine has
    if args.target is None:  # a target's compiler brings its own devices
        jax.config.update("jax_num_cpu_devices", max(math.prod(m.values()) for m in meshes))
    from jaxgen.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.engine:  # before anything compiles
            from jaxgen.inference.budget import check_settings

            check_engine_plan(cfg.serve)
            check_settings(cfg.model, cfg.serve)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_seq is not None:
        return _main_max_seq(cfg, args, meshes)
    mesh_sizes = meshes[0]
    cache_len = args.cache_len or cfg.data.seq_len
    target = None
    if args.target is not None:
        from jaxgen.targets import catalog

        target = catalog.get(args.target)
    try:
        programs, capacity = run_plan(
            cfg, mesh_sizes, args.device, args.slots or 64, cache_len, args.prefill_chunk or 512, args.param_dtype,
            target, args.quantize, args.engine,
        )  # fmt: skip
    except ValueError as e:  # a mesh the target cannot hold
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(cfg, programs, capacity, mesh_sizes, args.device, target))
    return 0 if all(p.peak <= capacity for p in programs if not p.reference) else 1


def _main_max_seq(cfg, args, meshes) -> int:
    remats = args.remat.split(",") if args.remat else [cfg.model.remat]
    log = lambda line: print(line, file=sys.stderr, flush=True)
    capacities = {device: DEVICES[device][0] * HEADROOM for device in args.device.split(",")}
    probe = lambda run, mesh, program: probe_fn(run, mesh, program, args.prefill_chunk or 512, args.param_dtype, log)
    rows, compiled = max_seq_table(
        cfg, meshes, remats, capacities, args.max_seq, probe, seq_granule, prefill=not args.no_prefill, log=log
    )
    print(format_max_seq(rows, args.prefill_chunk or 512, args.param_dtype, compiled, HEADROOM))
    return 0


if __name__ == "__main__":
    sys.exit(main())
