"""Chat templates in jinja2's immutable sandbox, as transformers renders them: the one environment that
the server's prompts (`jaxgen.serving.chat`) and chat SFT data (`jaxgen.training.data.chat`) share.

A template from a model folder can format messages but cannot reach Python's internals (no code runs).
`raise_exception(message)` refuses a conversation (TemplateRefused); `tojson` is transformers' filter;
`{% generation %} ... {% endgeneration %}` (transformers' marks around what the assistant writes)
renders its body unchanged; loops take `{% break %}` and `{% continue %}`.
"""

from __future__ import annotations

import json
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox


class TemplateRefused(jinja2.TemplateError):
    """raise_exception() in a template: it refuses these messages (the messages' fault, not the template's)."""


def _raise_exception(message):
    raise TemplateRefused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as transformers' templates get it (tools are written with it: `{{ tool | tojson }}`); jinja2's
    own filter escapes <, >, & and ' for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, as is. Templates written for transformers'
    `return_assistant_tokens_mask` carry these tags; without the extension they would not compile."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def sandbox() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A fresh environment with transformers' settings (trim_blocks, lstrip_blocks) and helpers."""
    extensions = [_Generation, jinja2.ext.loopcontrols]  # transformers' too: {% break %}, {% continue %}
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in `sandbox()`; jinja2.TemplateSyntaxError when it does not compile."""
    return sandbox().from_string(source)
