"""Multi-turn rollouts: a step's episodes, each a chat between the policy and its environment
(`jaxgen.rl.environments`), run turn by turn on the engine; the loss later covers the model's tokens only.

    chat = Chat(tokenizer)
    episodes = run_episodes(llm, chat, envs, seeds, cfg.rl, workers, lora)   # one Episode per environment

Tokens of an episode: the opening messages rendered by the chat template (with the generation prompt) and
encoded as the server encodes a chat prompt; then per turn the model's sampled tokens as sampled (its end-of-turn
token included, each with the sampler's processed log-probability) and the text the template writes between
the end of the model's turn and the next generation prompt (the environment's messages), encoded. The model's
text is never encoded again, so the tokens trained on are the tokens sampled. Each turn, every episode still
going is one request to the engine, all of them at once, its tokens so far the prompt (the engine's prefix cache
takes the part it has seen). An episode ends when the environment answers nothing ("done"), after
`rl.max_turns` model turns ("turns"), or when its tokens would pass rl.max_prompt_tokens + rl.max_new_tokens
("length": a turn cut short is not given to the environment).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxgen.config import RLConfig

ENDS = ("done", "turns", "length")


@dataclasses.dataclass
class Episode:
    env: object  # a jaxgen.rl.environments.Environment
    messages: list[dict]  # the conversation its tokens hold, the model's messages with their calls parsed
    said: list[str]  # the model's text of each of its turns, as written
    tokens: list[int]
    logprobs: list[float]  # per token: the sampler's processed log-probability of a model token, else 0
    model: list[bool]  # per token: the model sampled it (the loss's mask)
    turns: int = 0  # the model's turns
    tool_calls: int = 0
    end: str = ""  # one of ENDS once over

    def add(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.model += [logprobs is not None] * len(tokens)


class Chat:
    """The tokenizer's chat template and tool-call format: the tokens of an opening, of what follows a model
    turn, and the model's text as a message."""

    def __init__(self, tokenizer):
        from jaxgen.chat_template import compile_template
        from jaxgen.serving.tools import format_of

        if tokenizer.chat_template is None:
            raise ValueError("multi-turn rollouts need a chat template: the policy's tokenizer has none (byte-chat "
                             "is the byte-level tokenizer with one)")  # fmt: skip
        self.tokenizer, self.template = tokenizer, compile_template(tokenizer.chat_template)
        self.format = format_of(tokenizer.chat_template)

    def render(self, messages: list[dict], tools, prompt: bool) -> str:
        from jaxgen.chat_template import TemplateRefused

        extra = {"tools": tools} if tools else {}
        roles = [m.get("role") for m in messages]
        try:
            return self.template.render(messages=messages, add_generation_prompt=prompt, **extra)
        except TemplateRefused as e:
            raise ValueError(f"the chat template refused an episode's messages (roles {roles}): {e}") from None
        except Exception as e:  # an undefined name, a type error: the template cannot take these messages
            raise ValueError(f"the chat template failed on an episode's messages (roles {roles}): "
                             f"{type(e).__name__}: {e}") from None  # fmt: skip

    def opening(self, messages: list[dict], tools) -> list[int]:
        """The prompt's tokens: the render with the generation prompt, the tokenizer's own special tokens added."""
        return self.tokenizer.encode(self.render(messages, tools, True), special=True)

    def following(self, messages: list[dict], new: list[dict], tools, end: int | None = None) -> list[int]:
        """The tokens the template writes after `messages` (ending in the model's turn) for the `new` messages
        and the next generation prompt. end: the token that ended the model's turn (None: none did); what the
        template writes after it within the turn (ChatML's newline after `<|im_end|>`) comes first."""
        before, after = self.render(messages, tools, False), self.render(messages + new, tools, True)
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation's earlier turns differently once more follow, "
                             "so what the environment adds cannot be appended to the tokens sampled")  # fmt: skip
        tail = ""
        if end is not None:
            marker = self.tokenizer.decode([end])
            at = before.rfind(marker) if marker else -1
            tail = before[at + len(marker) :] if at >= 0 else ""
        return self.tokenizer.encode(tail + after[len(before) :], special=False)

    def message(self, text: str) -> dict:
        """The model's turn (its text, the end-of-turn token not in it) as a message, with the calls it makes
        when the whole of its text after any leading words parses as calls (the server's rule)."""
        try:
            calls = self.format.parse(text)
        except (ValueError, RecursionError):  # JSON the parser cannot hold (a 5000-digit number, deep nesting)
            calls = None
        if not calls:
            return {"role": "assistant", "content": text}
        tool_calls = [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}
                      for k, (name, args) in enumerate(calls)]  # fmt: skip
        return {"role": "assistant", "content": self.format.content(text) or None, "tool_calls": tool_calls}


