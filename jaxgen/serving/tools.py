"""Tool calls in /v1/chat/completions: OpenAI's `tools` and `tool_choice`, the constraint that makes a model
call one, and the calls parsed out of its text.

    tools        [{"type": "function", "function": {"name", "description", "parameters": JSON schema}}]
    tool_choice  "none" | "auto" (the default with tools) | "required" | {"type": "function", "function": {"name"}}

The chat template gets the tools as given (transformers' `tools=` convention) and writes them into the prompt
its own way. What a model writes back depends on its family: one `ToolFormat` object each, in FORMATS, chosen
by the first whose marker the template's text mentions (the first, Hermes, when none does):
    HERMES   "<tool_call>"                  Hermes/Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
                                            </tool_call>`, possibly several
    LLAMA3   "<|python_tag|>", "parameters" Llama 3: the whole message is `{"name": ..., "parameters": {...}}`
                                            (several joined by ";")
A new family (Mistral, Qwen3-coder, GLM) is one object: its markers, argument key, how one call is written
(`call_regex`, `render`), how calls are read back (`parse`), the text before them, and how much of a stream
can go out before a call may start (`safe_end`); `tests/test_structured_server.py` runs each one in FORMATS.
With "required" or a named function the output is constrained (`structured.Structured`) to calls whose
arguments satisfy their function's schema: one to MAX_CALLS of them ("required" with parallel_tool_calls not
false; joined by the format's `glue`), else exactly one; with "auto" the text is parsed after generation, and
holds calls only when all of it parses (else it stays text; with parallel_tool_calls false, only its first call
is kept). Calls carry ids `call_<hex>` (one each), arguments as JSON text, and finish_reason "tool_calls". An
answer cut short at max_tokens keeps its complete calls: the call it was cut in is dropped (the format's
`complete`), and finish_reason stays "length". A stream holds text back from where a call may start, and sends
the calls at the end.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets

from jaxgen.inference.sampling import SamplingError
from jaxgen.inference.structured import Structured, schema_regex
from jaxgen.serving.protocol import NamedChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MAX_CALLS = 4  # calls in a constrained answer ("required", parallel_tool_calls not false); each grows the automaton


class ToolFormat:
    """How one model family writes tool calls. A call is `(name, arguments)`; in the text it is a JSON object
    {"name": ..., <key>: {...}}."""

    name: str
    markers: tuple[str, ...]  # text that marks the family in a chat template
    key: str  # the arguments' key in a call's JSON object
    glue: str  # between two calls of a constrained answer

    def call_regex(self, call: str) -> str:
        """One call as the constraint writes it, `call` the regular expression of its JSON object."""
        raise NotImplementedError

    def render(self, calls: list[tuple[str, dict]]) -> str:
        """The text the family writes for `calls` (what `call_regex` and `glue` allow, what `parse` reads)."""
        raise NotImplementedError

    def parse(self, text: str) -> list[tuple[str, dict]] | None:
        """The calls in `text`, None when it holds none or does not parse whole."""
        raise NotImplementedError

    def content(self, text: str) -> str:
        """The text of a message that holds calls, before them ("" when calls are the whole message)."""
        raise NotImplementedError

    def safe_end(self, text: str) -> int:
        """How much of a streamed `text` can go out: everything before where a call may have started."""
        raise NotImplementedError

    def complete(self, text: str) -> str:
        """`text` cut short (max_tokens) without the call it was cut in: the text before the calls and the
        complete calls (what `parse` then reads)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"

    def _json(self, name: str, args: dict) -> str:
        return json.dumps({"name": name, self.key: args}, separators=(",", ":"))


