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
/docs, /redoc and /openapi.json need the key too. The two routes that read folders on this machine check
their own tokens, before the body too: /v1/admin/update_weights the admin token, /v1/load_lora_adapter the
admin token (any folder) or the API key (a folder inside serve.lora_root).

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

import jax
import jax.numpy as jnp
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from jaxgen.config import ServeConfig
from jaxgen.inference.adapters import folder_in_root
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
    _lora_routes(app, engine, model_name, serve, api_key)
    _admin_routes(app, engine, serve)
    public = (PUBLIC if metrics_need_key else PUBLIC_METRICS) | ADMIN  # these routes check their own tokens
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


def _lora_routes(app: FastAPI, engine: Engine, model_name: str, serve: ServeConfig, api_key: str | None) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies): multi-LoRA serving's
    adapters loaded and unloaded at run time (`Engine.load_lora_folder`, no recompilation). Loading reads a
    folder of the server's machine, so it needs `Authorization: Bearer <serve.admin_token>` (any folder) or,
    with serve.lora_root set, the API key (a folder inside the root, symlinks and `..` resolved); else 403,
    before the folder is looked at. A bad folder, a pickle in place of safetensors, a NaN weight, a rank above
    serve.max_lora_rank, no free slot (serve.max_loras) or a target the bank lacks is a 400 naming it; an
    unknown name to unload a 404. load_inplace replaces the adapter only once the new one loaded (else the old
    one stays). Unloading lets the requests already using the adapter finish."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        admin = _lora_caller(request, serve, api_key)  # before the body is read
        body = _validated(LoadLoraRequest, await _json_body(request))
        if body.lora_name == model_name:
            raise APIError(400, f"lora_name={body.lora_name!r} is the base model's name", "lora_name")
        folder = body.lora_path if admin else _inside_lora_root(body.lora_path, serve)
        # reads files, waits a step
        await asyncio.to_thread(engine.load_lora_folder, body.lora_name, folder, body.load_inplace)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest):
        engine.unload_lora(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def _lora_caller(request: Request, serve: ServeConfig, api_key: str | None) -> bool:
    """True for the admin (serve.admin_token: any folder), False for an API key holder (serve.lora_root only);
    401 for a missing or wrong API key, 403 when neither kind of caller may load folders."""
    given = _bearer(request)
    if serve.admin_token is not None and given and secrets.compare_digest(given.encode(), serve.admin_token.encode()):
        return True
    if api_key is not None and not (given and secrets.compare_digest(given.encode(), api_key.encode())):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
    if serve.lora_root is None:
        raise APIError(
            403, "loading an adapter from a path needs Authorization: Bearer <serve.admin_token>, or a folder that "
            "clients may load from, set at start (serve.lora_root, --lora-root)", "lora_path", code="forbidden_path",
        )  # fmt: skip
    return False


def _inside_lora_root(lora_path: str, serve: ServeConfig) -> str:
    """`lora_path` resolved inside serve.lora_root (a relative one is taken inside it); 403 when it, or a file
    of it, lies outside once symlinks and `..` are resolved (whether it exists is not told)."""
    folder = folder_in_root(lora_path, serve.lora_root)
    if folder is None:
        raise APIError(403, f"lora_path={lora_path!r} is outside serve.lora_root={serve.lora_root!r} (symlinks "
                       "and .. resolved): only adapter folders inside it may be loaded", "lora_path",
                       code="forbidden_path")  # fmt: skip
    return str(folder)


def _bearer(request: Request) -> str | None:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), or None."""
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None


def _validated(model: type[BaseModel], raw):
    """`model` of the JSON `raw`; a 400 naming the field as for every other route's body."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors(include_url=False)]) from None


async def _json_body(request: Request):
    """The body as JSON, or the 400 (json_invalid) every other route answers for a body that is not JSON."""
    try:
        return await request.json()
    except ValueError:
        raise APIError(400, "the body is not valid JSON", code="json_invalid") from None


ADMIN = frozenset({"/v1/admin/update_weights", "/v1/load_lora_adapter"})


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
        given = _bearer(request)
        if given is None:
            message = "the admin routes need Authorization: Bearer <serve.admin_token>"
            raise APIError(401, message, code="no_admin_token")
        if not secrets.compare_digest(given.encode(), token):
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
    """The folder's weights into the engine; ValueError, before anything changes, for a NaN or infinite one
    (it would turn every answer into the same token)."""
    from jaxgen.inference.loading import load_weights  # orbax only when weights load

    params = load_weights(path, serve, engine.cfg)
    finite = _finite(params)
    bad = [jax.tree_util.keystr(k) for k, ok in jax.tree_util.tree_flatten_with_path(finite)[0] if not ok]
    if bad:
        raise ValueError(f"{len(bad)} weights hold NaN or infinite values, the first {bad[0]}: finite numbers only")
    engine.update_params(params, donate=True)  # read for the engine alone


@jax.jit
def _finite(params):
    """Per leaf of `params`, whether every value is finite: one pass on the device, a bool each."""
    return jax.tree.map(lambda w: jnp.isfinite(w).all(), params)


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
