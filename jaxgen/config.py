"""Configuration: nested frozen dataclasses, loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/tiny.yaml", ["model.num_layers=4", "training.steps=50"])
    serving = load_serve_config("configs/serve.yaml", ["serve.chunk_steps=16"])  # what serve.py reads

Unknown keys and bad values raise `ConfigError` naming the key, the value seen and what is allowed.
Every check runs here, before anything is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key or value that jaxgen cannot use."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer; GPT-2 and Llama styles are field choices, not code copies."""

    vocab_size: int = 512
    num_layers: int = 2
    d_model: int = 64  # D
    num_heads: int = 4  # N
    num_kv_heads: int | None = None  # K; None = num_heads (MHA), 1 = MQA, else GQA
    head_dim: int | None = None  # H; None = d_model // num_heads
    d_ff: int = 256  # F
    max_seq_len: int = 256
    position: Literal["learned", "rope"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "linear", "llama3"] = "none"  # stretch RoPE to longer contexts
    rope_factor: float = 1.0  # linear and llama3: how much longer
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_len: int = 8192  # llama3: the context length trained before scaling
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # the norm multiplies by (1 + scale), scale initialised to 0 (Gemma)
    mlp: Literal["gelu", "swiglu", "geglu"] = "swiglu"  # geglu: tanh-GELU gate (Gemma)
    use_bias: bool = False  # biases in attention and MLP projections (GPT-2: True)
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    embed_scale: bool = False  # token embeddings times sqrt(d_model) on the way in (Gemma)
    tie_embeddings: bool = False  # the LM head reuses the token embedding (GPT-2: True)
    sliding_window: int | None = None  # attend to at most this many previous positions
    global_every: int = 0  # with sliding_window: layer i attends globally when (i + 1) % n == 0 (Gemma 2: 2)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3); None = rope_theta
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm on q and k before RoPE: per head (Qwen3,
    #   Gemma 3) or over the whole projection N * H / K * H (OLMo 2)
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"  # sandwich: pre- and post-norms (Gemma 2/3);
    #   post: the sublayer's output normed before the residual add, no pre-norm (OLMo 2)
    query_scale: float | None = None  # logits scaled by query_scale ** -0.5 (Gemma's query_pre_attn_scalar);
    #   None = head_dim
    attn_softcap: float | None = None  # attention logits capped as cap * tanh(x / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits
    num_experts: int = 0  # E; 0 = a dense MLP, else a mixture of experts (Mixtral, Qwen3-MoE) of width d_ff
    experts_per_token: int = 2  # k: experts each token is routed to
    router_renormalize: bool = True  # the k routing weights rescaled to sum to 1 (Mixtral; Qwen3's norm_topk_prob)
    router_aux_coef: float = 0.01  # weight of the load-balancing loss in training (Switch Transformer)
    router_z_coef: float = 0.0  # weight of the router z-loss (mean squared logsumexp of router logits)
    moe_impl: Literal["auto", "grouped", "ragged_dot", "megablox", "dense"] = "auto"  # how tokens reach
    #   their experts: grouped: sorted by expert, one product per tile of rows (only the experts in use
    #   are read); ragged_dot: jax.lax.ragged_dot (a kernel on GPU; dense under a mask on CPU);
    #   megablox: the Pallas TPU grouped matmul (interpret mode elsewhere); dense: every expert on
    #   every token (the reference); auto: megablox on TPU, ragged_dot on GPU, grouped on CPU
    family: str | None = None  # the Hugging Face family imported from, kept for export (None: from the fields)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    attention_impl: Literal["auto", "dense", "blockwise", "cudnn", "splash"] = "auto"  # attention over whole
    #   sequences (training, scoring): blockwise: flash-style over key blocks with a recomputing backward,
    #   O(T x block) memory (jaxgen.model.blockwise); cudnn: cuDNN's fused kernel (GPU, bf16); splash: the
    #   Pallas TPU kernel (interpret mode elsewhere); dense: the whole (T, T) matrix (the reference);
    #   auto: splash on TPU, cudnn on GPU where it fits, else blockwise (see jaxgen.model.kernels)
    attention_block: int = 512  # query and key block of blockwise and splash attention
    decode_impl: Literal["auto", "xla", "pallas"] = "auto"  # attention of a decode step over the engine's
    #   paged cache: xla: the blockwise loop over pages (jaxgen.model.attention); pallas: the GPU Pallas
    #   paged-attention kernel (interpret mode elsewhere; not for sliding windows); auto: pallas on GPU
    remat: Literal["none", "full", "dots", "dots_no_batch", "offload_dots"] = "none"  # what the scanned
    #   layer keeps for the backward pass (jax.checkpoint policies): none: everything; full: only its
    #   input (recompute the rest); dots: matrix-product outputs; dots_no_batch: those without a batch
    #   axis (weights-only products); offload_dots: dots moved to host memory (GPU/TPU)
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"model.{name}", value, "a positive integer")
        _check(self.position in ("learned", "rope"), "model.position", self.position, "learned, rope")
        _check(self.norm in ("layernorm", "rmsnorm"), "model.norm", self.norm, "layernorm, rmsnorm")
        _check(self.mlp in ("gelu", "swiglu", "geglu"), "model.mlp", self.mlp, "gelu, swiglu, geglu")
        scalings = ("none", "linear", "llama3")
        _check(self.rope_scaling in scalings, "model.rope_scaling", self.rope_scaling, ", ".join(scalings))
        _check(self.rope_factor >= 1, "model.rope_factor", self.rope_factor, "a number >= 1")
        if self.rope_scaling == "llama3":
            _check(
                self.rope_high_freq_factor > self.rope_low_freq_factor,
                "model.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"a number > rope_low_freq_factor={self.rope_low_freq_factor}",
            )
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype, "float32, bfloat16")
        k = self.kv_heads
        _check(
            k > 0 and self.num_heads % k == 0,
            "model.num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads} (1 = multi-query, num_heads = multi-head)",
        )
        if self.head_dim is None:
            _check(
                self.d_model % self.num_heads == 0,
                "model.num_heads",
                self.num_heads,
                f"a divisor of d_model={self.d_model} (or set model.head_dim)",
            )
        if self.position == "rope":
            _check(self.head_size % 2 == 0, "model.head_dim", self.head_size, "an even number with rope")
        if self.sliding_window is not None:
            _check(self.sliding_window > 0, "model.sliding_window", self.sliding_window, "null or > 0")
        self._check_layer_pattern()
        self._check_attention_extras()
        self._check_memory_options()
        self._check_experts()

    def _check_layer_pattern(self):
        _check(self.global_every >= 0, "model.global_every", self.global_every, "an integer >= 0")
        for name in ("global_every", "rope_local_theta"):
            if getattr(self, name) and self.sliding_window is None:
                _check(False, f"model.{name}", getattr(self, name), "only with model.sliding_window set")
        if self.rope_local_theta is not None:
            _check(self.position == "rope", "model.rope_local_theta", self.rope_local_theta, "only with rope")

    def _check_attention_extras(self):
        kinds = ("none", "head", "full")
        _check(self.qk_norm in kinds, "model.qk_norm", self.qk_norm, ", ".join(kinds))
        places = ("pre", "sandwich", "post")
        _check(self.norm_placement in places, "model.norm_placement", self.norm_placement, ", ".join(places))
        for name in ("query_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"model.{name}", value, "null or a number > 0")

    def _check_memory_options(self):
        impls = ("auto", "dense", "blockwise", "cudnn", "splash")
        _check(self.attention_impl in impls, "model.attention_impl", self.attention_impl, ", ".join(impls))
        block = self.attention_block
        _check(isinstance(block, int) and block >= 8, "model.attention_block", block, "an integer >= 8")
        _check(
            self.decode_impl in ("auto", "xla", "pallas"), "model.decode_impl", self.decode_impl, "auto, xla, pallas"
        )
        policies = ("none", "full", "dots", "dots_no_batch", "offload_dots")
        _check(self.remat in policies, "model.remat", self.remat, ", ".join(policies))

    def _check_experts(self):
        _check(self.num_experts >= 0, "model.num_experts", self.num_experts, "0 (dense MLP) or a positive integer")
        if not self.num_experts:
            return
        _check(
            1 <= self.experts_per_token <= self.num_experts,
            "model.experts_per_token",
            self.experts_per_token,
            f"1..num_experts={self.num_experts}",
        )
        _check(self.mlp in ("swiglu", "geglu"), "model.mlp", self.mlp, "swiglu or geglu with experts")
        _check(not self.use_bias, "model.use_bias", self.use_bias, "false with experts")
        impls = ("auto", "grouped", "ragged_dot", "megablox", "dense")
        _check(self.moe_impl in impls, "model.moe_impl", self.moe_impl, ", ".join(impls))
        for name in ("router_aux_coef", "router_z_coef"):
            _check(getattr(self, name) >= 0, f"model.{name}", getattr(self, name), "a number >= 0")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to the whole context (no sliding window)."""
        if self.sliding_window is None:
            return True
        return self.global_every > 0 and (layer + 1) % self.global_every == 0

    @property
    def groups(self) -> int:
        """Query heads per kv head (G); 1 for multi-head attention."""
        return self.num_heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["stdlib", "files", "jsonl"] = "stdlib"
    paths: tuple[str, ...] = ()  # globs, for files and jsonl
    text_field: str = "text"
    prompt_field: str | None = None  # jsonl fine-tuning: loss only on the response
    response_field: str | None = None
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    seq_len: int = 128  # T: tokens per training sequence
    eval_fraction: float = 0.02  # share of documents held out
    eval_batches: int = 4
    cache_dir: str = "~/.cache/jaxgen/tokens"
    seed: int = 0

    def __post_init__(self):
        _check(self.source in ("stdlib", "files", "jsonl"), "data.source", self.source, "stdlib, files, jsonl")
        _check(self.seq_len > 0, "data.seq_len", self.seq_len, "a positive integer")
        _check(0 < self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "a number in (0, 1)")
        if self.source != "stdlib":
            _check(bool(self.paths), "data.paths", self.paths, f"at least one glob for source={self.source}")
        _check(
            (self.prompt_field is None) == (self.response_field is None),
            "data.prompt_field",
            self.prompt_field,
            "set together with data.response_field",
        )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-3  # peak, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables

    def __post_init__(self):
        _check(self.learning_rate > 0, "optimizer.learning_rate", self.learning_rate, "a number > 0")
        _check(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _check(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(self.grad_clip >= 0, "optimizer.grad_clip", self.grad_clip, "a number >= 0 (0 disables)")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            _check(0 <= value < 1, f"optimizer.{name}", value, "a number in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    steps: int = 200  # total optimizer steps of the run
    batch_size: int = 8  # sequences per optimizer step (global, all devices)
    grad_accum: int = 1  # micro-batches per step; batch_size must divide by it
    eval_every: int = 50
    log_every: int = 10
    seed: int = 0
    max_nonfinite_in_row: int = 5  # stop after this many skipped (non-finite) updates in a row
    steps_per_run: int = 0  # stop this invocation after N steps (time-sliced jobs); 0 = run to the end
    peak_flops: float = 0.0  # for MFU; 0 = measure the matmul rate of this machine at start
    loss_chunk: int = 1024  # tokens of each row per step of the LM head and loss (jaxgen.training.loss): the
    #   (B, T, V) logits are never whole; 0 = all at once
    # Fine-tuning: a local Hugging Face model folder. Its config.json replaces the `model` section (all
    # but model.dtype), its tokenizer replaces data.tokenizer, and its weights are the starting point.
    init_from: str | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "log_every", "max_nonfinite_in_row"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"training.{name}", value, "a positive integer")
        _check(
            self.batch_size % self.grad_accum == 0,
            "training.grad_accum",
            self.grad_accum,
            f"a divisor of training.batch_size={self.batch_size}",
        )
        _check(self.steps_per_run >= 0, "training.steps_per_run", self.steps_per_run, "an integer >= 0")
        _check(self.loss_chunk >= 0, "training.loss_chunk", self.loss_chunk, "an integer >= 0 (0 = no chunks)")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; -1 takes all remaining devices. Default: all devices on `data`."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        _check(
            all(s == -1 or s > 0 for s in sizes) and sizes.count(-1) <= 1,
            "mesh",
            dict(data=self.data, fsdp=self.fsdp, tensor=self.tensor),
            "positive sizes, with at most one -1 (all remaining devices)",
        )

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """Mesh shape on `num_devices` devices; fully given sizes may use fewer (the first ones)."""
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            _check(num_devices % fixed == 0, "mesh", sizes, f"sizes whose product divides {num_devices} devices")
            sizes[sizes.index(-1)] = num_devices // fixed
        _check(math.prod(sizes) <= num_devices, "mesh", sizes, f"at most {num_devices} devices in all")
        return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The serving engine (`jaxgen.inference.engine`): decode slots and the paged KV cache's memory budget."""

    slots: int = 16  # sequences decoded together
    page_size: int = 16  # tokens per KV-cache page
    kv_memory_gb: float = 1.0  # the page pool's size; pages = this / bytes of one page (all layers)
    num_pages: int = 0  # an exact page count instead of kv_memory_gb (tests); 0 = from the budget
    chunk_steps: int = 8  # decode steps per jitted chunk, between scheduling decisions
    prefill_chunk: int = 256  # prompt tokens per prefill call: longer prompts interleave with decoding
    max_logprobs: int = 5  # the most top alternatives a request may ask for
    prefix_caching: bool = True  # share the pages of prompt prefixes already in the cache
    # the KV cache's dtype: int8 holds about twice the tokens of bfloat16 per GB (one float32 scale per token
    # and kv head beside the int8 values)
    cache_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    # how the weights are held: auto = the checkpoint's dtype on GPU/TPU (bfloat16 for most Hugging Face
    # folders), float32 on CPU (XLA:CPU's bfloat16 products are slow); bfloat16 weights compute in bfloat16
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # int8: every attention and MLP weight held as int8 with a scale per output channel, its products int8 x int8
    # (`jaxgen.model.quant`); quantize_embedding: the embedding and the head too
    quantize: Literal["none", "int8"] = "none"
    quantize_embedding: bool = False
    # a run or Hugging Face folder whose model (a smaller one, with the same tokenizer) drafts for requests with
    # num_speculative_tokens > 0; None = n-gram lookup over each request's prompt and output
    draft: str | None = None
    # several processes (`serve.py generate --input`): split = each serves its share of the lines on its own
    # devices (data parallel); shared = one engine on a mesh over every process's devices (model parallel)
    processes: Literal["split", "shared"] = "split"
    # the engine's mesh (data, tensor) over this process's devices (split) or every process's (shared); -1 = the rest
    data_parallel: int = 1  # slots split over devices
    tensor_parallel: int = 1  # heads, kv heads and the MLP split over devices
    # the HTTP server's limits
    max_body_bytes: int = 4_000_000  # a larger request body gets 413 before it is parsed
    max_queue: int = 1024  # requests waiting beyond this get 429 with Retry-After
    request_timeout_s: float = 0.0  # a request running longer is cancelled (408); 0 = no limit
    shutdown_grace_s: float = 10.0  # on SIGTERM, running sequences get this long before their streams are ended

    def __post_init__(self):
        for name in ("slots", "page_size", "chunk_steps", "prefill_chunk", "max_body_bytes", "max_queue"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"serve.{name}", value, "a positive integer")
        _check(self.kv_memory_gb > 0, "serve.kv_memory_gb", self.kv_memory_gb, "a number > 0")
        _check(self.num_pages == 0 or self.num_pages >= 2, "serve.num_pages", self.num_pages, "0 or at least 2")
        _check(self.max_logprobs >= 0, "serve.max_logprobs", self.max_logprobs, "an integer >= 0")
        for name in ("request_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and 0 <= value < float("inf"), f"serve.{name}", value, "a number >= 0"
            )
        dtypes = ("float32", "bfloat16")
        _check(self.cache_dtype in (*dtypes, "int8"), "serve.cache_dtype", self.cache_dtype, "float32, bfloat16, int8")
        _check(self.quantize in ("none", "int8"), "serve.quantize", self.quantize, "none, int8")
        _check(isinstance(self.quantize_embedding, bool), "serve.quantize_embedding", self.quantize_embedding, "a bool")
        _check(self.draft is None or (isinstance(self.draft, str) and bool(self.draft)), "serve.draft", self.draft,
               "null or the path of a run or Hugging Face folder")  # fmt: skip
        _check(self.param_dtype in ("auto", *dtypes), "serve.param_dtype", self.param_dtype, "auto, float32, bfloat16")
        _check(self.processes in ("split", "shared"), "serve.processes", self.processes, "split, shared")
        for name in ("data_parallel", "tensor_parallel"):
            value = getattr(self, name)
            _check(value == -1 or value > 0, f"serve.{name}", value, "a positive integer, or -1 for the rest")
        _check(
            (self.data_parallel, self.tensor_parallel) != (-1, -1), "serve.tensor_parallel", -1,
            "a positive integer when serve.data_parallel is -1 (one of the two may take the rest)",
        )  # fmt: skip
        _check(
            self.processes == "split" or self.data_parallel == 1, "serve.data_parallel", self.data_parallel,
            "1 with serve.processes=shared (one engine, tensor parallel over every process's devices); "
            "serve.processes=split is the data parallelism across processes",
        )  # fmt: skip

    @property
    def mesh(self) -> MeshConfig:
        return MeshConfig(data=self.data_parallel, tensor=self.tensor_parallel)


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    """The HTTP server of `serve.py http`. Its API key is never read from a file: --api-key or JAXGEN_API_KEY."""

    host: str = "127.0.0.1"  # the address to bind; 127.0.0.1 = this machine only
    port: int = 8000
    model_name: str | None = None  # the model id clients send; None = the checkpoint folder's name

    def __post_init__(self):
        _check(bool(self.host), "http.host", self.host, "an address such as 127.0.0.1 or 0.0.0.0")
        _check(0 <= self.port <= 65535, "http.port", self.port, "an integer in [0, 65535] (0 = any free port)")
        _check(self.model_name is None or bool(self.model_name), "http.model_name", self.model_name, "null or a name")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Running as one of several processes (`jaxgen.distributed`); the defaults detect it from the environment."""

    coordinator: str | None = None  # HOST:PORT of process 0; auto = JAX's detection; None = the environment
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout_s: int = 60  # a process silent this long is taken as dead and every process stops
    init_timeout_s: int = 300  # how long to wait for all processes to join

    def __post_init__(self):
        for name in ("num_processes", "heartbeat_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"distributed.{name}", value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class ServeCommandConfig:
    """What `serve.py` reads (configs/serve.yaml): the engine and its limits, and the HTTP server."""

    serve: ServeConfig = ServeConfig()
    http: HttpConfig = HttpConfig()
    distributed: DistributedConfig = DistributedConfig()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every N steps (also at the end and on SIGTERM / Ctrl-C)
    keep: int = 3  # keep the last K checkpoints

    def __post_init__(self):
        _check(self.every > 0, "checkpoint.every", self.every, "a positive integer")
        _check(self.keep > 0, "checkpoint.keep", self.keep, "a positive integer")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    serve: ServeConfig = ServeConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        _check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            self.data.seq_len,
            f"at most model.max_seq_len={self.model.max_seq_len}",
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- building configs from plain data -------------------------------------------------------------


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks and converts one YAML/CLI value to the field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        _check(value in args, key, value, ", ".join(map(str, args)))
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        _check(isinstance(value, list | tuple), key, value, "a list")
        return tuple(_coerce(v, args[0], key) for v in value)
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), key, value, "a mapping of " + ", ".join(_field_names(tp)))
        return _build(tp, value, key + ".")
    if tp is bool:
        _check(isinstance(value, bool), key, value, "true or false")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        _check(isinstance(value, int | float) and not isinstance(value, bool), key, value, "a number")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; allowed keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(_field_names(cls))}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """A CLI value is read as YAML, so `4`, `1e-3`, `true`, `null` and `[a, b]` all work."""
    return yaml.safe_load(text)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies `a.b=value` strings to a nested dict (copied)."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. model.num_layers=4)")
        key, text = item.split("=", 1)
        _set(data, key.strip(), _parse_scalar(text), item)
    return data


def _set(data: dict, key: str, value: Any, item: str) -> None:
    """Sets dotted `key` in the nested dict `data` (in place); `item` names the setting in errors."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _deep_copy(data: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def config_from_dict(data: dict) -> Config:
    try:
        return _build(Config, data or {})
    except TypeError as e:  # a wrong nesting, e.g. `model: 4`
        raise ConfigError(str(e)) from e


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Reads a YAML config (or the defaults when `path` is None) and applies dotted overrides."""
    data: dict = {}
    if path is not None:
        data = _read_yaml(path)
        data.setdefault("name", Path(path).stem)
    return config_from_dict(apply_overrides(data, list(overrides)))


def load_serve_config(
    path: str | Path | None = None, overrides: list[str] = (), settings: dict[str, Any] | None = None
) -> ServeCommandConfig:
    """What serve.py runs with. Later wins: the defaults, the YAML at `path` (top-level sections `serve` and
    `http`, both optional), the dotted `overrides`, then `settings` ({dotted key: value}, serve.py's flags)."""
    data = _read_yaml(path) if path is not None else {}
    training = sorted(set(data) & (set(_field_names(Config)) - set(_field_names(ServeCommandConfig))))
    if training:
        raise ConfigError(f"{path} is a training config (it has {', '.join(training)}): serve.py reads a file "
                          "with serve and http sections, such as configs/serve.yaml")  # fmt: skip
    data = apply_overrides(data, list(overrides))
    for key, value in (settings or {}).items():
        _set(data, key, value, f"{key}={value!r}")
    http = data.get("http")
    if isinstance(http, dict) and "api_key" in http:
        raise ConfigError("http.api_key is not read from config files (they get copied and committed): "
                          "pass --api-key or set JAXGEN_API_KEY")  # fmt: skip
    try:
        return _build(ServeCommandConfig, data)
    except TypeError as e:  # a wrong nesting, e.g. `serve: 4`
        raise ConfigError(str(e)) from e


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        shipped = sorted(p.name for p in Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
        raise ConfigError(f"config file {str(path)!r} does not exist; shipped configs: {', '.join(shipped)}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def save_config(cfg: Config, path: str | Path) -> None:
    """Writes the YAML next to `path` and renames it over: a crash or a full disk never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    data = _plain(cfg.to_dict())
    data.pop("distributed", None)  # how this run was started, not what it is: a reused file must not rejoin it
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
