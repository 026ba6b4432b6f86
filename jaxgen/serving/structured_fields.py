"""The structured-output fields of an HTTP request or a batch line, turned into one `Structured`.

Every door reads the same constraint (`jaxgen.inference.structured.Structured`), whatever the client sent:
    response_format      OpenAI: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}},
                         {"type": "json_object"}, or {"type": "text"} (no constraint)
    structured_outputs   vLLM: {<kind>: ...} for a kind of `structured.KINDS` (json, regex, choice, grammar),
                         or {"json_object": true}
    guided_<kind>        vLLM's older fields, still sent by clients (guided_json, guided_regex, ...)
At most one of them; an error names the field the client used (its `param`), with what structured/ said.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures

from pydantic import BaseModel

from jaxgen.inference.sampling import SamplingError, shown
from jaxgen.inference.structured import JSON_OBJECT, KINDS, Structured
from jaxgen.serving.protocol import ResponseFormat

GUIDED = {f"guided_{kind}": kind for kind in KINDS}  # vLLM's older fields, one per kind
FIELDS = ("response_format", "structured_outputs", *GUIDED)


class ConstraintError(Exception):
    """A constraint the client sent that cannot be used: `field` is the request's own name for it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def requested(body) -> tuple[Structured | None, str | None]:
    """(the constraint of a request, the field that carried it); (None, None) when free. `body` has any of
    FIELDS as attributes (a pydantic request) or keys (a dict: a batch line). ConstraintError when two are
    given, or one is malformed or refused."""
    get = body.get if isinstance(body, dict) else lambda k: getattr(body, k, None)
    given = [f for f in FIELDS if get(f) is not None]
    if len(given) > 1:
        raise ConstraintError(f"{given[0]} and {given[1]} both constrain the output; send at most one of "
                              f"{', '.join(FIELDS)}", given[1])  # fmt: skip
    if not given:
        return None, None
    field = given[0]
    try:
        return _structured(field, get(field)), field
    except SamplingError as e:
        raise ConstraintError(f"{field}: {e}", field) from None


class Compiles:
    """Compiles requests' constraints before they are queued, on a thread of its own: a hostile regex holds the
    compile worker up to its time limit, and must not hold the threads that tokenize every other request. The
    last failures are remembered, so the same bad constraint sent again is refused at once."""

    def __init__(self, automaton, remember: int = 256):
        self._automaton = automaton  # Engine.automaton: SamplingConfig -> Automaton | None (cached)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxgen-compile")
        self._failed: collections.OrderedDict[Structured, str] = collections.OrderedDict()
        self._remember = remember

    async def check(self, sampling, field: str | None) -> None:
        """ConstraintError naming `field` (the client's name for it) when `sampling.structured` cannot compile."""
        structured = sampling.structured
        if structured is None:
            return
        if structured in self._failed:
            raise ConstraintError(f"{field}: {self._failed[structured]}", field)
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._compile, sampling)
        except SamplingError as e:
            raise ConstraintError(f"{field}: {e}", field) from None

    def _compile(self, sampling) -> None:
        """On the compile thread, one constraint at a time. A failure is remembered here, before the next job
        starts: the same bad constraint sent many times at once is compiled once, not once per request (each
        held every later compile up to the time limit before issue 44)."""
        failed = self._failed.get(sampling.structured)
        if failed is not None:
            raise SamplingError(failed)
        try:
            self._automaton(sampling)
        except SamplingError as e:
            self._failed[sampling.structured] = str(e)
            while len(self._failed) > self._remember:
                self._failed.popitem(last=False)
            raise


def _structured(field: str, value) -> Structured | None:
    if field == "response_format":
        return _from_response_format(value)
    if field == "structured_outputs":
        data = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
        return Structured.from_dict(data)
    return Structured.from_dict({GUIDED[field]: value})


def _from_response_format(value) -> Structured | None:
    if isinstance(value, dict):  # a batch line: the same model checks it
        try:
            value = ResponseFormat.model_validate(value)
        except Exception as e:
            raise SamplingError(f"{shown(value)} is not an OpenAI response_format: {_first_error(e)}") from None
    if value.type == "text":
        return None
    if value.type == "json_object":
        return Structured(json=JSON_OBJECT)
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise SamplingError('type "json_schema" needs json_schema.schema (the JSON schema of the output)')
    return Structured.from_dict({"json": value.json_schema.schema_})


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return str(e)
    first = errors(include_url=False)[0]
    return f"{'.'.join(map(str, first['loc'])) or 'the object'}: {first['msg']}"
