"""Environments for multi-turn rollouts: the interface, the built-in calculator, and how a config names one.

An environment is one episode of a chat with the policy (`jaxgen.rl.episodes` runs them):

    env = Env(record, tools=True)   # record: the prompt record ({"prompt": ..., fields}); tools=False: an
                                    #   ablation, every tool call answered with an error
    env.reset() -> [messages]       # the conversation's opening messages (system, user), OpenAI's dicts
    env.step(message) -> [messages] # the model's message {"role": "assistant", "content": str, "tool_calls"?:
                                    #   [{"id", "type", "function": {"name", "arguments": dict}}]} -> the
                                    #   messages that follow it (tool results, a user's next turn); [] ends it
    env.reward() -> float           # once the episode has ended (also after a cut-off one: no more turns)
    env.tools                       # OpenAI tool dicts the chat template lists (None: the opening says it)
    Env.warm_start(seed)            # optional: conversations for a supervised warm start ({"messages": ...})

The model's tool calls reach `step` already parsed by the server's tool parser (`jaxgen.serving.tools`, the
chat template's format); a message whose text does not parse as calls has none. `rl.environment` names a class
as "module:Class" (for `rl.task=jsonl`); `rl.task=calculator` is the built-in one below.
"""

from __future__ import annotations

import ast
import importlib
import operator
import threading

import numpy as np

from jaxgen.config import RLConfig

DISABLED = "error: tools are disabled"  # what a disabled tool answers (rl.tools=false)


class Environment:
    """The interface (see the module's docstring); subclasses set `tools` and write the four methods."""

    tools: list[dict] | None = None

    def __init__(self, record: dict, tools: bool = True):
        self.record, self.tools_enabled = record, tools

    def reset(self) -> list[dict]:
        raise NotImplementedError

    def step(self, message: dict) -> list[dict]:
        raise NotImplementedError

    def reward(self) -> float:
        raise NotImplementedError


class Calculator(Environment):
    """Sums of two three-digit numbers, "347+598", rewarded 1.0 for the exact answer as the model's last
    message. Beyond what a small model memorizes, so the reward comes from calling `calculator` with the
    expression and copying its result: the warm start teaches the calls on a share of its conversations
    (`TOOL_SHARE`), estimates the rest, and RL finds that calling pays. With `tools=False` each call
    gets `DISABLED` back, and the reward stays near chance."""

    TOOL = "calculator"
    TOOL_SHARE = 0.5  # of the warm start's conversations (the others estimate); fewer teach copying too slowly
    LOW, HIGH = 100, 999  # the operands

    # tools: None (the base's): the opening is the sum alone, a short prompt; the warm start taught the call

    def reset(self) -> list[dict]:
        self.answer, self.final = self.record["answer"], None
        return [{"role": "user", "content": self.record["prompt"]}]

    def step(self, message: dict) -> list[dict]:
        calls = message.get("tool_calls") or []
        if not calls:
            self.final = message.get("content") or ""
            return []
        return [{"role": "tool", "tool_call_id": c["id"], "content": self._run(c["function"])} for c in calls]

    def reward(self) -> float:
        return float(self.final is not None and self.final.strip() == self.answer)

    def _run(self, function: dict) -> str:
        if not self.tools_enabled:
            return DISABLED
        if function.get("name") != self.TOOL:
            return f"error: no tool named {function.get('name')!r}"
        expression = (function.get("arguments") or {}).get("expression")
        try:
            return str(evaluate(expression))
        except (ValueError, ZeroDivisionError) as e:
            return f"error: {e}"

    @classmethod
    def records(cls, seed: int, count: int) -> list[dict]:
        """`count` problems drawn with `seed`: [{"prompt": "a+b", "answer": "a + b"}]."""
        pairs = np.random.default_rng(seed).integers(cls.LOW, cls.HIGH + 1, size=(count, 2))
        return [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in pairs.tolist()]

    @classmethod
    def warm_start(cls, seed: int, count: int = 30000) -> list[dict]:
        """Chat SFT conversations: a `TOOL_SHARE` of them call the calculator and copy its result; the others
        answer at once with an estimate, the sum to the nearest hundred (what a policy can learn to do in its
        head: close, rarely exact). Enough of them that a warm start sees each about once, so the share is
        learned as one probability for every sum rather than memorized sum by sum."""
        rng = np.random.default_rng([seed, 1])  # apart from the records' draws: the choice must not follow the sum
        out = []
        for r in cls.records(seed, count):
            user = {"role": "user", "content": r["prompt"]}
            if rng.random() < cls.TOOL_SHARE:
                call = {"id": "call_0", "type": "function",
                        "function": {"name": cls.TOOL, "arguments": {"expression": r["prompt"]}}}  # fmt: skip
                turns = [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_0", "content": r["answer"]},
                         {"role": "assistant", "content": r["answer"]}]  # fmt: skip
            else:
                turns = [{"role": "assistant", "content": str(round(int(r["answer"]), -2))}]
            out.append({"messages": [user, *turns]})
        return out


BUILT_IN = {"calculator": Calculator}

_PARSING = threading.Lock()
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def evaluate(expression) -> int:
    """An integer expression of + - * // and parentheses, evaluated without running code; ValueError otherwise."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError(f"expression must be a string of at most 200 characters, got {str(expression)[:40]!r}")
    try:
        with _PARSING:  # CPython 3.11's ast.parse is not thread-safe (SystemError from concurrent calls)
            tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if abs(left) > 10**12 or abs(right) > 10**12:
                raise ValueError("numbers beyond 10**12")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"only integers and + - * // are allowed in {expression!r}")

    return value(tree)


def environment_class(cfg: RLConfig) -> type[Environment] | None:
    """The environment class the config names (None: single-turn rollouts scored by a reward function)."""
    if cfg.task in BUILT_IN:
        return BUILT_IN[cfg.task]
    if not cfg.environment:
        return None
    cls = imported("rl.environment", cfg.environment)
    module_name, _, name = cfg.environment.partition(":")
    if not isinstance(cls, type):
        raise ValueError(f"rl.environment={cfg.environment!r}: {module_name} has no class {name!r}")
    missing = [m for m in ("reset", "step", "reward") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"rl.environment={cfg.environment!r}: {name} has no {', '.join(missing)} (an environment has "
                         "reset, step and reward: jaxgen.rl.environments)")  # fmt: skip
    return cls


def imported(key: str, value: str):
    """What "module:name" (the config's `key`) names, imported; None when the module has no such name."""
    module_name, _, name = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={value!r}: cannot import {module_name!r} ({e})") from e
    return getattr(module, name, None)
