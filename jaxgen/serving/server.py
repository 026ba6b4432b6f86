"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

    python serve.py http --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: POST /v1/completions (a prompt or a list of them, as text or token ids; with echo and
logprobs the prompt's tokens are scored too, as lm-evaluation-harness asks), POST /v1/chat/completions
(the tokenizer's chat template, rendered in jinja2's sandbox, or a plain "role: content" layout when
it has none), GET /v1/models, GET /health, GET /metrics (the engine's statistics in the Prometheus
format, `jaxgen.inference.stats`), and the tokenizer: POST /tokenize, POST /detokenize, GET /tokenizer_info.
Request fields: max_tokens, temperature, top_p, top_k, min_p, seed, n, stop, logprobs, echo, stream
(server-sent events) and stream_options.include_usage, presence_penalty, frequency_penalty,
repetition_penalty, logit_bias, best_of (only equal to n: not supported otherwise), chat content as text
or a list of text parts, and the extensions ignore_eos (as in vLLM) and num_speculative_tokens (n-gram
speculative decoding, 0..8). Types are strict (`true` or `4.0` is not an integer). Every field is
checked by `jaxgen.inference.sampling` (the same bounds and messages as the Python API and the batch
job); every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

With an API key (--api-key), every route needs `Authorization: Bearer KEY`, checked before the body is
read, except the public ones: GET /health always, GET /metrics unless create_app(metrics_need_key=True).
/docs, /redoc and /openapi.json need the key too.

This module holds the routes alone: request models are `protocol.py`'s, chat templates `chat.py`'s, the
routes' work `handlers.py`'s, answers `responses.py`'s, errors `errors.py`'s.

What a public endpoint needs (ServeConfig): a body limit (413 before parsing), a queue limit in sequences
(prompts x n; 429 with Retry-After), an optional per-request timeout, no request's work on the event
loop (tokenizing, rendering, building and serializing answers run in threads; an answer's size is bounded
up front, so /health stays quick whatever one request asks), and on SIGTERM
a drain that admits nothing new and ends every stream with a final event and [DONE]. A request that
fails fails alone; a client that goes away (streaming or not) cancels its sequences.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxgen.config import ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.serving.errors import APIError, ApiKey, BodyLimit, install_error_handlers
from jaxgen.serving.handlers import Handlers
from jaxgen.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)

log = logging.getLogger(__name__)


def create_app(engine: Engine, model_name: str, api_key: str | None = None, serve: ServeConfig | None = None,
               metrics_need_key: bool = False):  # fmt: skip
    """The ASGI app: FastAPI routes wrapped in the API key check and the body limit. `serve` defaults to the
    engine's config."""
    serve = serve or engine.serve
    app = FastAPI(title="jaxgen", description="OpenAI-compatible text generation with jaxgen")
    handlers = Handlers(engine, model_name, serve)
    install_error_handlers(app)
    _info_routes(app, engine, model_name)
    _generation_routes(app, handlers)
    _tokenizer_routes(app, handlers)
    _lora_routes(app, engine, model_name)
    _admin_routes(app, engine, serve)
    public = (PUBLIC if metrics_need_key else PUBLIC_METRICS) | ADMIN  # admin routes check their own token
    guarded = ApiKey(BodyLimit(app, serve.max_body_bytes), api_key, public)
    if handlers.chat_template.error:
        log.warning("%s: chat requests will get 500 with this reason; completions work", handlers.chat_template.error)
    return guarded


PUBLIC = frozenset({"/health"})  # answered without the API key: a load balancer's probe
PUBLIC_METRICS = PUBLIC | {"/metrics"}  # and, unless create_app(metrics_need_key=True), the scraper's


def _info_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    """GET /health (503 while the engine is not running), GET /v1/models (the model and its LoRA adapters, as
    vLLM lists them) and GET /metrics (Prometheus)."""
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not engine.running:
            return JSONResponse({"status": "unavailable: the engine is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        data = [{"id": model_name, "object": "model", "created": created, "owned_by": "jaxgen"}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "jaxgen", "parent": model_name}
                 for name in engine.lora_names()]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus(engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)


def _generation_routes(app: FastAPI, handlers: Handlers) -> None:
    """POST /v1/completions and /v1/chat/completions: a Job each (`handlers`), answered whole or streamed."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await (await handlers.completion_job(body)).respond(request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await (await handlers.chat_job(body)).respond(request)


def _tokenizer_routes(app: FastAPI, handlers: Handlers) -> None:
    """POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes): a client, such as
    lm-evaluation-harness's remote tokenizer, uses the server's own tokenizer. Worked in a thread, answers
    serialized there (a 4 MB text takes seconds; /health stays quick); /detokenize takes ids up to the context."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        handlers.check_model(body.model)
        return Response(await asyncio.to_thread(handlers.tokenize_json, body), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        handlers.check_model(body.model)
        return Response(await asyncio.to_thread(handlers.detokenize_json, body.tokens), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return handlers.engine.tokenizer.info() | {"model_max_length": handlers.engine.cfg.max_seq_len}


def _lora_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies): multi-LoRA serving's
    adapters loaded and unloaded at run time (`Engine.load_lora_folder`, no recompilation). A bad folder, a rank
    above serve.max_lora_rank, no free slot (serve.max_loras) or a target the bank lacks is a 400 naming it; an
    unknown name to unload a 404. Unloading lets the requests already using the adapter finish."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest):
        if body.lora_name == model_name:
            raise APIError(400, f"lora_name={body.lora_name!r} is the base model's name", "lora_name")
        if body.load_inplace and body.lora_name in engine.lora_names():
            engine.unload_lora(body.lora_name)
        await asyncio.to_thread(engine.load_lora_folder, body.lora_name, body.lora_path)  # reads files, waits a step
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest):
        engine.unload_lora(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


ADMIN = frozenset({"/v1/admin/update_weights"})


def _admin_routes(app: FastAPI, engine: Engine, serve: ServeConfig) -> None:
    """With serve.admin_token set: POST /v1/admin/update_weights {"path": a run or Hugging Face folder of
    the served model} loads its weights and swaps them into the live engine (`Engine.update_params`:
    sequences in flight are recomputed on them). `Authorization: Bearer <admin_token>`, checked before the
    body is read: 401 without a bearer token, 403 with another; 400 for a folder that does not load or
    holds another model. Answers {"status": "updated", "path", "seconds"}."""
    if serve.admin_token is None:
        return
    token = serve.admin_token.encode()

    @app.post("/v1/admin/update_weights")
    async def update_weights(request: Request):
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            message = "the admin routes need Authorization: Bearer <serve.admin_token>"
            raise APIError(401, message, code="no_admin_token")
        if not secrets.compare_digest(given.strip().encode(), token):
            raise APIError(403, "wrong admin token", code="invalid_admin_token")
        try:
            path = (await request.json()).get("path")
        except (ValueError, AttributeError):  # not JSON, or not an object
            path = None
        if not isinstance(path, str) or not path:
            raise APIError(400, 'the body must be {"path": "<a run or Hugging Face folder>"}', "path")
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(_swap_weights, engine, serve, path)
        except (OSError, ValueError) as e:  # ConfigError and the mismatch errors are ValueErrors
            raise APIError(400, f"the weights at {path} were not loaded: {e}", "path") from None
        return {"status": "updated", "path": path, "seconds": round(time.perf_counter() - t0, 3)}


def _swap_weights(engine: Engine, serve: ServeConfig, path: str) -> None:
    from jaxgen.inference.loading import load_weights  # orbax only when weights load

    engine.update_params(load_weights(path, serve, engine.cfg), donate=True)  # read for the engine alone


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
