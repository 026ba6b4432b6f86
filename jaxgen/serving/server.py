"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

    python serve.py http --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template, rendered in
jinja2's sandbox, or a plain "role: content" layout when it has none), GET /v1/models, GET /health,
GET /metrics (the engine's statistics in the Prometheus format, `jaxgen.inference.stats`).
Request fields: max_tokens, temperature, top_p, top_k, min_p, seed, n, stop, logprobs, echo, stream
(server-sent events), presence_penalty, frequency_penalty, repetition_penalty, logit_bias, and
ignore_eos (an extension, as in vLLM). Every field is checked by `jaxgen.inference.sampling` (the same bounds
and messages as the Python API and the batch job); every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.

What a public endpoint needs (ServeConfig): a body limit (413 before parsing), a queue limit (429
with Retry-After), an optional per-request timeout, tokenization off the event loop, and on SIGTERM
a drain that admits nothing new and ends every stream with a final event and [DONE]. A request that
fails fails alone; a client that goes away (streaming or not) cancels its sequences.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from typing import Any

import jinja2
import jinja2.sandbox
import prometheus_client
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from jaxgen.config import ServeConfig
from jaxgen.inference.decode import encode_prompt
from jaxgen.inference.engine import Engine, EngineClosed
from jaxgen.inference.engine import Request as Sequence
from jaxgen.inference.pages import PageError
from jaxgen.inference.sampling import SamplingConfig, SamplingError, check_text, shown
from jaxgen.inference.textstream import TextDeltas

PLAIN_CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class _Common(BaseModel):
    """Types only: every bound is checked once, by SamplingConfig (see `_sampling`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # {token id (as a string, JSON's keys): bias in [-100, 100]}
    ignore_eos: bool = False  # an extension (as in vLLM): generate max_tokens whatever the model says
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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


def _from_engine_error(e: Exception) -> APIError:
    """The API error for an exception from validation or the engine's submit."""
    if isinstance(e, SamplingError):
        return APIError(400, str(e), e.field)
    if isinstance(e, PageError):
        return APIError(400, str(e), "max_tokens")
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), kind="service_unavailable")
    raise e


