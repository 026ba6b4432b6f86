"""What the RL loop trains and how the engine gets it: the whole model, or LoRA adapters over a frozen base.

    policy = Policy.of(cfg, mesh, start_params)    # model.lora.rank > 0: the adapters train, the base is frozen
    llm = policy.engine(state, tokenizer, slots=..., num_pages=...)
    llm.generate(prompts, sampling, lora=policy.adapter)
    logp = token_logprobs(policy.forward_params(state.params, base), ...)
    policy.swap(llm, state)                        # after each update

Full training (`model.lora.rank` 0): the state's params are the whole model, the reference policy is the
starting params and the swap is `LLM.update_params` (every weight laid out again and copied).
LoRA (`model.lora.rank` > 0): the state's params are the adapters (`jaxgen.training.step.create_train_state`),
the base is held frozen as `model.lora.base_dtype` says (`create_base`: float32, bfloat16, int8 or nf4) and shared
by the trainer's forward and the engine; the engine serves the adapters from slot 1 of its LoRA bank
(`serve.max_loras=1`, `jaxgen.model.lora.Bank`) and the swap rewrites that slot in place (`LLM.update_lora`: a
jitted write with the bank donated, the adapters' bytes only, no recompilation). Merging instead would rewrite
every adapted matrix of the base and copy the whole model into the engine at each step, and an int8 base would
come back float32 (`lora.merge`), a structure the engine's programs were not compiled for. The reference
policy is the base with the adapters off, which is the starting policy exactly (B starts at zero).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.config import Config, ConfigError, LoraConfig
from jaxgen.model import lora
from jaxgen.training.step import TrainState, create_base

ADAPTER = "policy"  # the adapter's name in the engine


def _as_they_are(tree):
    return tree


@dataclasses.dataclass(frozen=True)
class Policy:
    cfg: Config
    base: dict | None  # LoRA's frozen base (model.lora.base_dtype, training layout); None for full training
    start: dict | None  # full training's starting params (the KL penalty's reference); None with LoRA or no KL

    @classmethod
    def of(cls, cfg: Config, mesh, start_params: dict) -> Policy:
        """The policy of `cfg` starting from `start_params` (float32, in their shardings on `mesh`)."""
        if cfg.model.lora.dora:  # the sampling engine runs the adapter from its bank, which holds plain LoRA only
            raise ConfigError("model.lora.dora=true is not allowed in reinforcement learning: the sampler's "
                              "adapter bank serves plain LoRA only (train DoRA with train.py)")  # fmt: skip
        if cfg.model.lora.rank:
            return cls(cfg, create_base(cfg, mesh, start_params), None)
        # a copy: the train state starts on these very arrays and its update donates them
        return cls(cfg, None, jax.tree.map(jnp.copy, start_params) if cfg.rl.kl_coef else None)

    @property
    def adapter(self) -> str | None:
        """The engine's adapter requests name (None: the engine's weights are the policy)."""
        return ADAPTER if self.base is not None else None

    @property
    def reference(self) -> dict:
        """The frozen reference policy's params (the KL penalty's): the start, or the base with adapters off."""
        return self.start if self.base is None else self.base

    @staticmethod
    def forward_params(trainable: dict, base: dict | None) -> dict:
        """The params the training forward reads: `trainable` itself, or the base with the adapters attached."""
        return trainable if base is None else lora.attach(base, trainable)

    def engine(self, state: TrainState, tokenizer, place=_as_they_are, **serve):
        """An `LLM` serving the policy of `state` (its weights copied: the trainer may donate its own).
        place: a tree of the trainer's arrays -> this process's whole copy for its engine (`loop.engine_params`
        on a mesh over several processes)."""
        from jaxgen.inference.llm import LLM

        if self.base is None:
            return LLM(place(state.params), cfg=self.cfg.model, tokenizer=tokenizer, **serve)
        rank = self.cfg.model.lora.rank
        serving = dataclasses.replace(self.cfg.model, lora=LoraConfig())  # the bank holds the adapters
        llm = LLM(place(self.base), cfg=serving, tokenizer=tokenizer, max_loras=1, max_lora_rank=rank, **serve)
        llm.load_lora(ADAPTER, place(state.params), self.cfg.model.lora.scale)
        return llm

    def swap(self, llm, state: TrainState, place=_as_they_are) -> None:
        """The engine onto the policy of `state`: every weight (full), or the adapters' slot in place (LoRA)."""
        if self.base is None:
            llm.update_params(place(state.params))
        else:
            llm.update_lora(ADAPTER, place(state.params), self.cfg.model.lora.scale)
