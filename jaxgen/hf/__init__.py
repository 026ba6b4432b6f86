"""Hugging Face checkpoints: import a local model folder into jaxgen, and export jaxgen params to one.

    cfg, tokenizer, params = load_pretrained("path/to/folder", mesh)   # config.json + *.safetensors
    save_pretrained("out/folder", params, cfg, tokenizer)              # transformers loads it back
    write_peft_adapter("out/adapter", adapters, cfg)                   # LoRA adapters: PEFT's folder
    adapters, lora_cfg = read_peft_adapter("in/adapter", cfg)

Supported families (FAMILIES): GPT-2, Llama (Llama 3 rope scaling included), Mistral (sliding window),
Qwen2 (q/k/v biases), Qwen3 (per-head qk-norm), Gemma (GeGLU, scaled embeddings, (1 + scale) RMSNorm),
Gemma 2 (sandwich norms, soft-capping, alternating local/global layers), Gemma 3 (qk-norm, 5:1
local/global with a local RoPE base), OLMo 2 (whole-projection qk-norm, post-norms), Phi-3 (fused qkv
and gate_up, split on import and fused on export), Mixtral and Qwen3-MoE (experts stored one tensor
per expert, stacked in jaxgen).
Nothing is downloaded: a folder is what `save_pretrained` or `huggingface-cli download` left on disk.

Weights are read tensor by tensor from memory-mapped safetensors files (single or sharded with
model.safetensors.index.json) and each jaxgen parameter is placed straight into its sharding, so
beside the placed model the host holds one stacked parameter (and briefly device_put's copy of it).

Every entry of config.json is read typed and range-checked (`fields`): a bad one is an HFError naming the
file, the key and the value, raised before any weight is read; so are weights larger than the memory.

Modules (imports point down the list; safetensors needs only HFError from config):
    families     one record per family (FAMILY: model_type -> Family): what its config.json and tensors hold
                 beyond the Llama layout; adding a family is one record
    fields       typed reading of a JSON file's entries (HFError naming file, key, value, what is allowed)
    config       config.json <-> ModelConfig: FAMILIES, read_config, family_of, hf_config, HFError
    safetensors  memory-mapped .safetensors reader with header checks; a folder's single or sharded
                 files, each kept inside the folder
    weights      jaxgen parameter path <-> Hugging Face tensor name (tensor_map, Tensor), shape and
                 transpose conversions
    load         is_hf_folder, load_params, load_pretrained, check_memory
    export       save_pretrained (sharded safetensors, config.json, generation_config.json, tokenizer)
    peft         PEFT LoRA adapter folders in and out: write_peft_adapter, read_peft_adapter (the modules
                 of `weights.tensor_map`; fused ones as one adapter of stacked rank)
    eagle3       EAGLE-3 draft heads in vLLM's and SGLang's layout (LlamaForCausalLMEagle3): save, load
"""

from jaxgen.hf.config import FAMILIES, HFError, family_of, hf_config, read_config
from jaxgen.hf.export import save_pretrained
from jaxgen.hf.families import FAMILY, Family
from jaxgen.hf.load import is_hf_folder, load_params, load_pretrained
from jaxgen.hf.peft import read_peft_adapter, write_peft_adapter
from jaxgen.hf.weights import Tensor, tensor_map

__all__ = [
    "FAMILIES",
    "FAMILY",
    "Family",
    "HFError",
    "Tensor",
    "family_of",
    "hf_config",
    "is_hf_folder",
    "load_params",
    "load_pretrained",
    "read_config",
    "read_peft_adapter",
    "save_pretrained",
    "tensor_map",
    "write_peft_adapter",
]
