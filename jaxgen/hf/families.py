"""One record per supported Hugging Face family: what its config.json and checkpoint hold beyond the
Llama layout. config.py reads and writes config.json from these records, weights.py names the tensors
from them; adding a family is one `Family` in `FAMILY` (and its parity config in tests/test_hf.py).
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face family as jaxgen reads and writes it."""

    architecture: str  # config.json's architectures entry: the transformers class
    layout: Literal["gpt2", "llama"] = "llama"  # GPT-2's names and Conv1D weights, or the RoPE families' names
    # ModelConfig values beyond Llama's layout (read: these values; export: the family if they match)
    fields: dict = dataclasses.field(default_factory=dict)
    # transformers' own defaults for keys a config.json may leave out, where jaxgen's generic fallback (the
    # Llama one) would read a different model: e.g. Gemma's head_dim is 256, not hidden_size / heads
    defaults: dict = dataclasses.field(default_factory=dict)
    gelu: bool = False  # the gelu-tanh MLP (hidden_activation), embeddings tied unless config.json says not
    # none; sliding: a sliding_window key; layered: Gemma 2/3's layer_types (global every n-th layer), the
    # query scale and soft-caps; refused: Qwen's use_sliding_window, written false, refused true
    window: Literal["none", "sliding", "layered", "refused"] = "none"
    local_rope: bool = False  # RoPE settings per layer type (Gemma 3: a base for the sliding layers)
    fused: bool = False  # Phi-3: q, k, v in one qkv_proj, gate and up in one gate_up_proj
    experts: Literal["none", "mixtral", "qwen3_moe"] = "none"  # where the experts' keys and tensors live
    pad_is_eos: bool = False  # write pad_token_id (transformers' default, the vocabulary size, fails to load)


_GEMMA = {"mlp": "geglu", "norm_unit_offset": True, "embed_scale": True}
_GEMMA2_DEFAULTS = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
}  # fmt: skip

FAMILY: dict[str, Family] = {  # config.json's model_type -> the family
    "gpt2": Family("GPT2LMHeadModel", layout="gpt2"),
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", window="sliding"),
    "qwen2": Family("Qwen2ForCausalLM", fields={"qkv_bias": True}, window="refused"),
    "gemma": Family(
        "GemmaForCausalLM", fields=_GEMMA, gelu=True,
        defaults={"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192},
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM", fields={"qk_norm": "head"}, window="refused",
        defaults={"head_dim": 128, "max_position_embeddings": 32768},
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM", fields=_GEMMA | {"norm_placement": "sandwich"}, gelu=True, window="layered",
        defaults=_GEMMA2_DEFAULTS | {
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 8192,
        },
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM", fields=_GEMMA | {"norm_placement": "sandwich", "qk_norm": "head"}, gelu=True,
        window="layered", local_rope=True,
        defaults=_GEMMA2_DEFAULTS | {
            "max_position_embeddings": 131072, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        },
    ),
    "olmo2": Family("Olmo2ForCausalLM", fields={"qk_norm": "full", "norm_placement": "post"}),
    "phi3": Family(
        "Phi3ForCausalLM", window="sliding", fused=True, pad_is_eos=True, defaults={"max_position_embeddings": 4096}
    ),
    "mixtral": Family(
        "MixtralForCausalLM", window="sliding", experts="mixtral",
        defaults={"rope_theta": 1e6, "max_position_embeddings": 131072},
    ),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", fields={"qk_norm": "head"}, window="refused", experts="qwen3_moe",
        defaults={"max_position_embeddings": 32768},
    ),
}  # fmt: skip
FAMILIES = tuple(FAMILY)
