"""What a constrained row may write (`Structured`: one of KINDS), and the regular expression of it: a JSON
schema's (outlines-core's, with integer bounds written in), a choice's, a grammar's (`grammar.py`) or the
given one. The kind list is the dataclass's fields, read once (`KINDS`): a door that accepts constraints
derives its fields from it.

    Structured(json=schema) | Structured(regex=r"\\d{4}") | Structured(choice=("yes", "no"))
    Structured(grammar='start: NUMBER ("+" NUMBER)*  ...')  (Lark, or GBNF `root ::= ...`: grammar.py)
    Structured.from_dict({"json_object": True})             vLLM's `structured_outputs` shape
    structured.pattern() -> str                              the whole output's regular expression

outlines-core ignores integer bounds; `_with_integer_ranges` writes them. A schema's properties are written in
its declared order (as OpenAI's structured outputs: a "reasoning" field before the "answer"). Schema patterns and
formats, and regex constraints, read `\\d`, `\\w`, `\\s` and `.` as ECMA-262 does (`ecma.py`: `\\d` is [0-9]).
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from jaxgen.inference.errors import SamplingError, shown
from jaxgen.inference.structured.ecma import ecma_regex
from jaxgen.inference.structured.grammar import MAX_PATTERN

MAX_TEXT = 100_000  # characters of a schema, a regular expression or all choices together
MAX_CHOICES = 1024
RECURSION_DEPTH = 2  # how deep recursive schemas ($ref to themselves) are unrolled
FIELD = "structured"

# JSON-schema keywords outlines-core turns into the regular expression, and those that only annotate
SUPPORTED = {
    "type", "properties", "required", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "additionalProperties", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
}  # fmt: skip
_SCHEMA_VALUED = {"items", "additionalProperties"}  # keywords whose value is a schema
_SCHEMA_MAPS = {"properties", "$defs", "definitions"}  # name -> schema
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCALARS = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
# OpenAI's response_format {"type": "json_object"}: any object whose values are scalars, or arrays and objects of
# scalars. outlines-core's own free-form object nests three levels deep: 1623 states, 7 s to compile; this: 399, 0.2 s
JSON_OBJECT = {
    "type": "object",
    "additionalProperties": {"anyOf": [*_SCALARS, {"type": "array", "items": {"anyOf": _SCALARS}},
                                       {"type": "object", "additionalProperties": {"anyOf": _SCALARS}}]},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a constrained row may write: exactly one of `json` (a JSON schema, kept as JSON text in its
    declared key order, which the output follows), `regex` (the whole output matches it; ECMA-262's classes),
    `choice` (the output is one of the strings) or `grammar` (a Lark or GBNF context-free grammar, its
    recursion unrolled `grammar.DEPTH` levels: see grammar.py). Its fields are the kinds (`KINDS`): a new kind
    is a field here, its check in `__post_init__` and its `pattern`."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingError(f"{FIELD} takes exactly one of {', '.join(KINDS)}; got {given or 'none'}", FIELD)
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict | bool):  # a schema given as an object: kept as text, keys in its order
            object.__setattr__(self, "json", json.dumps(self.json))
        kind = given[0]
        value = getattr(self, kind)
        if kind == "choice":
            ok = isinstance(value, tuple) and 0 < len(value) <= MAX_CHOICES
            if not (ok and all(isinstance(c, str) and c for c in value)):
                allowed = f"1 to {MAX_CHOICES} non-empty strings"
                raise SamplingError(f"{FIELD}.choice={shown(value)} is not allowed: {allowed}", FIELD)
            size = sum(len(c) for c in value)
        else:
            if not isinstance(value, str):
                raise SamplingError(f"{FIELD}.{kind}={shown(value)} is not allowed: a string", FIELD)
            size = len(value)
        if size > MAX_TEXT:
            raise SamplingError(f"{FIELD}.{kind} has {size} characters; at most {MAX_TEXT}", FIELD)

    @classmethod
    def from_dict(cls, data) -> Structured:
        """From JSON: {"json": schema (object or text)}, {"json_object": true}, {"regex": ...}, {"choice": [...]},
        {"grammar": ...} (vLLM's `structured_outputs` shape)."""
        if isinstance(data, Structured):
            return data
        if not isinstance(data, dict):
            raise SamplingError(f'{FIELD}={shown(data)} is not allowed: an object such as {{"json": schema}}', FIELD)
        data = dict(data)
        if data.pop("json_object", False):
            data.setdefault("json", JSON_OBJECT)
        unknown = sorted(set(data) - set(KINDS))
        if unknown:
            allowed = ", ".join(KINDS).replace("json", "json, json_object", 1)  # json_object: a json shorthand
            raise SamplingError(f"unknown {FIELD} field {unknown[0]!r}; allowed: {allowed}", FIELD)
        if isinstance(data.get("json"), str):
            data["json"] = _parse_schema(data["json"])
        return cls(**data)

    def source(self) -> tuple[str, str]:
        """What the compile worker gets: ("grammar", the grammar's text) or ("regex", `pattern()`)."""
        return ("grammar", self.grammar) if self.grammar is not None else ("regex", self.pattern())

    def pattern(self) -> str:
        """The regular expression of the whole output (a grammar's: its recursion unrolled, `grammar.py`)."""
        if self.grammar is not None:
            from jaxgen.inference.structured import grammar

            try:
                return grammar.grammar_regex(self.grammar)
            except grammar.GrammarError as e:
                raise SamplingError(f"{FIELD}.grammar: {e}", FIELD) from None
        if self.regex is not None:
            _check_regex(self.regex)
            return ecma_regex(self.regex)
        if self.choice is not None:
            return "|".join(f"({re.escape(c)})" for c in self.choice)
        return schema_regex(json.loads(self.json))


KINDS = tuple(f.name for f in dataclasses.fields(Structured))  # ("json", "regex", "choice", "grammar")


def _parse_schema(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SamplingError(f"{FIELD}.json is not JSON: {e}", FIELD) from None


def _check_regex(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise SamplingError(f"{FIELD}.regex {shown(pattern)} does not compile: {e}", FIELD) from None


def schema_regex(schema) -> str:
    """The regular expression of the JSON texts that satisfy `schema` (outlines-core's, with integer bounds
    written in). SamplingError naming an unsupported keyword, or what outlines-core said."""
    from outlines_core.json_schema import build_regex_from_schema

    if not isinstance(schema, dict | bool):
        raise SamplingError(f"{FIELD}.json={shown(schema)} is not allowed: a JSON schema (an object)", FIELD)
    ranges: dict[str, str] = {}
    schema = _with_integer_ranges(schema, ranges, "#")
    try:
        pattern = build_regex_from_schema(json.dumps(schema), max_recursion_depth=RECURSION_DEPTH)
    except Exception as e:  # outlines-core raises its own error types for schemas it cannot express
        raise SamplingError(f"{FIELD}.json: the schema cannot be compiled: {e}", FIELD) from None
    if len(pattern) > MAX_PATTERN:  # (optional properties grow it as their square; 780,000 characters took 23 s)
        raise SamplingError(f"{FIELD}.json: the schema's regular expression has {len(pattern)} characters; at most "
                            f"{MAX_PATTERN} (make properties required, or fewer)", FIELD)  # fmt: skip
    pattern = _fixed_formats(ecma_regex(pattern, json_string=True))  # `pattern` and `format` as ECMA-262 reads them
    for placeholder, rx in ranges.items():
        pattern = pattern.replace(f'"{placeholder}"', f"({rx})")
    return pattern


# outlines-core 0.2's `format: time` writes its fraction as a backslash and any character (invalid JSON)
_TIME_FRACTION = (ecma_regex(r"(\\.[0-9]+)?(Z)?", json_string=True), r"(\.[0-9]+)?(Z)?")


def _fixed_formats(pattern: str) -> str:
    return pattern.replace(*_TIME_FRACTION)


def _with_integer_ranges(node, ranges: dict, path: str):
    """A copy of schema `node` with every bounded integer replaced by a placeholder constant (filled in with
    its range's regular expression after outlines-core); SamplingError for a keyword it cannot honour."""
    if not isinstance(node, dict):
        return node
    for key in node:
        if key not in SUPPORTED:
            raise SamplingError(f"{FIELD}.json: the keyword {key!r} at {path} is not supported; supported: "
                                f"{', '.join(sorted(SUPPORTED))}", FIELD)  # fmt: skip
    bounds = {k: node[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node}
    if bounds:
        if node.get("type") != "integer":
            raise SamplingError(f"{FIELD}.json: bounds ({', '.join(bounds)}) at {path} are supported on integers "
                                f"only, not on type {node.get('type')!r}", FIELD)  # fmt: skip
        placeholder = f"JAXGENRANGE{len(ranges)}X"
        ranges[placeholder] = integer_regex(*_integer_bounds(bounds, path))
        return {"const": placeholder}
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_VALUED and isinstance(value, dict):
            value = _with_integer_ranges(value, ranges, f"{path}/{key}")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {k: _with_integer_ranges(v, ranges, f"{path}/{key}/{k}") for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_with_integer_ranges(v, ranges, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        out[key] = value
    return out


def _integer_bounds(bounds: dict, path: str) -> tuple[int | None, int | None]:
    lo = hi = None
    for key, value in bounds.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
            raise SamplingError(f"{FIELD}.json: {key}={shown(value)} at {path} is not allowed: a number", FIELD)
    if "minimum" in bounds:
        lo = int(np.ceil(bounds["minimum"]))
    if "exclusiveMinimum" in bounds:
        lo = max(lo if lo is not None else -(2**63), int(np.floor(bounds["exclusiveMinimum"])) + 1)
    if "maximum" in bounds:
        hi = int(np.floor(bounds["maximum"]))
    if "exclusiveMaximum" in bounds:
        hi = min(hi if hi is not None else 2**63, int(np.ceil(bounds["exclusiveMaximum"])) - 1)
    if lo is not None and hi is not None and lo > hi:
        raise SamplingError(f"{FIELD}.json: no integer lies in the bounds at {path} ({bounds})", FIELD)
    return lo, hi


def integer_regex(lo: int | None, hi: int | None) -> str:
    """A regular expression of the integers in [lo, hi] as JSON writes them (None: unbounded)."""
    parts = []
    if lo is None or lo < 0:  # the negatives, as "-" and their absolute values
        top = None if lo is None else -lo
        bottom = 1 if hi is None or hi >= 0 else -hi
        parts.append(f"-({_natural_regex(bottom, top)})")
    if hi is None or hi >= 0:
        start = 0 if lo is None or lo <= 0 else lo
        if start == 0:
            parts.append("0")
            start = 1
        if hi is None or hi >= start:
            parts.append(_natural_regex(start, hi))
    return "|".join(f"({p})" for p in parts)


def _natural_regex(lo: int, hi: int | None) -> str:
    """The integers in [lo, hi], lo >= 1, without leading zeros (hi None: unbounded)."""
    parts = []
    top_len = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top_len + 1):
        a, b = max(lo, 10 ** (n - 1)), (10**n - 1 if hi is None else min(hi, 10**n - 1))
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{top_len},}}")
    return "|".join(f"({p})" for p in parts)


def _same_length(lo: str, hi: str) -> str:
    """The numbers from `lo` to `hi`, written with the same number of digits."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    rest = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + f"({_same_length(lo[1:], hi[1:])})"
    parts = [lo[0] + f"({_same_length(lo[1:], '9' * rest)})"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{rest}}}")
    parts.append(hi[0] + f"({_same_length('0' * rest, hi[1:])})")
    return "|".join(f"({p})" for p in parts)
