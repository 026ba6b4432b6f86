"""What a reinforcement-learning run reads (`rl.py`): the task and its reward, the rollouts, the loss."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxgen.config.base import check, check_literals

TASKS = ("arithmetic", "calculator", "jsonl")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    # the prompts and how answers are scored
    # a built-in task: arithmetic (jaxgen.rl.tasks) or calculator (multi-turn with a tool:
    # jaxgen.rl.environments); or "jsonl": prompts from `prompts`
    task: str = "arithmetic"
    max_operand: int = 9  # the arithmetic task's operands: 0..max_operand
    prompts: tuple[str, ...] = ()  # globs of JSONL files: {"prompt": ..., other fields passed to the reward}
    reward: str = ""  # "module:function(prompt, completion, **fields) -> float"; "" = the task's own
    # multi-turn rollouts (jaxgen.rl.episodes): "module:Class", an environment for the jsonl task's prompts
    # ("" = single-turn, scored by `reward`); the calculator task has its own
    environment: str = ""
    tools: bool = True  # false: the environment answers every tool call with an error (an ablation)
    max_turns: int = 4  # the model's turns in an episode
    init_from: str = ""  # the starting policy: a run folder or a Hugging Face folder; "" = a warm start
    warm_start_steps: int = 200  # supervised steps on the built-in task's answers before RL ("" init_from)
    warm_start_learning_rate: float = 2e-3  # the warm start's peak (the optimizer section is RL's)
    # rollouts: prompts_per_step prompts, group_size samples each, from the live engine
    prompts_per_step: int = 8
    group_size: int = 8  # n: samples per prompt, the group GRPO's advantages are relative to
    temperature: float = 1.0
    max_new_tokens: int = 8
    max_prompt_tokens: int = 32  # prompts are padded to this (one compiled update for every batch)
    reward_workers: int = 4  # threads scoring completions beside the device's work
    # 0: the engine on this process's first device of the trainer's mesh (they take turns); N > 0: the engine
    # on each process's first N devices (its slots split over them), the trainer's mesh over the others
    sampler_devices: int = 0
    # the objective (jaxgen.rl.objectives)
    algorithm: Literal["grpo", "reinforce"] = "grpo"
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: a KL penalty to the frozen starting policy, scored with the same forward
    averaging: Literal["token", "sequence"] = "token"
    normalize: bool = True  # GRPO's division by the group's reward spread (False: Dr. GRPO)
    # off-policy rollouts (jaxgen.rl.objectives, docs/rl.md): the rollouts of step k + max_staleness are
    # generated while update k runs, so each update uses rollouts up to max_staleness policy versions old
    # (0: generate, then update, in turn); the loss corrects with each token's importance weight
    max_staleness: int = 0
    # truncated IS, masked IS, or the algorithm's clip only; auto: none at max_staleness 0, else tis
    correction: Literal["auto", "tis", "mask", "none"] = "auto"
    is_cap: float = 2.0  # tis: the weight's cap; mask: tokens weighted outside [1 / is_cap, is_cap] drop

    def __post_init__(self):
        check_literals(self, "rl")
        check(self.task in TASKS, "rl.task", self.task, "arithmetic or calculator (built in), or jsonl")
        if self.task == "jsonl":
            check(bool(self.prompts), "rl.prompts", self.prompts, "at least one JSONL glob for rl.task=jsonl")
            check(bool(self.reward or self.environment), "rl.reward", self.reward,
                  "module:function for rl.task=jsonl (or an rl.environment, which rewards its episodes)")  # fmt: skip
            check(
                bool(self.init_from), "rl.init_from", self.init_from, "a run or Hugging Face folder for rl.task=jsonl"
            )
        if self.environment:
            module, _, name = self.environment.partition(":")
            check(bool(module and name), "rl.environment", self.environment, "module:Class, e.g. mytask:Env")
            check(self.task == "jsonl", "rl.environment", self.environment,
                  f"only with rl.task=jsonl (rl.task={self.task} has its own)")  # fmt: skip
        if self.reward:
            check(not (self.environment or self.task == "calculator"), "rl.reward", self.reward,
                  "empty with an environment (rl.environment, rl.task=calculator), which rewards episodes")  # fmt: skip
            module, _, function = self.reward.partition(":")
            check(bool(module and function), "rl.reward", self.reward, "module:function, e.g. mytask:reward")
        integers = {
            "max_operand": 1,
            "warm_start_steps": 0,
            "prompts_per_step": 1,
            "group_size": 1,
            "max_new_tokens": 1,
            "max_prompt_tokens": 1,
            "reward_workers": 1,
            "max_staleness": 0,
            "sampler_devices": 0,
            "max_turns": 1,
        }  # name: the least allowed
        for name, low in integers.items():
            value = getattr(self, name)
            check(isinstance(value, int) and value >= low, f"rl.{name}", value, f"an integer >= {low}")
        finite = math.isfinite  # inf passes `> 0`, and turns every loss or sample into NaN
        check(self.temperature > 0 and finite(self.temperature), "rl.temperature", self.temperature,
              "a finite number > 0 (rollouts sample)")  # fmt: skip
        check(0 < self.clip_eps < 1, "rl.clip_eps", self.clip_eps, "a number in (0, 1)")
        check(self.warm_start_learning_rate > 0 and finite(self.warm_start_learning_rate),
              "rl.warm_start_learning_rate", self.warm_start_learning_rate, "a finite number > 0")  # fmt: skip
        check(self.kl_coef >= 0 and finite(self.kl_coef), "rl.kl_coef", self.kl_coef, "a finite number >= 0")
        check(self.is_cap > 1 and finite(self.is_cap), "rl.is_cap", self.is_cap, "a finite number > 1")
        if self.algorithm == "grpo":
            check(
                self.group_size >= 2, "rl.group_size", self.group_size, "at least 2 for grpo (advantages are relative)"
            )
