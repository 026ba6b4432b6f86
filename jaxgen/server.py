"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

    python serve.py http --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template, or a plain
"role: content" layout when it has none), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Request fields: max_tokens, temperature, top_p, top_k, min_p, seed, n, stop, logprobs, echo, stream
(server-sent events), presence_penalty, frequency_penalty, repetition_penalty, and ignore_eos (an
extension, as in vLLM). An invalid request is a
400 whose message names the field; a client that goes away cancels its sequences, freeing their slots
and pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxgen.engine import Engine
from jaxgen.engine import Request as Sequence
from jaxgen.paged import PageError
from jaxgen.sampling import SamplingConfig, SamplingError

PLAIN_CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False  # an extension (as in vLLM): generate max_tokens whatever the model says
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxgen", description="OpenAI-compatible text generation with jaxgen")
    created = int(time.time())
    template = jinja2.Environment().from_string(engine.tokenizer.chat_template or PLAIN_CHAT)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {api_key}"):
                return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body")
        value = first.get("input")
        return _error(400, f"invalid field {field!r}: {first['msg']} (got {value!r})", field)

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return _error(400, str(exc), exc.param)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "jaxgen"}],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest("prompt: only one prompt per request is supported (got a list of several)", "prompt")
            prompt = prompt[0]
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = _sampling(body, body.max_tokens, body.logprobs or 0, engine)
        prefix = engine.tokenizer.decode(ids) if body.echo else ""
        wanted = body.logprobs is not None
        return await _respond(engine, request, ids, sampling, body, "text_completion", model_name, prefix, wanted)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            text = template.render(messages=[m.model_dump() for m in body.messages], add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise BadRequest(f"messages: the chat template failed: {e}", "messages") from None
        ids = engine.tokenizer.encode(text)
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        sampling = _sampling(body, body.max_completion_tokens or body.max_tokens or 256, top, engine)
        return await _respond(engine, request, ids, sampling, body, "chat.completion", model_name, "", body.logprobs)

    return app


def _sampling(body: _Common, max_tokens: int, logprobs: int, engine: Engine) -> SamplingConfig:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    try:
        return SamplingConfig(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=seed, n=body.n, stop=tuple(stop), logprobs=logprobs,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
        )  # fmt: skip
    except SamplingError as e:
        raise BadRequest(str(e), _field_in(str(e))) from None


def _field_in(message: str) -> str | None:
    return message.split("=", 1)[0] if "=" in message.split(" ", 1)[0] else None


async def _respond(engine, request, ids, sampling, body, kind, model_name, prefix, want_logprobs):
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()

    def on_update(seq: Sequence):  # engine thread -> event loop
        snapshot = (seq.sample_index, seq.text, list(seq.logprobs), seq.finish_reason)
        loop.call_soon_threadsafe(updates.put_nowait, snapshot)

    try:
        seqs = engine.submit(ids, sampling, on_update=on_update)
    except (SamplingError, PageError) as e:
        param = "max_tokens" if isinstance(e, PageError) else ("prompt" if "prompt" in str(e) else _field_in(str(e)))
        raise BadRequest(str(e), param) from None
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    if body.stream:
        events = _stream(engine, seqs, updates, request, rid, created, kind, model_name, prefix)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        while not all(s.done_event.is_set() for s in seqs):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(updates.get(), timeout=0.25)
            if await request.is_disconnected():
                for s in seqs:
                    engine.cancel(s)
                return JSONResponse({}, status_code=499)
    except asyncio.CancelledError:
        for s in seqs:
            engine.cancel(s)
        raise
    choices = [_choice(engine, s, kind, prefix, want_logprobs) for s in seqs]
    completion_tokens = sum(len(s.tokens) for s in seqs)
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(ids) + completion_tokens,
    }
    return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices, "usage": usage}


def _choice(engine, s: Sequence, kind: str, prefix: str, want_logprobs: bool) -> dict:
    if kind == "chat.completion":
        message = {"role": "assistant", "content": s.text}
        logprobs = _chat_logprobs(engine, s) if want_logprobs else None
        return {"index": s.sample_index, "message": message, "finish_reason": s.finish_reason, "logprobs": logprobs}
    logprobs = _completion_logprobs(engine, s, len(prefix)) if want_logprobs else None
    return {"index": s.sample_index, "text": prefix + s.text, "finish_reason": s.finish_reason, "logprobs": logprobs}