def run_episodes(llm, chat: Chat, envs: list, seeds: np.ndarray, cfg: RLConfig, workers, lora=None) -> list[Episode]:
    """Runs one episode per environment to its end. seeds: (rl.max_turns, len(envs)) the sampling seed of each
    episode's turns; workers: an executor for the environments' steps (tool calls run beside each other)."""
    from jaxgen.inference.sampling import SamplingConfig

    budget = cfg.max_prompt_tokens + cfg.max_new_tokens
    episodes = []
    for env in envs:
        messages = opening(env)
        tokens = chat.opening(messages, tools_of(env))
        if len(tokens) > cfg.max_prompt_tokens:
            raise ValueError(f"an episode's opening has {len(tokens)} tokens ({str(messages[-1].get('content'))[:40]!r}"
                             f"...); rl.max_prompt_tokens={cfg.max_prompt_tokens}")  # fmt: skip
        episode = Episode(env, messages, [], [], [], [])
        episode.add(tokens)
        episodes.append(episode)
    for turn in range(cfg.max_turns):
        going = [i for i, e in enumerate(episodes) if not e.end]
        if not going:
            break
        sampling = [
            SamplingConfig(temperature=cfg.temperature, max_new_tokens=budget - len(episodes[i].tokens),
                           logprobs_mode="processed", seed=int(seeds[turn, i]))
            for i in going
        ]  # fmt: skip
        outputs = llm.generate([episodes[i].tokens for i in going], sampling, lora)
        said = []
        for i, out in zip(going, outputs, strict=True):
            e, c = episodes[i], out.outputs[0]
            e.add(list(c.tokens), list(c.logprobs))
            e.turns += 1
            message = chat.message(c.text)
            e.messages.append(message)
            e.said.append(c.text)
            e.tool_calls += len(message.get("tool_calls") or [])
            if c.finish_reason == "length":
                e.end = "length"
            else:
                said.append((e, c.tokens[-1] if c.tokens else None))
        answers = list(workers.map(_step, [e for e, _ in said]))
        for (e, end), new in zip(said, answers, strict=True):
            if not new:
                e.end = "done"
            elif e.turns == cfg.max_turns:
                e.end = "turns"
            else:
                more = chat.following(e.messages, new, tools_of(e.env), end)
                if len(e.tokens) + len(more) >= budget:  # the model would have no token left to write
                    e.end = "length"
                else:
                    e.messages += new
                    e.add(more)
    return episodes


def opening(env) -> list[dict]:
    """The environment's opening messages, checked; its failure named."""
    return _called(env, "reset")


def tools_of(env) -> list[dict] | None:
    return getattr(env, "tools", None)


def _step(e: Episode) -> list[dict]:
    return _called(e.env, "step", e.messages[-1])


def _called(env, method: str, *args) -> list[dict]:
    try:
        answer = getattr(env, method)(*args)
    except Exception as error:  # the environment's own failure, named: a traceback from a worker thread is not
        raise ValueError(f"{type(env).__name__}.{method} raised {type(error).__name__}: {error}") from error
    return _checked(env, answer, method)


def _checked(env, messages, method: str) -> list[dict]:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | None)
        for m in messages
    )
    if not ok:
        raise ValueError(f"{type(env).__name__}.{method} returned {str(messages)[:80]!r}: a list of messages "
                         '({"role": str, "content": str, ...})')  # fmt: skip
    return messages


def layout(rows: list[tuple[list[int], list[bool], list[float]]], T: int) -> dict:
    """The update's token arrays of rows (tokens, trained, log-probabilities), left-aligned and padded with
    position -1 to T: tokens, positions (B, T) int32; mask, old_logp (B, T - 1) float32, column t scoring
    token t + 1."""
    B = len(rows)
    out = {"tokens": np.zeros((B, T), np.int32), "positions": np.full((B, T), -1, np.int32),
           "mask": np.zeros((B, T - 1), np.float32), "old_logp": np.zeros((B, T - 1), np.float32)}  # fmt: skip
    for i, (tokens, trained, logp) in enumerate(rows):
        n = len(tokens)
        out["tokens"][i, :n] = tokens
        out["positions"][i, :n] = np.arange(n)
        out["mask"][i, : n - 1] = trained[1:]
        out["old_logp"][i, : n - 1] = logp[1:]
    return out
