"""The network: parameters, the forward pass, attention, and the KV caches it reads and writes.

    layers.py       norms, rotary positions, MLP, soft-capping, 2-D weight products
    moe.py          mixture of experts: router, dropless dispatch (grouped tiles / ragged_dot / dense)
    attention.py    the mask rule, dense attention, one blockwise online softmax over any cache
    blockwise.py    flash-style attention over whole sequences, with a recomputing custom VJP
    context.py      context parallelism: ring and all-gather attention over the mesh's context axis
    kernels/        kernels behind the attention seam and which runs where: cuDNN, Pallas splash, GPU Pallas
                    paged decode, XLA:CPU decode tuning (imports nothing else of this package)
    params.py       the parameter table (shapes, logical axes, initialisers), init, counts, FLOPs per token
    lora.py         low-rank adapters (LoRA): their table, init, and the product added to targeted weights
    transformer.py  forward (cache=None for training), the layer stack, LM head
    cache.py        the cache contract (`Cache`): what the model and the decode core ask of a KV cache
    kvcache.py      the contiguous KV cache pytree, a buffer per layer and block (Generator, beam search)
    paged.py        the paged KV cache pytree (the serving engine)
    storage.py      how caches store keys and values (bfloat16 bits on CPU, int8 with per-token scales)
    quant.py        int8 weights for inference (QArray, per-channel scales, int8 x int8 products)
    nf4.py          4-bit NormalFloat weights for a LoRA run's frozen base (NF4, dequantized in the product)
    layout.py       decoding's weight layout: matrix products' weights output-major (OutMajor)
    eagle.py        EAGLE-3 draft heads: one layer on the target's tapped features, drafting and training forward

`from jaxgen import model; model.forward(params, tokens, positions, cache=None, cfg=cfg)`.
"""

from jaxgen.model.params import ParamSpec, count_params, flops_per_token, init_params, param_shardings, param_specs
from jaxgen.model.transformer import (
    decode_params,
    forward,
    hidden_states,
    lm_head,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "ParamSpec",
    "count_params",
    "decode_params",
    "flops_per_token",
    "forward",
    "hidden_states",
    "init_params",
    "lm_head",
    "param_shardings",
    "param_specs",
    "stack_layers",
    "unstack_layers",
]
