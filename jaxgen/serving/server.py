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

What a public endpoint needs (ServeConfig): a body limit (413 before parsing), a queue limit in sequences
(prompts x n; 429 with Retry-After), an optional per-request timeout, no request's work on the event
loop (tokenizing, rendering, building and serializing answers run in threads; an answer's size is bounded
up front, so /health stays quick whatever one request asks), and on SIGTERM
a drain that admits nothing new and ends every stream with a final event and [DONE]. A request that
fails fails alone; a client that goes away (streaming or not) cancels its sequences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
from typing import Annotated, Any, Literal

import jinja2
import jinja2.sandbox
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, TypeAdapter, ValidationError

from jaxgen.chat_template import TemplateRefused, compile_template
from jaxgen.config import ServeConfig
from jaxgen.inference.decode import encode_prompt
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig, SamplingError, check_prompt, check_text, shown
from jaxgen.serving.constraints import Compiles, ConstraintError, ResponseFormat, requested
from jaxgen.serving.errors import APIError, ApiKey, BodyLimit, install_error_handlers
from jaxgen.serving.responses import Job
from jaxgen.serving.tools import NamedChoice, Tool, ToolError, message_for_template, tools_of

PLAIN_CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
log = logging.getLogger(__name__)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with no choices and the request's usage (as OpenAI sends it)