class Hermes(ToolFormat):
    """Hermes and Qwen: each call in a `<tool_call>` block; text may come before the first."""

    name, markers, key, glue = "hermes", (OPEN,), "arguments", "\n"

    def call_regex(self, call: str) -> str:
        return f"{re.escape(OPEN)}\n{call}\n{re.escape(CLOSE)}"

    def render(self, calls: list[tuple[str, dict]]) -> str:
        return self.glue.join(f"{OPEN}\n{self._json(name, args)}\n{CLOSE}" for name, args in calls)

    def parse(self, text: str) -> list[tuple[str, dict]] | None:
        if OPEN not in text:
            return None
        rest = text[text.index(OPEN) :]
        bodies = re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), rest, re.DOTALL)
        leftover = re.sub(re.escape(OPEN) + r".*?" + re.escape(CLOSE), "", rest, flags=re.DOTALL)
        if not bodies or leftover.strip():
            return None  # an unclosed call, or text between calls: not a clean set of calls
        calls = [_call(b, self.key) for b in bodies]
        return None if None in calls else calls

    def content(self, text: str) -> str:
        return text.split(OPEN, 1)[0].strip()

    def safe_end(self, text: str) -> int:
        at = text.find(OPEN)
        if at >= 0:
            return at
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a tag cut in two by the stream
            if OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def complete(self, text: str) -> str:
        end = text.rfind(CLOSE)
        end = 0 if end < 0 else end + len(CLOSE)  # after the last closed call: nothing, or an unclosed one
        tail = text[end:]
        return text[:end] + tail[: self.safe_end(tail)]


class Llama3(ToolFormat):
    """Llama 3: the whole message is the calls (JSON objects joined by ";"), maybe after `<|python_tag|>`."""

    name, markers, key, glue = "llama3", (PYTHON_TAG, "parameters"), "parameters", "; "

    def call_regex(self, call: str) -> str:
        return call

    def render(self, calls: list[tuple[str, dict]]) -> str:
        return self.glue.join(self._json(name, args) for name, args in calls)

    def parse(self, text: str) -> list[tuple[str, dict]] | None:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return None
        calls = [_call(part, self.key) for part in _split_calls(body)]
        return None if not calls or None in calls else calls

    def content(self, text: str) -> str:
        return ""

    def safe_end(self, text: str) -> int:  # a call is the whole message: hold all while it may be one
        head = text.lstrip()
        maybe_call = head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
        return 0 if maybe_call else len(text)

    def complete(self, text: str) -> str:
        start = len(text) - len(text.lstrip())  # where `parse` reads the calls from
        if text.startswith(PYTHON_TAG, start):
            start = len(text) - len(text[start + len(PYTHON_TAG) :].lstrip())
        return text[: start + _json_objects(text[start:])[1]]


HERMES, LLAMA3 = Hermes(), Llama3()
FORMATS = (HERMES, LLAMA3)  # looked for in this order; the first is the default


class ToolError(Exception):
    """A tools request that cannot be served: `field` is the request's name for what is wrong."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def format_of(template: str | None) -> ToolFormat:
    """The tool-call format of a model family, from its chat template's text (see the module docstring)."""
    text = template or ""
    return next((f for f in FORMATS if any(m in text for m in f.markers)), FORMATS[0])


