"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

    python serve.py http --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: POST /v1/completions (a prompt or a list of them, as text or token ids; with echo and
logprobs the prompt's tokens are scored too, as lm-evaluation-harness asks), POST /v1/chat/completions
(the tokenizer's chat template, rendered in jinja2's sandbox, or a plain "role: content" layout when
it has none), GET /v1/models, GET /health, GET /metrics (the engine's statistics in the Prometheus
format, `jaxgen.inference.stats`), and the tokenizer: POST /tokenize, POST /detokenize, GET /tokenizer_info.
Request fields: max_tokens, temperature, top_p, top_k, min_p, seed, n, stop, logprobs, echo, stream
(server-sent events), presence_penalty, frequency_penalty, repetition_penalty, logit_bias, and the
extensions ignore_eos (as in vLLM) and num_speculative_tokens (n-gram speculative decoding, 0..8).
Every field is checked by `jaxgen.inference.sampling` (the same bounds and messages as the Python API
and the batch job); every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

What a public endpoint needs (ServeConfig): a body limit (413 before parsing), a queue limit (429
with Retry-After), an optional per-request timeout, tokenization off the event loop, and on SIGTERM
a drain that admits nothing new and ends every stream with a final event and [DONE]. A request that
fails fails alone; a client that goes away (streaming or not) cancels its sequences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time

import jinja2
import jinja2.sandbox
import prometheus_client
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from jaxgen.config import ServeConfig
from jaxgen.inference.decode import encode_prompt
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig, SamplingError, check_prompt, check_text, shown
from jaxgen.serving.errors import APIError, BodyLimit, install_error_handlers
from jaxgen.serving.responses import Job

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
    num_speculative_tokens: int = 0  # an extension: n-gram drafts checked per step (0..8; the output is the same)
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids; a list of either: one choice each
    max_tokens: int = 16  # 0 with echo: the prompt's log-probabilities only
    logprobs: int | None = None
    echo: bool = False


class Message(BaseModel):
    role: str
    content: str


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (a BOS token for Llama; nothing for GPT-2)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def create_app(engine: Engine, model_name: str, api_key: str | None = None, serve: ServeConfig | None = None):
    """The ASGI app: FastAPI routes wrapped in the body limit. `serve` defaults to the engine's config.
    (Long on purpose: the routes are closures over this app's engine, model name and chat template, the
    way FastAPI apps are written; each route's work is in `responses` and `errors`.)"""
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

    install_error_handlers(app)

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
        prompts = _prompt_list(body.prompt, serve.max_queue)
        ids = []
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            ids.append(
                await tokens_of(p, field)
                if isinstance(p, str)
                else encode_prompt(engine.tokenizer, p, engine.cfg, field)
            )
        sampling = _sampling(body, body.max_tokens, body.logprobs or 0)
        if body.echo and body.logprobs is not None:  # scores of the prompt too, with the most likely token
            top = max(body.logprobs, 1)
            sampling = dataclasses.replace(sampling, logprobs=top, prompt_logprobs=top)
        want = body.logprobs is not None
        job = Job(engine, serve, ids, sampling, body, "text_completion", model_name, body.echo, want)
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
        job = Job(engine, serve, [ids], sampling, body, "chat.completion", model_name, False, body.logprobs)
        return await job.respond(request)

    _tokenizer_routes(app, engine, check_key, check_model, tokens_of)
    return BodyLimit(app, serve.max_body_bytes)


def _tokenizer_routes(app: FastAPI, engine: Engine, check_key, check_model, tokens_of) -> None:
    """POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes): a client, such as
    lm-evaluation-harness's remote tokenizer, uses the server's own tokenizer."""
    tokenizer, cfg = engine.tokenizer, engine.cfg

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        check_text("prompt", body.prompt)
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_seq_len}

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if body.tokens:  # (an empty list decodes to "")
            check_prompt(body.tokens, cfg.vocab_size, 2**31 - 1, "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info", dependencies=[Depends(check_key)])
    async def tokenizer_info():
        return tokenizer.info() | {"model_max_length": cfg.max_seq_len}


def _prompt_list(prompt, most: int) -> list:
    """The prompts of a completions request: a string or a list of ids is one; a list of either, several."""
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    if len(prompts) > most:
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {most} (serve.max_queue)", "prompt")
    return prompts


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
        num_speculative_tokens=body.num_speculative_tokens,
    )  # fmt: skip
    try:
        return SamplingConfig.from_dict(data)
    except SamplingError as e:
        if e.field == "max_new_tokens":  # the API's name for it
            raise APIError(400, str(e).replace("max_new_tokens", max_field, 1), max_field) from None
        raise


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