class _Common(BaseModel):
    """Types only: every bound is checked once, by SamplingConfig (see `_sampling`). Strict: `true`, `4.0` or
    `"4"` for an integer is refused, as SamplingConfig refuses it (a float field takes an integer: 1 is 1.0)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # {token id (as a string, JSON's keys): bias in [-100, 100]}
    ignore_eos: bool = False  # an extension (as in vLLM): generate max_tokens whatever the model says
    num_speculative_tokens: int = 0  # an extension: n-gram drafts checked per step (0..8; the output is the same)
    user: str | None = None
    # what the output must be (`constraints`): at most one of these
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {json | json_object | regex | choice | grammar}
    guided_json: dict[str, Any] | str | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids; a list of either: one choice each
    max_tokens: int = 16  # 0 with echo: the prompt's log-probabilities only
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # not supported: accepted only equal to n (clients send best_of=1)


class Message(BaseModel):
    model_config = ConfigDict(strict=True)

    role: str
    content: str | list[dict] | None = None  # text, or OpenAI's content parts: [{"type": "text", "text": ...}, ...]
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (`tools.message_for_template`)
    tool_call_id: str | None = None  # a tool's answer: the call it answers


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (a BOS token for Llama; nothing for GPT-2)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class ChatRequest(_Common):
    # validated in a worker thread (`_messages`): 125,000 small messages take most of a second to validate
    messages: Annotated[list[Message], SkipValidation]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None  # functions the model may call (`jaxgen.serving.tools`)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a constrained answer holds one call (else up to tools.MAX_CALLS)


def create_app(engine: Engine, model_name: str, api_key: str | None = None, serve: ServeConfig | None = None,
               metrics_need_key: bool = False):  # fmt: skip
    """The ASGI app: FastAPI routes wrapped in the API key check and the body limit. `serve` defaults to the
    engine's config. (Long on purpose: the routes are closures over this app's engine, model name and chat
    template, the way FastAPI apps are written; each route's work is in `responses` and `errors`.)"""
    serve = serve or engine.serve
    app = FastAPI(title="jaxgen", description="OpenAI-compatible text generation with jaxgen")
    created = int(time.time())
    chat_template = ChatTemplate(engine.tokenizer.chat_template)
    longest_token = max(len(t) for t in engine.tokenizer.tok.get_vocab())  # chars one token covers, at most
    most_chars = longest_token * engine.cfg.max_seq_len  # longer text is too long whatever it tokenizes to
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if not engine.running:
            return JSONResponse({"status": "unavailable: the engine is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        data = [{"id": model_name, "object": "model", "created": created, "owned_by": "jaxgen"}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "jaxgen", "parent": model_name}
                 for name in engine.lora_names()]  # LoRA adapters, as vLLM lists them  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus(engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    def tokens_of(text: str, field: str) -> list[int]:  # (in a worker thread: long text takes a while)
        check_text(field, text)
        _check_length(text, most_chars, engine.cfg.max_seq_len, field)
        return encode_prompt(engine.tokenizer, _encode(engine.tokenizer, text), engine.cfg, field)

    def check_model(name: str | None) -> str | None:
        """The LoRA adapter `name` names (None: the base model); 404 model_not_found for any other name."""
        if name is None or name == model_name:
            return None
        if name in engine.lora_names():
            return name
        adapters = "".join(f", {a!r}" for a in engine.lora_names())
        raise APIError(404, f"the model {shown(name)} does not exist; this server serves {model_name!r}{adapters}",
                       "model", code="model_not_found")  # fmt: skip

    def prompt_ids(prompts: list) -> list[list[int]]:
        fields = ["prompt" if len(prompts) == 1 else f"prompt.{i}" for i in range(len(prompts))]
        return [
            tokens_of(p, f) if isinstance(p, str) else encode_prompt(engine.tokenizer, p, engine.cfg, f)
            for p, f in zip(prompts, fields, strict=True)
        ]

    compiles = Compiles(engine.automaton)

    async def compiled(sampling: SamplingConfig, field: str | None) -> None:
        """Compiles the request's constraint (a schema takes milliseconds, a hostile regex up to the compile time
        limit), so that a bad one is a 400 naming the client's field before anything is queued."""
        try:
            await compiles.check(sampling, field)
        except ConstraintError as e:
            raise APIError(400, str(e), e.field) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of={shown(body.best_of)} is not supported: use n (best_of may only equal n, "
                           f"here {body.n})", "best_of")  # fmt: skip
        ids = await asyncio.to_thread(prompt_ids, _prompt_list(body.prompt, serve.max_queue))
        structured, field = await asyncio.to_thread(_constraint, body)  # (a schema of 1 MB takes a while)
        sampling = _sampling(body, body.max_tokens, body.logprobs or 0, structured=structured)
        await compiled(sampling, field)
        if body.echo and body.logprobs is not None:  # scores of the prompt too, with the most likely token
            top = max(body.logprobs, 1)
            sampling = dataclasses.replace(sampling, logprobs=top, prompt_logprobs=top)
        want = body.logprobs is not None
        job = Job(engine, serve, ids, sampling, body, "text_completion", adapter or model_name, body.echo, want,
                  lora=adapter)  # fmt: skip
        return await job.respond(request)

    def chat_ids(messages, tools: list[dict] | None) -> list[int]:  # (in a worker thread: 4 MB of messages)
        text = chat_template.render([_message(i, m) for i, m in enumerate(_messages(messages))], tools)
        return tokens_of(text, "messages")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        adapter = check_model(body.model)
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if field == "max_completion_tokens" else body.max_tokens
        (tools, call), (structured, constraint_field) = await asyncio.to_thread(_constraints, body, chat_template)
        if call is not None:
            if structured is not None:
                raise APIError(400, "tool_choice (required, or a named function) constrains the output to a call; "
                               f"{constraint_field} cannot constrain it too", constraint_field)  # fmt: skip
            structured, constraint_field = call, "tools"
        sampling = _sampling(body, 256 if max_tokens is None else max_tokens, top, field, structured)
        await compiled(sampling, constraint_field)
        ids = await asyncio.to_thread(chat_ids, body.messages, tools.for_template() if tools else None)
        job = Job(engine, serve, [ids], sampling, body, "chat.completion", adapter or model_name, False, body.logprobs,
                  tools if tools is not None and tools.active else None, lora=adapter)  # fmt: skip
        return await job.respond(request)

    _tokenizer_routes(app, engine, check_model)
    _lora_routes(app, engine, model_name)
    _admin_routes(app, engine, serve)
    public = (PUBLIC if metrics_need_key else PUBLIC_METRICS) | ADMIN  # admin routes check their own token
    guarded = ApiKey(BodyLimit(app, serve.max_body_bytes), api_key, public)
    if chat_template.error:
        log.warning("%s: chat requests will get 500 with this reason; completions work", chat_template.error)
    return guarded


PUBLIC = frozenset({"/health"})  # answered without the API key: a load balancer's probe
PUBLIC_METRICS = PUBLIC | {"/metrics"}  # and, unless create_app(metrics_need_key=True), the scraper's


def _constraint(body: _Common):
    """(the request's Structured or None, the field that carried it); a bad one is a 400 naming that field."""
    try:
        return requested(body)
    except ConstraintError as e:
        raise APIError(400, str(e), e.field) from None


def _constraints(body: ChatRequest, template: ChatTemplate):
    """A chat request's ((tools, the call they constrain to), (its own constraint, the field that carried it))."""
    return _tools(body, template.source), _constraint(body)


def _tools(body: ChatRequest, template: str | None):
    """(the request's `tools.Tools`, the constraint its tool_choice puts on the output): (None, None) without
    tools; a bad tools or tool_choice is a 400 naming it."""
    try:
        tools = tools_of(body.tools, body.tool_choice, template, body.parallel_tool_calls)
        return tools, tools.constraint() if tools is not None else None
    except ToolError as e:
        raise APIError(400, str(e), e.field) from None


def _check_length(text: str, most: int, context: int, field: str) -> None:
    if len(text) > most:
        raise APIError(400, f"{field} has {len(text)} characters, far more than the model's context of "
                       f"{context} tokens can hold", field)  # fmt: skip


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str  # a PEFT adapter folder on the server's machine
    load_inplace: bool = False  # (vLLM's) replace an adapter of that name if loaded


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; ignored: adapters are known by name)


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


