"""EAGLE-3 draft heads in the layout vLLM and SGLang serve (`LlamaForCausalLMEagle3`), and back.

The folder holds config.json and model.safetensors as the EAGLE-3 releases have them (e.g. the authors'
EAGLE3-LLaMA3.1-Instruct-8B), with jaxgen's tapped layers written where vLLM reads them:

    config.json: architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1,
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act
        "silu", rms_norm_eps, rope_theta, max_position_embeddings, vocab_size (the target's),
        draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids (vLLM's ids: j = the input
        of target layer j, as `Head.layers`), tie_word_embeddings false
    tensors (a torch Linear's weight is (out, in)): fc.weight (D, n D); midlayer.input_layernorm.weight
        (D,) (the embedding's norm), midlayer.hidden_norm.weight (D,); midlayer.self_attn.{q,k,v}_proj.weight
        (N H | K H, 2 D), o_proj.weight (D, N H); midlayer.post_attention_layernorm.weight;
        midlayer.mlp.{gate,up}_proj.weight (F, D), down_proj.weight (D, F); norm.weight; lm_head.weight
        (Vd, D); d2t (Vd,) int64 offsets (target id = draft id + d2t[draft id]); t2d (V,) bool.

The embedding is the target's and is not written (vLLM and SGLang share the target's when it is absent).
The target's tokenizer is written beside it; `load` refuses a head whose target shape, vocabulary or
tokenizer differs from the target it is loaded for, naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxgen.config import ModelConfig
from jaxgen.hf.config import HFError
from jaxgen.hf.safetensors import _Checkpoint
from jaxgen.model import eagle
from jaxgen.tokenizer import Tokenizer

ARCHITECTURE = "LlamaForCausalLMEagle3"


def _tensors(head: eagle.Head) -> dict[str, np.ndarray]:
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), head.params)
    d = p["fc_fd"].shape[1]
    layer = p["layer"]
    vd = len(head.draft_to_target)
    return {
        "fc.weight": p["fc_fd"].T,
        "midlayer.input_layernorm.weight": p["embed_norm"]["scale_d"],
        "midlayer.hidden_norm.weight": p["hidden_norm"]["scale_d"],
        "midlayer.self_attn.q_proj.weight": layer["w_q_dnh"].reshape(2 * d, -1).T,
        "midlayer.self_attn.k_proj.weight": layer["w_k_dkh"].reshape(2 * d, -1).T,
        "midlayer.self_attn.v_proj.weight": layer["w_v_dkh"].reshape(2 * d, -1).T,
        "midlayer.self_attn.o_proj.weight": layer["w_o_nhd"].reshape(-1, d).T,
        "midlayer.post_attention_layernorm.weight": p["mlp_norm"]["scale_d"],
        "midlayer.mlp.gate_proj.weight": layer["mlp"]["w_gate_df"].T,
        "midlayer.mlp.up_proj.weight": layer["mlp"]["w_up_df"].T,
        "midlayer.mlp.down_proj.weight": layer["mlp"]["w_down_fd"].T,
        "norm.weight": p["final_norm"]["scale_d"],
        "lm_head.weight": p["head_dv"].T,
        "d2t": np.asarray(head.draft_to_target, np.int64) - np.arange(vd, dtype=np.int64),
    }


def config_json(head: eagle.Head, cfg: ModelConfig) -> dict:
    h = head.cfg
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": h.d_model, "intermediate_size": h.d_ff, "num_attention_heads": h.num_heads,
        "num_key_value_heads": h.kv_heads, "head_dim": h.head_size, "hidden_act": "silu",
        "rms_norm_eps": h.norm_eps, "rope_theta": h.rope_theta, "max_position_embeddings": h.max_seq_len,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": h.vocab_size, "target_hidden_size": cfg.d_model,
        "eagle_aux_hidden_state_layer_ids": list(head.layers), "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }  # fmt: skip


def save(folder: str | Path, head: eagle.Head, cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> Path:
    """Writes the head for target `cfg` as vLLM and SGLang load an EAGLE-3 drafter (see the module)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(head)
    t2d = np.zeros((cfg.vocab_size,), np.bool_)
    t2d[np.asarray(head.draft_to_target)] = True
    tensors["t2d"] = t2d
    tmp = folder / "model.partial.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    tmp.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config_json(head, cfg), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_folder(folder)
    return folder


