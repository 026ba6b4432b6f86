"""The HTTP server's errors, all in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and
the two gates in front of the routes: the API key (401 before anything else) and the body limit (413
before anything parses a request)."""

from __future__ import annotations

import re
import secrets

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jaxgen.inference.adapters import LoraError, LoraNotFound
from jaxgen.inference.engine import EngineClosed
from jaxgen.inference.pages import PageError
from jaxgen.inference.sampling import SamplingError, shown


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.kind, self.code, self.headers = status, param, kind, code, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error_for(e: Exception, max_field: str = "max_tokens") -> APIError:
    """The API error for an exception from validation or the engine's submit. `max_field`: the request's name
    for the engine's max_new_tokens (max_tokens, or max_completion_tokens in chat)."""
    if isinstance(e, PageError):  # (a SamplingError too)
        return APIError(400, str(e).replace("max_new_tokens", max_field), max_field)
    if isinstance(e, SamplingError):
        return APIError(400, str(e), e.field)
    if isinstance(e, LoraNotFound):  # a request's model names no loaded adapter
        return APIError(404, str(e), e.field, kind="not_found_error", code="model_not_found")
    if isinstance(e, LoraError):
        return APIError(400, str(e), e.field)
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), kind="service_unavailable")
    raise e


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: validation (malformed JSON included), HTTP errors, our own, the rest."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", first["msg"])
            return APIError(400, f"the body is not valid JSON: {shown(detail)}", code="json_invalid").response()
        field, tag = _field_of(first["loc"])
        if tag is None:
            message = f"invalid field {field!r}: {first['msg']} (got {shown(first.get('input'))})"
        else:  # a union (prompt: text or ids): each of its types refused the value; name them all
            tags = dict.fromkeys(t for f, t in map(_field_of, (e["loc"] for e in exc.errors())) if f == field and t)
            got = first["input"] if first["loc"][-1] == tag else "?"
            message = f"invalid field {field!r}: not any of the allowed types {', '.join(tags)} (got {shown(got)})"
        return APIError(400, message, field).response()

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(LoraError)
    async def lora_error(_, exc: LoraError):
        return api_error_for(exc).response()

    @app.exception_handler(SamplingError)
    async def sampling_error(_, exc: SamplingError):
        return api_error_for(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def server_error(_, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", kind="server_error").response()


# how pydantic names a union's members: types, literals, models (CamelCase: no request field is named so)
_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\]|literal\[.*\]|[A-Z]\w*)")


def _field_of(loc) -> tuple[str | None, str | None]:
    """A validation error's field ("messages.0.content") and the union member it was tried as, if any."""
    parts = [str(p) for p in loc if p != "body"]
    i = next((i for i, p in enumerate(parts) if _UNION_TAG.fullmatch(p)), None)
    if i is None:
        return ".".join(parts) or None, None
    return ".".join(parts[:i]) or None, parts[i]


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before anything parses it. The body
    is read here and replayed; later `receive` calls pass through, so disconnects are still seen."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def __getattr__(self, name):  # the wrapped FastAPI app's attributes (routes, state, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending the body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send):
        error = APIError(413, f"the request body is larger than serve.max_body_bytes={self.limit}")
        await error.response()(scope, receive, send)


class ApiKey:
    """ASGI middleware: with a key set, every path but `public` needs `Authorization: Bearer KEY` (the scheme
    in any case, RFC 7235), checked before the body is read or validated: 401 comes before 400 or 413."""

    def __init__(self, app, key: str | None, public: frozenset[str]):
        self.app, self.key, self.public = app, key, public

    def __getattr__(self, name):  # the wrapped app's attributes (routes, state, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] in self.public or self._allowed(scope):
            return await self.app(scope, receive, send)
        error = APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
        await error.response()(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key.encode())