def _tokenizer_routes(app: FastAPI, engine: Engine, check_model) -> None:
    """POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes): a client, such as
    lm-evaluation-harness's remote tokenizer, uses the server's own tokenizer. Worked in a thread, answers
    serialized there (a 4 MB text takes seconds; /health stays quick); /detokenize takes ids up to the context."""
    tokenizer, cfg = engine.tokenizer, engine.cfg

    def tokenize_json(body: TokenizeRequest) -> bytes:  # text of any length the body limit lets in: a client
        check_text("prompt", body.prompt)  # (lm-eval's rolling loglikelihood) tokenizes whole documents, then splits
        ids = _encode(tokenizer, body.prompt, body.add_special_tokens)
        return b'{"tokens": [%s], "count": %d, "max_model_len": %d}' % (_joined_ints(ids), len(ids), cfg.max_seq_len)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        return Response(await asyncio.to_thread(tokenize_json, body), media_type="application/json")

    def detokenize_json(tokens: list[int]) -> bytes:
        if len(tokens) > cfg.max_seq_len:
            raise APIError(400, f"tokens has {len(tokens)} ids; at most the model's context, {cfg.max_seq_len}",
                           "tokens")  # fmt: skip
        if tokens:  # (an empty list decodes to "")
            check_prompt(tokens, cfg.vocab_size, 2**31 - 1, "tokens")
        return json.dumps({"prompt": tokenizer.decode(tokens)}).encode()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        return Response(await asyncio.to_thread(detokenize_json, body.tokens), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer.info() | {"model_max_length": cfg.max_seq_len}


def _encode(tokenizer, text: str, special: bool = True) -> list[int]:
    """Tokenizer.encode, through encode_batch: that one lets go of the interpreter while it works (encode holds
    it: a 4 MB text stalled the event loop for 4 s, even from a worker thread)."""
    return tokenizer.tok.encode_batch([text], add_special_tokens=special)[0].ids


def _joined_ints(ids: list[int], piece: int = 65536) -> bytes:
    """The text "1, 2, 3" for a JSON list, a piece at a time: one json.dumps of millions of ids holds the interpreter
    (and so the event loop) for most of a second; between pieces the loop gets its turn."""
    return b", ".join(json.dumps(ids[i : i + piece])[1:-1].encode() for i in range(0, len(ids), piece))


def _prompt_list(prompt, most: int) -> list:
    """The prompts of a completions request: a string or a list of ids is one; a list of either, several."""
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    if len(prompts) > most:
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {most} (serve.max_queue)", "prompt")
    return prompts


_MESSAGES = TypeAdapter(Annotated[list[Message], Field(min_length=1)])


def _messages(raw) -> list[Message]:
    """The chat request's messages, validated (off the event loop); errors as any other field's."""
    try:
        return _MESSAGES.validate_python(raw)
    except ValidationError as e:
        errors = [{**x, "loc": ("body", "messages", *x["loc"])} for x in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def _message(i: int, m: Message) -> dict:
    """A message as the template sees it: checked text; content parts joined (text parts only, as vLLM)."""
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


def _sampling(body: _Common, max_tokens: int, logprobs: int, max_field: str = "max_tokens",
              structured=None) -> SamplingConfig:  # fmt: skip
    """The request's SamplingConfig: the one validation (bounds and messages) every door shares."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    data = dict(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=seed, n=body.n, stop=stop, logprobs=logprobs, logit_bias=body.logit_bias or {},
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
        num_speculative_tokens=body.num_speculative_tokens, structured=structured,
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
