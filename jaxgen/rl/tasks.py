"""Prompts and rewards: the built-in arithmetic task, JSONL prompt files, and rewards named in the config.

The built-in task asks for the sum of two numbers, "7+5=", and rewards the exact answer, "12", with
1.0 (anything else 0.0): verifiable, learnable by a small byte-level model on a CPU, and a success rate
that says at a glance whether RL helps. Its supervised warm start (`warm_start_records`) teaches the
format and part of the table, so the policy's success rate starts above zero.

A reward is any function `reward(prompt: str, completion: str, **fields) -> float`, named "module:function";
`fields` are the prompt record's other fields (the built-in task passes `answer`).
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxgen.config import RLConfig
from jaxgen.rl.environments import Calculator, imported
from jaxgen.training.data.sources import jsonl_records


def arithmetic_records(seed: int, count: int, max_operand: int = 9) -> list[dict]:
    """`count` problems drawn with `seed`, operands 0..max_operand: [{"prompt": "a+b=", "answer": "c"}]."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, max_operand + 1, size=(count, 2))
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs.tolist()]


def warm_start_records(seed: int, max_operand: int = 9, count: int = 4000) -> list[dict]:
    """Supervised pairs for the warm start ({"prompt", "response"}: jsonl source with prompt/response fields),
    drawn with a seed apart from the RL prompts' (the table is small: they overlap, as intended)."""
    return [
        {"prompt": r["prompt"], "response": r["answer"]} for r in arithmetic_records(seed + 7919, count, max_operand)
    ]


def exact_match(prompt: str, completion: str, answer: str = "", **_) -> float:
    """1.0 when the completion, up to its first newline and without surrounding spaces, is the answer."""
    return float(completion.split("\n", 1)[0].strip() == answer)


def load_reward(cfg: RLConfig) -> Callable[..., float]:
    """The reward function the config names, imported (the task's own when `rl.reward` is empty)."""
    if not cfg.reward:
        return exact_match
    fn = imported("rl.reward", cfg.reward)
    if not callable(fn):
        module_name, _, name = cfg.reward.partition(":")
        raise ValueError(f"rl.reward={cfg.reward!r}: {module_name} has no function {name!r}")
    return fn


def load_prompts(cfg: RLConfig, seed: int) -> list[dict]:
    """Every prompt record of the run, in a fixed order: the built-in task's (drawn with `seed`) or the
    JSONL files' lines ({"prompt": str, ...}; a bad line is an error naming file and line)."""
    if cfg.task == "arithmetic":
        return arithmetic_records(seed, 2000, cfg.max_operand)
    if cfg.task == "calculator":
        return Calculator.records(seed, 2000)
    records = []
    paths = sorted({p for pattern in cfg.prompts for p in glob.glob(str(Path(pattern).expanduser()))})
    if not paths:
        raise ValueError(f"rl.prompts={list(cfg.prompts)} matches no file")
    for path in paths:
        for lineno, record in jsonl_records(path):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: a prompt record is an object with a string 'prompt'")
            records.append(record)
    return records


def step_prompts(records: list[dict], seed: int, step: int, count: int) -> list[dict]:
    """The `count` records of RL step `step`: a function of (seed, step) alone, so a resumed run draws
    what the uninterrupted one drew."""
    rng = np.random.default_rng([seed, step])
    return [records[i] for i in rng.choice(len(records), size=count, replace=len(records) < count)]