def create_app(engine: Engine, model_name: str, api_key: str | None = None, serve: ServeConfig | None = None):
    """The ASGI app: FastAPI routes wrapped in the body limit. `serve` defaults to the engine's config."""
    serve = serve or engine.serve
    app = FastAPI(title="jaxgen", description="OpenAI-compatible text generation with jaxgen")
    created = int(time.time())
    chat_template = _sandboxed_template(engine.tokenizer.chat_template or PLAIN_CHAT)
    longest_token = max(len(t) for t in engine.tokenizer.tok.get_vocab())  # chars one token covers, at most

    async def check_key(request: Request):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

    _error_handlers(app)

    @app.get("/health")
    async def health():
        if not engine.running:
            return JSONResponse({"status": "unavailable: the engine is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        data = [{"id": model_name, "object": "model", "created": created, "owned_by": "jaxgen"}]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus(engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def tokens_of(text: str, field: str) -> list[int]:
        check_text(field, text)
        if len(text) > longest_token * engine.cfg.max_seq_len:  # too long whatever it tokenizes to
            raise APIError(400, f"{field} has {len(text)} characters, far more than the model's context of "
                           f"{engine.cfg.max_seq_len} tokens can hold", field)  # fmt: skip
        return await asyncio.to_thread(encode_prompt, engine.tokenizer, text, engine.cfg, field)

    def check_model(name: str | None):
        if name is not None and name != model_name:
            raise APIError(404, f"the model {shown(name)} does not exist; this server serves {model_name!r}",
                           "model", code="model_not_found")  # fmt: skip

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported (got a list of several)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await tokens_of(prompt, "prompt")
        else:
            ids = encode_prompt(engine.tokenizer, prompt, engine.cfg)
        sampling = _sampling(body, body.max_tokens, body.logprobs or 0)
        prefix = engine.tokenizer.decode(ids) if body.echo else ""
        job = _Job(engine, serve, ids, sampling, body, "text_completion", model_name, prefix, body.logprobs is not None)
        return await job.respond(request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: ChatRequest, request: Request):
        check_model(body.model)
        for i, m in enumerate(body.messages):
            check_text(f"messages.{i}.role", m.role)
            check_text(f"messages.{i}.content", m.content)
        text = _render_chat(chat_template, [m.model_dump() for m in body.messages])
        ids = await tokens_of(text, "messages")
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if field == "max_completion_tokens" else body.max_tokens
        sampling = _sampling(body, 256 if max_tokens is None else max_tokens, top, field)
        job = _Job(engine, serve, ids, sampling, body, "chat.completion", model_name, "", body.logprobs)
        return await job.respond(request)

    return BodyLimit(app, serve.max_body_bytes)


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: validation (malformed JSON included), HTTP errors, our own, the rest."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", first["msg"])
            return APIError(400, f"the body is not valid JSON: {shown(detail)}", code="json_invalid").response()
        field = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"invalid field {field!r}: {first['msg']} (got {shown(first.get('input'))})"
        return APIError(400, message, field).response()

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(SamplingError)
    async def sampling_error(_, exc: SamplingError):
        return _from_engine_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def server_error(_, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", kind="server_error").response()


def _sandboxed_template(source: str) -> jinja2.Template:
    """The chat template in jinja2's immutable sandbox (as transformers renders it): a template from a
    model folder can format messages but cannot reach Python's internals (no code runs)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):  # templates call this to refuse a conversation
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _render_chat(template: jinja2.Template, messages: list[dict]) -> str:
    try:
        return template.render(messages=messages, add_generation_prompt=True)
    except jinja2.sandbox.SecurityError as e:
        raise APIError(500, f"the model's chat template tried something unsafe and was stopped: {e}",
                       kind="server_error") from None  # fmt: skip
    except jinja2.TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None


def _sampling(body: _Common, max_tokens: int, logprobs: int, max_field: str = "max_tokens") -> SamplingConfig:
    """The request's SamplingConfig: the one validation (bounds and messages) every door shares."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    data = dict(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=seed, n=body.n, stop=stop, logprobs=logprobs, logit_bias=body.logit_bias or {},
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
    )  # fmt: skip
    try:
        return SamplingConfig.from_dict(data)
    except SamplingError as e:
        if e.field == "max_new_tokens":  # the API's name for it
            raise APIError(400, str(e).replace("max_new_tokens", max_field, 1), max_field) from None
        raise


class _Job:
    """One request's sequences in the engine, answered whole or as a stream."""

    def __init__(self, engine, serve, ids, sampling, body, kind, model_name, prefix, want_logprobs):
        self.engine, self.serve, self.ids, self.sampling, self.body = engine, serve, ids, sampling, body
        self.kind, self.model_name, self.prefix, self.want_logprobs = kind, model_name, prefix, want_logprobs
        self.rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.updates: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []

    async def respond(self, request: Request):
        if self.engine.queue_length() >= self.serve.max_queue:
            raise APIError(429, f"the server is busy: {self.engine.queue_length()} requests are queued "
                           f"(serve.max_queue={self.serve.max_queue}); retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"})  # fmt: skip
        loop = asyncio.get_running_loop()

        def on_update(seq: Sequence):  # engine thread -> event loop: a snapshot, not the live object
            snap = _Snapshot(seq.sample_index, seq.text, list(seq.tokens), list(seq.logprobs),
                             list(seq.top_logprobs), seq.finish_reason, seq.error)  # fmt: skip
            loop.call_soon_threadsafe(self.updates.put_nowait, snap)

        try:
            self.seqs = self.engine.submit(self.ids, self.sampling, on_update=on_update)
        except (SamplingError, PageError, EngineClosed) as e:
            raise _from_engine_error(e) from None
        if self.body.stream:
            return StreamingResponse(self._stream(request), media_type="text/event-stream")
        try:
            return await self._whole(request)
        finally:
            self._cancel_unfinished()

    def _cancel_unfinished(self) -> None:
        for s in self.seqs:
            if not s.done_event.is_set():
                self.engine.cancel(s)

    async def _next_update(self, request: Request, deadline: float | None):
        """The next snapshot; None after a quiet 0.25 s. Raises _Gone when the client left, TimeoutError past
        the deadline: both checked after every wait, not only quiet ones, or a request whose tokens keep
        coming (a chunk every < 0.25 s) would run to max_tokens after its client left or its time was up."""
        try:
            snap = await asyncio.wait_for(self.updates.get(), timeout=0.25)
        except asyncio.TimeoutError:
            snap = None
        if await request.is_disconnected():
            raise _Gone()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        return snap

    def _deadline(self) -> float | None:
        t = self.serve.request_timeout_s
        return time.monotonic() + t if t > 0 else None

    def _timeout_error(self) -> APIError:
        t = self.serve.request_timeout_s
        return APIError(408, f"the request took longer than serve.request_timeout_s={t:g} s and was cancelled",
                        kind="timeout_error")  # fmt: skip

    async def _whole(self, request: Request):
        deadline = self._deadline()
        try:
            while not all(s.done_event.is_set() for s in self.seqs):
                await self._next_update(request, deadline)
        except _Gone:
            return JSONResponse({}, status_code=499)
        except TimeoutError:
            return self._timeout_error().response()
        failed = next((s for s in self.seqs if s.finish_reason in ("error", "cancelled")), None)
        if failed is not None:
            return _ended_error(failed.error or "the request was cancelled").response()
        choices = [self._choice(s) for s in self.seqs]
        completion_tokens = sum(len(s.tokens) for s in self.seqs)
        usage = {"prompt_tokens": len(self.ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(self.ids) + completion_tokens}  # fmt: skip
        return {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage}  # fmt: skip

    def _choice(self, s: Sequence) -> dict:
        logprobs = None
        if self.kind == "chat.completion":
            if self.want_logprobs:
                logprobs = _chat_logprobs(self.engine, s.tokens, s.logprobs, s.top_logprobs)
            message = {"role": "assistant", "content": s.text}
            return {"index": s.sample_index, "message": message, "finish_reason": s.finish_reason, "logprobs": logprobs}
        if self.want_logprobs:
            logprobs = _completion_logprobs(self.engine, s.tokens, s.logprobs, s.top_logprobs, len(self.prefix))
        text = self.prefix + s.text
        return {"index": s.sample_index, "text": text, "finish_reason": s.finish_reason, "logprobs": logprobs}

    async def _stream(self, request: Request):
        """Server-sent events: exact text deltas (with their tokens' logprobs) per sequence, a final event
        for each, then [DONE], however the request ends (an error event first when it failed)."""
        hold = max((len(x) for x in self.sampling.stop), default=1) - 1  # a stop string may be half-decoded
        streams = {s.sample_index: TextDeltas(self.engine.tokenizer, hold) for s in self.seqs}
        offsets = dict.fromkeys(streams, len(self.prefix))
        finished: set[int] = set()
        deadline = self._deadline()
        try:
            for s in self.seqs:
                yield self._event(s.sample_index, self.prefix, None, None, first=True)
            while len(finished) < len(self.seqs):
                try:
                    snap = await self._next_update(request, deadline)
                except TimeoutError:
                    yield _sse(self._timeout_error().body())
                    break
                if snap is None:
                    if all(s.done_event.is_set() for s in self.seqs) and self.updates.empty():
                        break  # every end was reported (a safety net: never wait on a queue nobody fills)
                    continue
                if snap.index in finished:
                    continue
                if snap.finish in ("error", "cancelled"):
                    yield _sse(_ended_error(snap.error or "the request was cancelled").body())
                    break
                final = bool(snap.finish)
                delta = streams[snap.index].update(snap.text, final)
                start, end = streams[snap.index].new_tokens(snap.tokens, final)
                logprobs, offsets[snap.index] = self._stream_logprobs(snap, start, end, offsets[snap.index])
                if delta or final or end > start:
                    yield self._event(snap.index, delta, snap.finish or None, logprobs)
                if final:
                    finished.add(snap.index)
            yield "data: [DONE]\n\n"
        except _Gone:
            return
        finally:
            self._cancel_unfinished()

    def _stream_logprobs(self, snap, start: int, end: int, offset: int):
        if not self.want_logprobs or end <= start:
            return None, offset
        toks, lps, tops = snap.tokens[start:end], snap.logprobs[start:end], snap.top_logprobs[start:end]
        if self.kind == "chat.completion":
            return _chat_logprobs(self.engine, toks, lps, tops), offset
        out = _completion_logprobs(self.engine, toks, lps, tops, offset)
        return out, offset + sum(len(t) for t in out["tokens"])

    def _event(self, index: int, text: str, finish: str | None, logprobs, first: bool = False) -> str:
        if self.kind == "chat.completion":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
            kind = "text_completion"
        return _sse({"id": self.rid, "object": kind, "created": self.created, "model": self.model_name,
                     "choices": [choice]})  # fmt: skip


class _Snapshot:
    __slots__ = ("error", "finish", "index", "logprobs", "text", "tokens", "top_logprobs")

    def __init__(self, index, text, tokens, logprobs, top_logprobs, finish, error):
        self.index, self.text, self.tokens, self.logprobs = index, text, tokens, logprobs
        self.top_logprobs, self.finish, self.error = top_logprobs, finish, error


class _Gone(Exception):
    """The client disconnected."""


def _ended_error(message: str) -> APIError:
    """A request that ended without a completion: shutting down (503) or failed in the engine (500)."""
    if "shutting down" in message:
        return APIError(503, message, kind="service_unavailable")
    return APIError(500, message, kind="server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _completion_logprobs(engine, tokens, logprobs, top_logprobs, offset: int) -> dict:
    strings = [engine.tokenizer.decode([t]) for t in tokens]
    offsets = []
    for t in strings:
        offsets.append(offset)
        offset += len(t)
    top = [_by_string(engine, alts) for alts in top_logprobs] if top_logprobs else None
    return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def _by_string(engine, alts: dict[int, float]) -> dict[str, float]:
    """{token text: logprob}, the format's keys; two ids with the same text (e.g. partial UTF-8 bytes,
    both shown as U+FFFD) keep apart under the vocabulary's own token names."""
    out: dict[str, float] = {}
    for i, lp in alts.items():
        text = engine.tokenizer.decode([i])
        out[text if text not in out else engine.tokenizer.tok.id_to_token(i)] = lp
    return out


def _chat_logprobs(engine, tokens, logprobs, top_logprobs) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        alts = top_logprobs[i] if top_logprobs else {}
        top = [{"token": engine.tokenizer.decode([a]), "logprob": v, "bytes": None} for a, v in alts.items()]
        content.append({"token": engine.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": top})
    return {"content": content}


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


def prometheus(engine: Engine) -> bytes:
    """The engine's statistics in the Prometheus text format: counters, gauges and histograms, all
    prefixed jaxgen_ (`jaxgen.inference.stats`)."""
    return prometheus_client.generate_latest(engine.stats.registry)


def serve_forever(engine: Engine, app, host: str, port: int, grace_s: float = 10.0, log_level: str = "info") -> None:
    """Runs uvicorn on `app` with the engine started. SIGTERM or Ctrl-C drains first: nothing new is
    admitted, running sequences get `grace_s` seconds, then every stream ends (final event, [DONE])."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    exit_once = server.handle_exit

    def handle_exit(sig, frame):  # in the main thread: drain in another, then let uvicorn stop
        def drain_then_exit():
            engine.drain(grace_s)
            exit_once(sig, frame)

        threading.Thread(target=drain_then_exit, name="jaxgen-drain", daemon=True).start()

    server.handle_exit = handle_exit
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()