def load(folder: str | Path, cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> eagle.Head:
    """The head saved in `folder` (this layout) for target `cfg`; HFError naming what differs when it was
    made for another target (hidden size, vocabulary, layers, tokenizer)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.exists():
        raise HFError(f"{folder}: no config.json (an EAGLE-3 head folder has config.json and model.safetensors)")
    hf = json.loads(path.read_text())
    if ARCHITECTURE not in hf.get("architectures", []):
        raise HFError(f"{folder}: architectures={hf.get('architectures')!r}, not an EAGLE-3 head ({ARCHITECTURE})")
    layers = tuple(int(i) for i in hf.get("eagle_aux_hidden_state_layer_ids") or eagle.default_layers(cfg.num_layers))
    differs = []
    for key, mine in (("hidden_size", cfg.d_model), ("target_hidden_size", cfg.d_model),
                      ("vocab_size", cfg.vocab_size)):  # fmt: skip
        if key in hf and hf[key] != mine:
            differs.append(f"{key} {hf[key]} vs the target's {mine}")
    if max(layers) > cfg.num_layers:
        differs.append(f"eagle_aux_hidden_state_layer_ids {list(layers)} vs the target's {cfg.num_layers} layers")
    if tokenizer is not None and (folder / "tokenizer.json").exists():
        theirs = Tokenizer.from_folder(folder).tok.get_vocab(with_added_tokens=True)
        if theirs != tokenizer.tok.get_vocab(with_added_tokens=True):
            differs.append("its tokenizer.json maps tokens to other ids than the target's tokenizer")
    if differs:
        raise HFError(f"{folder}: the EAGLE-3 head was made for another target: " + "; ".join(differs))
    draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
    ckpt = _Checkpoint(folder, "eagle3")
    d2t = ckpt.get("d2t", (draft_vocab,), "draft_to_target") + np.arange(draft_vocab) if "d2t" in ckpt.where else None
    head = eagle.new_head(cfg, jax.random.key(0), layers, d2t)
    head = head.replace(cfg=dataclasses.replace(
        head.cfg, num_heads=hf.get("num_attention_heads", head.cfg.num_heads),
        num_kv_heads=hf.get("num_key_value_heads", head.cfg.kv_heads), head_dim=hf.get("head_dim", head.cfg.head_size),
        d_ff=hf.get("intermediate_size", head.cfg.d_ff), norm_eps=hf.get("rms_norm_eps", head.cfg.norm_eps),
        rope_theta=hf.get("rope_theta", head.cfg.rope_theta),
    ))  # fmt: skip
    h = head.cfg
    d, n, k, hd, f, vd = h.d_model, h.num_heads, h.kv_heads, h.head_size, h.d_ff, h.vocab_size

    def get(name, shape):
        return np.asarray(ckpt.get(name, shape, name), np.float32)

    params = {
        "fc_fd": get("fc.weight", (d, len(layers) * cfg.d_model)).T,
        "embed_norm": {"scale_d": get("midlayer.input_layernorm.weight", (d,))},
        "hidden_norm": {"scale_d": get("midlayer.hidden_norm.weight", (d,))},
        "mlp_norm": {"scale_d": get("midlayer.post_attention_layernorm.weight", (d,))},
        "final_norm": {"scale_d": get("norm.weight", (d,))},
        "layer": {
            "w_q_dnh": get("midlayer.self_attn.q_proj.weight", (n * hd, 2 * d)).T.reshape(2 * d, n, hd),
            "w_k_dkh": get("midlayer.self_attn.k_proj.weight", (k * hd, 2 * d)).T.reshape(2 * d, k, hd),
            "w_v_dkh": get("midlayer.self_attn.v_proj.weight", (k * hd, 2 * d)).T.reshape(2 * d, k, hd),
            "w_o_nhd": get("midlayer.self_attn.o_proj.weight", (d, n * hd)).T.reshape(n, hd, d),
            "mlp": {
                "w_gate_df": get("midlayer.mlp.gate_proj.weight", (f, d)).T,
                "w_up_df": get("midlayer.mlp.up_proj.weight", (f, d)).T,
                "w_down_fd": get("midlayer.mlp.down_proj.weight", (d, f)).T,
            },
        },
        "head_dv": get("lm_head.weight", (vd, d)).T,
    }
    return eagle.check_head(head.replace(params=jax.tree.map(np.ascontiguousarray, params)), cfg)
