"""Chat SFT data (`data.source=chat`): JSONL conversations rendered with the tokenizer's chat template,
the loss on the assistant's tokens only.

A line is `{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}` (OpenAI's form; `tools`
optional). Roles: system, user, assistant, tool. Content is text, a list of text parts (joined by
newlines, as the server joins them), or null for an assistant message that only calls tools
(`tool_calls`; string arguments are parsed to objects, as templates expect). Other keys of a message
(`name`, `tool_call_id`, `reasoning_content`, ...) reach the template unchanged.

Where the assistant's tokens are is found by rendering, never by guessing token ids. For assistant
message i, the render of messages[:i] with add_generation_prompt=True and the render of messages[:i+1]
without must both be prefixes of the whole conversation's render; the characters between their ends are
what the assistant writes (its text and the template's end-of-turn, so the model learns to stop). The
tokens of the whole render whose characters overlap those spans (the tokenizer's offsets) are trained.
A template that cannot mark them (earlier turns rendered differently once later ones follow, no
generation prompt, the assistant's text or its calls' names not inside its span) is refused with the
reason, naming the line.
A bad line (not JSON, no messages, an unknown role, no assistant message) is an error naming file:line:
a data set is fixed before training, not skipped over silently.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from jaxgen.chat_template import TemplateRefused, compile_template
from jaxgen.config import DataConfig
from jaxgen.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
_BATCH = 256  # conversations tokenized at once


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    where: str  # "path:line", for errors


class ChatDataError(ValueError):
    """A line of chat data that cannot be trained on; the message starts with its path:line."""


def read_conversations(path: Path) -> Iterator[Conversation]:
    """The conversations of one JSONL file, checked line by line (blank lines are skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield parse_line(line, f"{path}:{lineno}")


def parse_line(line: str, where: str) -> Conversation:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ChatDataError(f"{where}: not valid JSON ({e.msg})") from None
    except (RecursionError, ValueError) as e:  # nested too deep for the parser; an integer of > 4300 digits
        raise ChatDataError(f"{where}: not JSON that can be read ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ChatDataError(f"{where}: 'messages' missing or not a non-empty list; got {keys}")
    messages = [parse_message(m, f"{where}: messages[{i}]") for i, m in enumerate(record["messages"])]
    if not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise ChatDataError(f"{where}: no assistant message: nothing to train on (roles: {roles})")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatDataError(f"{where}: 'tools' is {type(tools).__name__}: a list of tool objects (OpenAI's form)")
    return Conversation(messages, tools or None, where)


def parse_message(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise ChatDataError(f"{where} is {type(m).__name__}: an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise ChatDataError(f"{where}: role={role!r} is not allowed: one of {list(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ChatDataError(f'{where}: content parts must be text parts {{"type": "text", "text": ...}}')
        content = "\n".join(p["text"] for p in content)
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise ChatDataError(f"{where}: tool_calls must be a list, on an assistant message (role={role!r})")
    if not isinstance(content, str) and not (content is None and calls):
        raise ChatDataError(f"{where}: content is {type(content).__name__}: text (null only beside tool_calls)")
    if isinstance(content, str) and not content.isascii():
        try:
            content.encode()
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): no tokenizer takes it
            raise ChatDataError(f"{where}: content is not valid Unicode ({e.reason} at character {e.start})") from None
    out = {**m, "content": content}
    if calls:
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _call(call, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function", {}), dict):
        raise ChatDataError(f'{where}: a call is {{"type": "function", "function": {{"name", "arguments"}}}}')
    function = dict(call.get("function", {}))
    if isinstance(function.get("arguments"), str):  # templates write the arguments with tojson
        with contextlib.suppress(json.JSONDecodeError):  # else kept as text: the template shows what was written
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


class ChatRenderer:
    """A chat template and the spans of a conversation's render that the assistant writes."""

    def __init__(self, source: str | None, tokenizer_name: str = ""):
        if source is None:
            raise ChatDataError(
                f"data.source=chat needs a chat template: data.tokenizer={tokenizer_name!r} has none (byte-chat, "
                "the byte-level tokenizer with a built-in one, or a tokenizer folder whose tokenizer_config.json "
                "has chat_template, or chat_template.jinja beside it)"
            )
        try:
            self.template = compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatDataError(f"the chat template does not compile: {e} (line {e.lineno})") from None

    def render(self, conv: Conversation, upto: int, generation_prompt: bool) -> str:
        extra = {"tools": conv.tools} if conv.tools else {}
        try:
            return self.template.render(messages=conv.messages[:upto], add_generation_prompt=generation_prompt, **extra)
        except TemplateRefused as e:
            raise ChatDataError(f"{conv.where}: the chat template refused this conversation: {e}") from None
        except Exception as e:  # an undefined name, a type error, the sandbox: the template cannot take it
            raise ChatDataError(f"{conv.where}: the chat template failed: {type(e).__name__}: {e}") from None

    def spans(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The whole render and, per assistant message, the [start, end) characters it writes."""
        n = len(conv.messages)
        text = self.render(conv, n, False)
        if self.render(conv, n, True) == text:
            self._check_no_trailing_prompt(conv, text)
        spans = []
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant":
                continue
            before, through = self.render(conv, i, True), self.render(conv, i + 1, False)
            renders = {f"messages[:{i}] with add_generation_prompt": before, f"messages[:{i + 1}]": through}
            for name, part in renders.items():
                if not text.startswith(part):
                    raise self._refuse(conv, f"its render of {name} is not a prefix of the whole conversation's "
                                       "(it renders earlier turns differently once later ones follow)")  # fmt: skip
            start, end = len(before), len(through)
            content = (m["content"] or "").strip()
            if end <= start or content not in text[start:end]:
                raise self._refuse(conv, f"messages[{i}]'s text is not between its generation prompt and its end "
                                   f"(characters {start}..{end} of the render)")  # fmt: skip
            names = [c["function"].get("name") for c in m.get("tool_calls") or []]
            if not all(isinstance(n, str) and n in text[start:end] for n in names):
                raise self._refuse(conv, f"messages[{i}]'s tool calls {names} are not written in its turn (a template "
                                   "without tool calls would train on a turn that lost them)")  # fmt: skip
            spans.append((start, end))
        return text, spans

    def _check_no_trailing_prompt(self, conv: Conversation, text: str) -> None:
        """A template that ignores add_generation_prompt either writes no prompt at all (Mistral's: the user
        turn's end is the cue) or writes one always, which would end up in the last assistant's span: then
        the render stops being a prefix once another turn follows."""
        if conv.messages[-1]["role"] != "assistant":
            return  # the last assistant's span ends where the next message's begins: the prefix checks see it
        longer = Conversation([*conv.messages, {"role": "user", "content": "?"}], conv.tools, conv.where)
        try:
            after = self.render(longer, len(longer.messages), False)
        except ChatDataError:
            return  # the template takes no further turn: nothing to compare
        if not after.startswith(text):
            raise self._refuse(conv, "it writes a generation prompt even without add_generation_prompt, so the "
                               "last assistant turn's end cannot be told")  # fmt: skip

    @staticmethod
    def _refuse(conv: Conversation, reason: str) -> ChatDataError:
        return ChatDataError(f"{conv.where}: the chat template cannot mark the assistant's tokens: {reason}")


def assistant_mask(offsets: np.ndarray, spans: list[tuple[int, int]], n_chars: int) -> np.ndarray:
    """(n,) bool: which tokens, with character offsets (n, 2), overlap a span. A token that straddles a
    span's edge is in it (as transformers counts it); zero-width tokens (an added BOS) never are."""
    inside = np.zeros(n_chars + 1, np.int64)
    for start, end in spans:
        inside[start:end] = 1
    before = np.concatenate([[0], np.cumsum(inside)])  # before[c] = chars < c that are in a span
    lo, hi = offsets[:, 0], offsets[:, 1]
    return (hi > lo) & (before[hi] - before[lo] > 0)


def encode_conversations(cfg: DataConfig, tokenizer: Tokenizer, paths: list[Path]) -> Iterator[tuple]:
    """(tokens (n,) uint32, trained (n,) bool) per conversation, in file and line order.

    The render is tokenized as the server tokenizes a chat prompt (the tokenizer's own special tokens, e.g.
    a BOS, added; templates see no bos_token), so training and serving see the same ids."""
    renderer = ChatRenderer(tokenizer.chat_template, cfg.tokenizer)
    batch = []
    for path in paths:
        for conv in read_conversations(path):
            batch.append((conv, *renderer.spans(conv)))
            if len(batch) == _BATCH:
                yield from encode_rendered(batch, tokenizer)
                batch = []
    yield from encode_rendered(batch, tokenizer)


def encode_rendered(batch, tokenizer: Tokenizer):
    """(tokens (n,) uint32, trained (n,) bool) per (conversation, its render, the spans to train) of `batch`."""
    if not batch:
        return
    encodings = tokenizer.tok.encode_batch([text for _, text, _ in batch], add_special_tokens=True)
    for (conv, text, spans), enc in zip(batch, encodings, strict=True):
        tokens = np.asarray(enc.ids, np.uint32)
        trained = assistant_mask(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans, len(text))
        if not trained.any():
            raise ChatDataError(f"{conv.where}: no token of the assistant's turns survives tokenization")
        yield tokens, trained