class Tools:
    """One request's tools and tool_choice: what the template gets, the constraint, and the answer's calls."""

    def __init__(self, tools: list[Tool], choice, fmt: ToolFormat, parallel: bool = True):
        self.tools, self.fmt, self.parallel = tools, fmt, parallel
        self.names = [t.function.name for t in tools]
        self.choice = choice if choice is not None else "auto"
        if isinstance(self.choice, NamedChoice) and self.choice.function.name not in self.names:
            raise ToolError(f"tool_choice names the function {self.choice.function.name!r}, which is not in tools "
                            f"({', '.join(self.names)})", "tool_choice")  # fmt: skip
        if len(set(self.names)) != len(self.names):
            raise ToolError(f"tools has two functions named {_duplicate(self.names)!r}; names must differ", "tools")

    @property
    def active(self) -> bool:
        """Whether the answer may hold calls ("none": plain text, the tools only shown to the model)."""
        return self.choice != "none"

    def for_template(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> Structured | None:
        """The output's constraint: 1 to MAX_CALLS calls of any tool ("required"; one when not parallel), one call
        of the named one, or None ("auto", "none")."""
        if self.choice in ("auto", "none"):
            return None
        named = self.choice.function.name if isinstance(self.choice, NamedChoice) else None
        key = self.fmt.key
        calls = [
            {"type": "object", "properties": {"name": {"const": t.function.name}, key: _params(t)},
             "required": ["name", key]}
            for t in self.tools if named in (None, t.function.name)
        ]  # fmt: skip
        try:
            call = schema_regex(calls[0] if len(calls) == 1 else {"anyOf": calls})
        except SamplingError as e:
            raise ToolError(f"tools: a function's parameters cannot be enforced: {e}", "tools") from None
        one, glue = self.fmt.call_regex(call), self.fmt.glue
        most = MAX_CALLS if named is None and self.parallel else 1
        return Structured(regex=one if most == 1 else f"({one})({re.escape(glue)}({one})){{0,{most - 1}}}")

    def answer(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The chat message for generated `text`, and the finish reason: "tool_calls" when it holds calls and
        ended by itself; an answer cut short ("length") keeps the calls it completed, and says "length"."""
        if not self.active or finish not in ("stop", "length"):
            return {"role": "assistant", "content": text}, finish
        body = text if finish == "stop" else self.fmt.complete(text)
        calls = self.parse(body)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": self.fmt.content(body) or None, "tool_calls": calls}
        return message, "tool_calls" if finish == "stop" else finish

    def parse(self, text: str) -> list[dict] | None:
        """The calls in `text` (OpenAI's shape), None when it holds none or does not parse whole."""
        found = self.fmt.parse(text)
        if not found or any(name not in self.names for name, _ in found):
            return None
        if not self.parallel:  # "auto" is not constrained: a model may write several; the first is the answer
            found = found[:1]
        return [
            {"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in found
        ]  # fmt: skip

    def streamer(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """A streamed choice's text with calls held back: text goes out until a call may have started (the format's
    `safe_end`: Hermes from "<tool_call>", or a prefix of it at the end; Llama 3: a message that starts with
    "{"), then waits for the end."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.sent = tools, "", 0

    def feed(self, delta: str) -> str:
        """The part of the text so far that can go out now."""
        self.text += delta
        safe = self._safe_end()
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out

    def end(self, finish: str | None) -> tuple[str, list[dict] | None, str | None]:
        """(the text still held, the calls or None, the finish reason) once the output ended."""
        message, finish = self.tools.answer(self.text, finish)
        if "tool_calls" in message:
            return "", message["tool_calls"], finish
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest, None, finish

    def _safe_end(self) -> int:
        return self.tools.fmt.safe_end(self.text) if self.tools.active else len(self.text)


def tools_of(tools: list[Tool] | None, choice, template: str | None, parallel: bool | None = None) -> Tools | None:
    """The request's Tools (None without tools); ToolError for tool_choice without tools, or a bad one.
    parallel: the request's parallel_tool_calls (None: true, as OpenAI)."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools (the functions the model may call)", "tool_choice")
        return None
    return Tools(tools, choice, format_of(template), parallel is not False)


def message_for_template(message: dict, tool_calls: list | None, tool_call_id: str | None) -> dict:
    """A chat message as transformers' templates read it: an assistant's calls with their arguments as objects
    (templates write them with `tojson`), a tool's answer with its call's id."""
    if tool_calls is not None:
        message["tool_calls"] = [_call_for_template(c) for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _call_for_template(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):  # else kept as text: the template shows what was sent
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def _params(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


def _split_calls(body: str) -> list[str]:
    """Llama 3's calls joined by ";" (a ";" inside a JSON string stays: split only where JSON objects end)."""
    parts, end = _json_objects(body)
    return parts if parts and not body[end:].strip(_SEPARATORS) else [body]  # else not JSON: `_call` says so


_SEPARATORS = "; \n\t"


def _json_objects(body: str) -> tuple[list[str], int]:
    """The JSON values `body` starts with, joined by ";" or spaces, and where the last whole one ends."""
    decoder, parts, at, end = json.JSONDecoder(), [], 0, 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            break
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in _SEPARATORS:
            at += 1
    return parts, end


def _call(body: str, key: str) -> tuple[str, dict] | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get(key, data.get("arguments", data.get("parameters", {})))
    return (data["name"], args) if isinstance(args, dict) else None


def _duplicate(names: list[str]) -> str:
    return next(n for i, n in enumerate(names) if n in names[:i])
