"""Chat requests' prompts: the model's chat template (`ChatTemplate`, in jinja2's sandbox), and the request's
messages validated and shaped as templates read them (`messages`, `template_message`).
"""

from __future__ import annotations

from typing import Annotated

import jinja2
import jinja2.sandbox
from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError

from jaxgen.chat_template import TemplateRefused, compile_template
from jaxgen.inference.sampling import check_text, shown
from jaxgen.serving.errors import APIError
from jaxgen.serving.protocol import Message
from jaxgen.serving.tools import message_for_template

PLAIN_CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
_MESSAGES = TypeAdapter(Annotated[list[Message], Field(min_length=1)])


class ChatTemplate:
    """The chat template in jinja2's immutable sandbox (as transformers renders it): a template from a
    model folder can format messages but cannot reach Python's internals (no code runs). A template that
    does not compile leaves `error` set: the server starts, completions work, chat requests get 500."""

    def __init__(self, source: str | None):
        self.template, self.error, self.source = None, None, source
        try:
            self.template = compile_template(source or PLAIN_CHAT)
        except jinja2.TemplateSyntaxError as e:
            self.error = f"the model's chat template does not compile: {e} (line {e.lineno})"

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt; `tools` (OpenAI's tool dicts) as transformers passes them, only when the request has some."""
        if self.error:
            raise APIError(500, self.error, kind="server_error")
        extra = {"tools": tools} if tools else {}
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **extra)
        except TemplateRefused as e:
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
        except jinja2.sandbox.SecurityError as e:
            raise APIError(500, f"the model's chat template tried something unsafe and was stopped: {e}",
                           kind="server_error") from None  # fmt: skip
        except Exception as e:  # an undefined variable, a type error: the template's fault, not the messages'
            raise APIError(500, f"the model's chat template failed: {type(e).__name__}: {shown(str(e))}",
                           kind="server_error") from None  # fmt: skip


def messages(raw) -> list[Message]:
    """The chat request's messages, validated (off the event loop); errors as any other field's."""
    try:
        return _MESSAGES.validate_python(raw)
    except ValidationError as e:
        errors = [{**x, "loc": ("body", "messages", *x["loc"])} for x in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def template_message(i: int, m: Message) -> dict:
    """Message `i` as the template sees it: checked text; content parts joined (text parts only, as vLLM)."""
    check_text(f"messages.{i}.role", m.role)
    content = m.content
    if content is None and m.tool_calls is None:
        raise APIError(400, f"messages.{i}.content is missing (only an assistant's tool_calls message may omit it)",
                       f"messages.{i}.content")  # fmt: skip
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                field = f"messages.{i}.content.{j}"
                raise APIError(400, f"{field} is {shown(part)}: only text parts "
                               '({"type": "text", "text": ...}) are supported', field)  # fmt: skip
            texts.append(part["text"])
        content = "\n".join(texts)
    if content is not None:
        check_text(f"messages.{i}.content", content)
    message = {"role": m.role, "content": content} | ({"name": m.name} if m.name is not None else {})
    return message_for_template(message, m.tool_calls, m.tool_call_id)
