"""ModelConfig: one decoder-only transformer; GPT-2, Llama, Gemma, Qwen and OLMo styles are field choices."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

from jaxgen.config.base import check, check_literals

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_MLP_TARGETS = ("gate", "up", "down")


def _integer(cfg, name: str, lo: int, allowed: str, hi=None, optional=False, section="model") -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and lo <= value <= (hi or value)
    check(ok, f"{section}.{name}", value, allowed)


def _number(cfg, name: str, allowed: str, in_range, optional: bool = False, section="model") -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and in_range(value)
    check(ok, f"{section}.{name}", value, allowed)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the attention and MLP products: each targeted product
    x @ W gains x @ A @ B * (alpha / rank), A (in, r) and B (r, out) trained, W frozen (see
    jaxgen.model.lora). rank 0: no adapters, the model as it is. dora: DoRA (Liu et al. 2024), the adapted
    weight m * (W + A @ B * alpha / rank) / its norm per output feature, m trained too."""

    rank: int = 0  # r; 0 = off
    alpha: float = 16.0  # the adapters' product is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # only 0 for now
    targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = ("q", "k", "v", "o")
    dora: bool = False  # weight-decomposed LoRA: a trained magnitude per output feature (PEFT's use_dora)
    base_dtype: Literal["float32", "bfloat16", "int8", "nf4"] = "float32"  # how the frozen base weights are
    #   held in training: int8 (jaxgen.model.quant) and nf4 (QLoRA's 4-bit NormalFloat, jaxgen.model.nf4)
    #   quantize the matrix products' weights only
    # the folder of the weights the adapters adapt (a Hugging Face or run folder), written into a LoRA run's
    # config.yaml by train.py (training.init_from) and rl.py (the starting policy) and read by
    # jaxgen.inference.loading; "" = the weights the run's seed draws. Not a setting: set by the run itself
    base: str = ""

    def __post_init__(self):
        check_literals(self, "model.lora")
        _integer(self, "rank", 0, "an integer >= 0 (0 = no adapters)", section="model.lora")
        _number(self, "alpha", "a finite number > 0", lambda x: x > 0, section="model.lora")
        check(self.dropout == 0, "model.lora.dropout", self.dropout, "0 (adapter dropout is not implemented)")
        targets = self.targets
        ok = isinstance(targets, tuple) and len(targets) > 0 and len(set(targets)) == len(targets)
        ok = ok and all(t in LORA_TARGETS for t in targets)
        check(ok, "model.lora.targets", targets, "distinct names out of " + ", ".join(LORA_TARGETS))
        check(isinstance(self.dora, bool), "model.lora.dora", self.dora, "true or false")
        check(isinstance(self.base, str), "model.lora.base", self.base, 'a folder, or "" (the seed\'s weights)')

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; trained params stay float32 (decoding
    #   holds wider floats in this dtype: model.decode_params)
    attention_impl: Literal["auto", "dense", "blockwise", "cudnn", "splash", "ring", "allgather"] = "auto"
    #   attention over whole sequences (training, scoring): blockwise: flash-style over key blocks with a
    #   recomputing backward, O(T x block) memory (jaxgen.model.blockwise); cudnn: cuDNN's fused kernel
    #   (GPU, bf16); splash: the Pallas TPU kernel (interpret mode elsewhere); dense: the whole (T, T)
    #   matrix (the reference); auto: splash on TPU, cudnn on GPU where it fits, else blockwise (see
    #   jaxgen.model.kernels); ring, allgather: context parallelism over the mesh's context axis
    #   (jaxgen.model.context; auto picks ring there); on a mesh without one, blockwise
    attention_block: int = 512  # query and key block of blockwise and splash attention
    decode_impl: Literal["auto", "xla", "pallas"] = "auto"  # attention of a decode step over the engine's
    #   paged cache: xla: the blockwise loop over pages (jaxgen.model.attention); pallas: the backend's Pallas
    #   paged-attention kernel (TPU's on a TPU: bfloat16 pages, heads a multiple of 128; else the GPU one,
    #   interpret mode off a GPU; neither for sliding windows); auto: pallas on GPU and TPU (kernels.paged_kernel)
    cache_layout: Literal["auto", "blocks", "flat"] = "auto"  # how the Generator's contiguous cache holds a
    #   layer's slots (jaxgen.model.kvcache): blocks: up to 16 buffers, each written and read under a lax.cond
    #   (what XLA:CPU runs fastest); flat: one buffer written without a cond and read in one masked pass (a
    #   few kernels per layer on GPU and TPU); auto: blocks on CPU, flat elsewhere (kernels.cache_layout)
    remat: Literal["none", "full", "dots", "dots_no_batch", "offload_dots"] = "none"  # what the scanned
    #   layer keeps for the backward pass (jax.checkpoint policies): none: everything; full: only its
    #   input (recompute the rest); dots: matrix-product outputs; dots_no_batch: those without a batch
    #   axis (weights-only products); offload_dots: dots moved to host memory (GPU/TPU)
    init_std: float = 0.02
    deterministic: bool = False  # every token's numbers by the same float operations whatever else is in
    #   the call (batch, chunk, training or decoding): products, norms and softmaxes over fixed tiles of
    #   tokens, attention as one fold over key blocks of attention_block aligned to positions
    #   (jaxgen.model.layers.per_tile, attention.tiled_attention). The engine's log-probabilities then equal
    #   the training forward's bitwise; gradients are the plain model's; dense models, float32 or bfloat16; on
    #   CPU 1.1x to 1.7x a train step, 0.87x to 0.98x engine throughput (docs/rl.md, "Deterministic mode")
    lora: LoraConfig = LoraConfig()  # low-rank adapters for fine-tuning (rank 0: none)

    def __post_init__(self):
        self._check_types()
        check_literals(self, "model")
        if self.rope_scaling == "llama3":
            check(
                self.rope_high_freq_factor > self.rope_low_freq_factor,
                "model.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"a number > rope_low_freq_factor={self.rope_low_freq_factor}",
            )
        check(
            self.num_heads % self.kv_heads == 0,
            "model.num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads} (1 = multi-query, num_heads = multi-head)",
        )
        if self.head_dim is None:
            check(
                self.d_model % self.num_heads == 0,
                "model.num_heads",
                self.num_heads,
                f"a divisor of d_model={self.d_model} (or set model.head_dim)",
            )
        if self.position == "rope":
            check(self.head_size % 2 == 0, "model.head_dim", self.head_size, "an even number with rope")
        self._check_layer_pattern()
        self._check_attention_extras()
        self._check_experts()
        self._check_lora()
        self._check_deterministic()

    def _check_types(self):
        """Every number of the right type and in the range where the model computes finite values (a norm
        eps or RoPE base <= 0, a cap or scale <= 0 gives NaN or inf, silently): for configs from YAML,
        config.json or code alike."""
        for name in ("vocab_size", "max_seq_len"):  # token ids and positions are int32
            _integer(self, name, 1, "a positive integer below 2**31 (ids and positions are int32)", 2**31 - 1)
        for name in ("num_layers", "d_model", "num_heads", "d_ff", "rope_original_max_len"):
            _integer(self, name, 1, "a positive integer")
        for name in ("num_kv_heads", "head_dim", "sliding_window"):
            _integer(self, name, 1, "null or a positive integer", optional=True)
        for name in ("global_every", "num_experts"):
            _integer(self, name, 0, "an integer >= 0")
        _integer(self, "experts_per_token", 1, "a positive integer")
        for name in ("rope_theta", "norm_eps", "rope_low_freq_factor", "rope_high_freq_factor"):
            _number(self, name, "a finite number > 0", lambda x: x > 0)
        _number(self, "rope_factor", "a finite number >= 1", lambda x: x >= 1)
        for name in ("rope_local_theta", "query_scale", "attn_softcap", "final_softcap"):
            _number(self, name, "null or a finite number > 0", lambda x: x > 0, optional=True)
        for name in ("router_aux_coef", "router_z_coef", "init_std"):
            _number(self, name, "a finite number >= 0", lambda x: x >= 0)
        flags = ("norm_unit_offset", "use_bias", "qkv_bias", "embed_scale", "tie_embeddings", "router_renormalize")
        for name in (*flags, "deterministic"):
            check(isinstance(getattr(self, name), bool), f"model.{name}", getattr(self, name), "true or false")
        check(self.family is None or isinstance(self.family, str), "model.family", self.family, "null or a string")

    def _check_layer_pattern(self):
        for name in ("global_every", "rope_local_theta"):
            if getattr(self, name) and self.sliding_window is None:
                check(False, f"model.{name}", getattr(self, name), "only with model.sliding_window set")
        if self.rope_local_theta is not None:
            check(self.position == "rope", "model.rope_local_theta", self.rope_local_theta, "only with rope")

    def _check_attention_extras(self):
        block = self.attention_block
        check(isinstance(block, int) and block >= 8, "model.attention_block", block, "an integer >= 8")

    def _check_experts(self):
        if not self.num_experts:
            return
        check(
            1 <= self.experts_per_token <= self.num_experts,
            "model.experts_per_token",
            self.experts_per_token,
            f"1..num_experts={self.num_experts}",
        )
        check(self.mlp in ("swiglu", "geglu"), "model.mlp", self.mlp, "swiglu or geglu with experts")
        check(not self.use_bias, "model.use_bias", self.use_bias, "false with experts")

    def _check_lora(self):
        check(isinstance(self.lora, LoraConfig), "model.lora", self.lora, "a LoraConfig (rank, alpha, targets)")
        if self.lora.rank and self.num_experts:
            mlp = [t for t in self.lora.targets if t in _MLP_TARGETS]
            check(
                not mlp,
                "model.lora.targets",
                self.lora.targets,
                f"attention targets only (q, k, v, o) with experts (num_experts={self.num_experts}): "
                "adapters on expert MLPs are not implemented",
            )
        if self.lora.rank and self.mlp == "gelu":
            check("gate" not in self.lora.targets, "model.lora.targets", self.lora.targets, "no gate with mlp=gelu")

    def _check_deterministic(self):
        """What deterministic mode computes bitwise alike everywhere: dense MLPs, no adapters, the
        deterministic fold for attention (float32 or bfloat16)."""
        if not self.deterministic:
            return
        allowed = "with model.deterministic=true: "
        check(not self.num_experts, "model.num_experts", self.num_experts, allowed + "0 (dense MLPs only)")
        check(not self.lora.rank, "model.lora.rank", self.lora.rank, allowed + "0 (no adapters)")
        impl = self.attention_impl
        check(impl in ("auto", "blockwise"), "model.attention_impl", impl, allowed + "auto or blockwise "
              "(both run the deterministic fold over blocks of attention_block keys)")  # fmt: skip

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