def _token_strings(engine, ids: list[int]) -> list[str]:
    return [engine.tokenizer.decode([t]) for t in ids]


def _completion_logprobs(engine, s: Sequence, offset: int) -> dict:
    strings = _token_strings(engine, s.tokens)
    offsets, pos = [], offset
    for t in strings:
        offsets.append(pos)
        pos += len(t)
    top = [_by_string(engine, alts) for alts in s.top_logprobs]
    return {"tokens": strings, "token_logprobs": s.logprobs, "top_logprobs": top, "text_offset": offsets}


def _by_string(engine, alts: dict[int, float]) -> dict[str, float]:
    """{token text: logprob}, the format's keys; two ids with the same text (e.g. partial UTF-8 bytes,
    both shown as U+FFFD) keep apart under the vocabulary's own token names."""
    out: dict[str, float] = {}
    for i, lp in alts.items():
        text = engine.tokenizer.decode([i])
        out[text if text not in out else engine.tokenizer.tok.id_to_token(i)] = lp
    return out


def _chat_logprobs(engine, s: Sequence) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
        alts = s.top_logprobs[i] if s.top_logprobs else {}
        top = [{"token": engine.tokenizer.decode([a]), "logprob": v, "bytes": None} for a, v in alts.items()]
        content.append({"token": engine.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": top})
    return {"content": content}


async def _stream(engine, seqs, updates, request, rid, created, kind, model_name, prefix):
    """Server-sent events: text deltas per sequence as chunks finish, then [DONE]."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    sent = {s.sample_index: 0 for s in seqs}
    finished: set[int] = set()
    hold = max((len(x) for x in seqs[0].sampling.stop), default=1) - 1  # a stop string may be half-decoded

    def event(index: int, text: str, finish: str | None, first: bool = False) -> str:
        if kind == "chat.completion":
            delta: dict[str, Any] = {"content": text} if text or not first else {}
            if first:
                delta = {"role": "assistant", "content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        data = {"id": rid, "object": chunk_kind, "created": created, "model": model_name, "choices": [choice]}
        return f"data: {json.dumps(data)}\n\n"

    try:
        for s in seqs:
            yield event(s.sample_index, prefix, None, first=True)
        while len(finished) < len(seqs):
            try:
                index, text, _, finish = await asyncio.wait_for(updates.get(), timeout=0.25)
            except asyncio.TimeoutError:
                index = None
            if await request.is_disconnected():  # checked on every update: a gone client stops at once
                return
            if index is None:
                continue
            if index in finished:
                continue
            upto = len(text) if finish else max(sent[index], len(text) - hold)
            if upto > sent[index] or finish:
                yield event(index, text[sent[index] : upto], finish or None)
                sent[index] = upto
            if finish:
                finished.add(index)
        yield "data: [DONE]\n\n"
    finally:
        for s in seqs:
            if not s.done_event.is_set():
                engine.cancel(s)


def prometheus(m: dict[str, float]) -> str:
    """The engine's metrics in the Prometheus text format (all gauges, prefixed jaxgen_)."""
    help_text = {
        "queue_length": "requests waiting for a slot or their prefill",
        "running_slots": "decode slots generating now",
        "slots": "decode slots in all",
        "cache_pages_in_use": "KV-cache pages referenced by sequences",
        "cache_pages_total": "KV-cache pages in the pool",
        "prefix_cache_hit_rate": "share of prompt tokens served from the prefix cache",
        "prefix_cache_hit_tokens": "prompt tokens served from the prefix cache",
        "requests_total": "sequences submitted",
        "requests_finished": "sequences finished",
        "requests_cancelled": "sequences cancelled (clients that went away)",
        "generated_tokens_total": "tokens generated",
        "prompt_tokens_total": "prompt tokens prefilled (cache hits excluded)",
        "tokens_per_second": "generated tokens per second of engine work",
        "time_to_first_token_seconds": "mean time from submission to the first token (last 1000)",
        "time_per_output_token_seconds": "mean time per output token after the first (last 1000)",
    }
    lines = []
    for key, value in m.items():
        name = f"jaxgen_{key}"
        lines += [f"# HELP {name} {help_text.get(key, key)}", f"# TYPE {name} gauge", f"{name} {float(value):.6g}"]
    return "\n".join(lines) + "\n"
