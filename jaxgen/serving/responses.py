"""One request's answer: its sequences in the engine, answered whole or streamed as server-sent events
(exact text deltas with their tokens' logprobs; every stream ends with a final event and [DONE]).

What differs between /v1/completions and /v1/chat/completions is a format object (`COMPLETION`, `CHAT`): the
objects' names, the id's prefix, a choice whole and as a stream's delta, and the logprobs' shape. `Job` is
the same for both."""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxgen.inference.adapters import LoraError
from jaxgen.inference.engine import EngineClosed, Sequence
from jaxgen.inference.pages import PageError
from jaxgen.inference.sampling import SamplingError
from jaxgen.inference.textstream import REPLACEMENT, TextDeltas
from jaxgen.serving.errors import APIError, api_error_for


class Job:
    """One request's sequences in the engine (n per prompt), answered whole or as a stream.

    Choice `index` is prompt_index * n + sample_index, as OpenAI numbers them. With `echo`, each choice's text
    starts with its prompt, and with logprobs too (sampling.prompt_logprobs set) its logprobs cover the
    prompt's tokens first (null for the first), as scoring harnesses such as lm-evaluation-harness read them."""

    def __init__(self, engine, serve, prompts, sampling, body, fmt: AnswerFormat, model_name, echo: bool,
                 want_logprobs, tools=None, lora: str | None = None):  # fmt: skip
        self.engine, self.serve, self.prompts, self.sampling, self.body = engine, serve, prompts, sampling, body
        self.lora = lora  # the LoRA adapter the request's model names (None: the base model)
        self.tools = tools  # a chat request's `tools.Tools` whose answer may hold calls, else None
        self.fmt, self.model_name, self.want_logprobs, self.echo = fmt, model_name, want_logprobs, echo
        self.max_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
            else "max_tokens"  # fmt: skip
        self.prefixes: list[str] = []  # each prompt's text with echo (decoded in a thread, in `respond`)
        self.rid = fmt.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.updates: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []

    def check_size(self) -> None:
        """Refuses a request whose answer could not be built without stalling the server: its sequences
        (prompts x n) against serve.max_queue, its log-probability entries against MAX_LOGPROB_ENTRIES."""
        sequences, limit = len(self.prompts) * self.sampling.n, self.serve.max_queue
        if sequences > limit:
            raise APIError(400, f"the request asks for {sequences} sequences (prompts x n = {len(self.prompts)} x "
                           f"{self.sampling.n}); at most serve.max_queue={limit}", "n")  # fmt: skip
        queued = self.engine.queue_length()
        if queued + sequences > limit:
            raise APIError(429, f"the server is busy: {queued} sequences are queued and this request adds "
                           f"{sequences} (serve.max_queue={limit}); retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"})  # fmt: skip
        if not self.want_logprobs:
            return
        context, top = self.engine.cfg.max_seq_len, self.sampling.logprobs
        tokens = sum((len(p) if self.echo else 0) + min(self.sampling.max_new_tokens, context - len(p))
                     for p in self.prompts)  # fmt: skip
        entries = tokens * self.sampling.n * (top + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            what = self.fmt.logprobs_field
            raise APIError(400, f"the answer would hold up to {entries} log-probabilities (prompts x n x (prompt "
                           f"with echo + {self.max_field}) tokens x ({what} + 1)); at most {MAX_LOGPROB_ENTRIES}: "
                           f"lower n, {self.max_field} or {what}, or send fewer prompts", what)  # fmt: skip

    async def respond(self, request: Request):
        self.check_size()
        if self.echo:
            self.prefixes = await asyncio.to_thread(lambda: [self.engine.tokenizer.decode(p) for p in self.prompts])
        else:
            self.prefixes = [""] * len(self.prompts)
        loop = asyncio.get_running_loop()

        def on_update(seq: Sequence):  # engine thread -> event loop: a snapshot, not the live object
            snap = _Snapshot(self.index(seq), seq.text, list(seq.tokens), list(seq.logprobs),
                             list(seq.top_logprobs), seq.finish_reason, seq.error)  # fmt: skip
            loop.call_soon_threadsafe(self.updates.put_nowait, snap)

        def submit_all():  # (in a thread: each prompt's ids are checked again, 1024 prompts take a while)
            for i, ids in enumerate(self.prompts):
                self.seqs += self.engine.submit(ids, self.sampling, prompt_index=i, on_update=on_update, lora=self.lora)

        try:
            await asyncio.to_thread(submit_all)
        except (SamplingError, PageError, EngineClosed, LoraError) as e:
            self._cancel_unfinished()  # the prompts before the bad one
            raise api_error_for(e, self.max_field) from None
        if self.body.stream:
            return StreamingResponse(self._stream(request), media_type="text/event-stream")
        try:
            return await self._whole(request)
        finally:
            self._cancel_unfinished()

    def index(self, seq: Sequence) -> int:
        return seq.prompt_index * self.sampling.n + seq.sample_index

    def _cancel_unfinished(self) -> None:
        for s in self.seqs:
            if not s.done_event.is_set():
                self.engine.cancel(s)

    async def _next_update(self, request: Request, deadline: float | None):
        """The next snapshot; None after a quiet 0.25 s. Raises ClientGone when the client left, TimeoutError past
        the deadline: both checked after every wait, not only quiet ones, or a request whose tokens keep
        coming (a chunk every < 0.25 s) would run to max_tokens after its client left or its time was up."""
        try:
            snap = await asyncio.wait_for(self.updates.get(), timeout=0.25)
        except asyncio.TimeoutError:
            snap = None
        if await request.is_disconnected():
            raise ClientGone()
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
        pending = set(range(len(self.seqs)))  # choice indices not yet ended (counted, not rescanned per update)
        try:
            while pending:
                snap = await self._next_update(request, deadline)
                if snap is None:  # a quiet moment: look at the sequences themselves
                    pending = {self.index(s) for s in self.seqs if not s.done_event.is_set()}
                elif snap.finish:
                    pending.discard(snap.index)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except TimeoutError:
            return self._timeout_error().response()
        if not all(s.done_event.is_set() for s in self.seqs):  # (set right after each one's last update)
            await asyncio.to_thread(lambda: [s.done_event.wait() for s in self.seqs])
        failed = next((s for s in self.seqs if s.finish_reason in ("error", "cancelled")), None)
        if failed is not None:
            return _ended_error(failed.error or "the request was cancelled").response()
        return Response(await asyncio.to_thread(self._answer), media_type="application/json")

    def _answer(self) -> bytes:
        """The whole answer's JSON (in a worker thread: with logprobs it can be tens of MB). One json.dumps per
        choice, so that the event loop gets the interpreter between them."""
        completion_tokens = sum(len(s.tokens) for s in self.seqs)
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        head = {"id": self.rid, "object": self.fmt.object, "created": self.created, "model": self.model_name}
        choices = ",".join(json.dumps(self.fmt.choice(self, s)) for s in self.seqs)
        return f'{json.dumps(head)[:-1]}, "choices": [{choices}], "usage": {json.dumps(usage)}}}'.encode()

    async def _stream(self, request: Request):
        """Server-sent events: exact text deltas (with their tokens' logprobs) per sequence, a final event
        for each, then [DONE], however the request ends (an error event first when it failed)."""
        hold = max((len(x) for x in self.sampling.stop), default=1) - 1  # a stop string may be half-decoded
        streams = {self.index(s): TextDeltas(self.engine.tokenizer, hold) for s in self.seqs}
        offsets = {self.index(s): len(self.prefixes[s.prompt_index]) for s in self.seqs}
        held = {i: self.tools.streamer() for i in streams} if self.tools is not None else {}  # calls held back
        finished: set[int] = set()
        generated: dict[int, int] = {}  # tokens of each sequence that finished
        deadline = self._deadline()
        try:
            for s in self.seqs:  # with echo, the prompt's text (a stream does not carry the prompt's logprobs)
                yield self._event(self.index(s), self.prefixes[s.prompt_index], None, None, first=True)
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
                finish = snap.finish or None
                if snap.index in held:
                    delta = held[snap.index].feed(delta)
                    if final:
                        tail, calls, finish = held[snap.index].end(finish)
                        delta += tail
                        if calls:
                            yield self._event(snap.index, delta, None, logprobs, calls=calls)
                            delta, logprobs = "", None
                if delta or final or end > start:
                    yield self._event(snap.index, delta, finish, logprobs)
                if final:
                    finished.add(snap.index)
                    generated[snap.index] = len(snap.tokens)
            if len(generated) == len(self.seqs) and self.body.stream_options and self.body.stream_options.include_usage:
                yield self._usage_event(sum(generated.values()))
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        finally:
            self._cancel_unfinished()

    def _stream_logprobs(self, snap, start: int, end: int, offset: int):
        if not self.want_logprobs or end <= start:
            return None, offset
        toks, lps, tops = snap.tokens[start:end], snap.logprobs[start:end], snap.top_logprobs[start:end]
        return self.fmt.logprobs(self.engine, toks, lps, tops, offset, snap.tokens[max(0, start - 4) : start])

    def _usage_event(self, completion_tokens: int) -> str:
        """stream_options.include_usage: a last chunk with no choices and the request's usage (OpenAI's)."""
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        return _sse({"id": self.rid, "object": self.fmt.chunk_object, "created": self.created,
                     "model": self.model_name, "choices": [], "usage": usage})  # fmt: skip

    def _event(self, index: int, text: str, finish: str | None, logprobs, first: bool = False, calls=None) -> str:
        choice = self.fmt.delta_choice(index, text, finish, logprobs, first, calls)
        return _sse({"id": self.rid, "object": self.fmt.chunk_object, "created": self.created,
                     "model": self.model_name, "choices": [choice]})  # fmt: skip


class AnswerFormat:
    """What a completions or a chat answer looks like: `object` and `chunk_object` (the answer's and a stream
    event's "object"), `id_prefix`, `logprobs_field` (the request's name for the number of alternatives)."""

    object: str
    chunk_object: str
    id_prefix: str
    logprobs_field: str

    def choice(self, job: Job, s: Sequence) -> dict:
        """Sequence `s`'s choice in the whole answer."""
        raise NotImplementedError

    def delta_choice(self, index: int, text: str, finish: str | None, logprobs, first: bool, calls) -> dict:
        """A stream event's choice: `text` new since the last (`first`: the choice's first event; `calls`: the
        tool calls it ended with, chat only)."""
        raise NotImplementedError

    def logprobs(self, engine, tokens, logprobs, top_logprobs, offset: int, before=()) -> tuple[dict, int]:
        """The logprobs of streamed `tokens` (from character `offset` on, after the tokens `before`), and the
        offset after them."""
        raise NotImplementedError


class _Completion(AnswerFormat):
    object = chunk_object = "text_completion"
    id_prefix, logprobs_field = "cmpl-", "logprobs"

    def choice(self, job: Job, s: Sequence) -> dict:
        logprobs, prefix = None, job.prefixes[s.prompt_index]
        if job.want_logprobs:
            logprobs = _completion_logprobs(job.engine, s.tokens, s.logprobs, s.top_logprobs, len(prefix))[0]
            if job.sampling.prompt_logprobs is not None:  # echo: the prompt's tokens first
                logprobs = _joined(_prompt_logprobs(job.engine, s), logprobs)
        return {"index": job.index(s), "text": prefix + s.text, "finish_reason": s.finish_reason, "logprobs": logprobs}

    def delta_choice(self, index: int, text: str, finish: str | None, logprobs, first: bool, calls) -> dict:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, engine, tokens, logprobs, top_logprobs, offset: int, before=()) -> tuple[dict, int]:
        return _completion_logprobs(engine, tokens, logprobs, top_logprobs, offset, before)


class _Chat(AnswerFormat):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix, logprobs_field = "chatcmpl-", "top_logprobs"

    def choice(self, job: Job, s: Sequence) -> dict:
        logprobs = _chat_logprobs(job.engine, s.tokens, s.logprobs, s.top_logprobs) if job.want_logprobs else None
        message, finish = {"role": "assistant", "content": s.text}, s.finish_reason
        if job.tools is not None:
            message, finish = job.tools.answer(s.text, finish)
        return {"index": job.index(s), "message": message, "finish_reason": finish, "logprobs": logprobs}

    def delta_choice(self, index: int, text: str, finish: str | None, logprobs, first: bool, calls) -> dict:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta = {"content": text}
        if calls:  # OpenAI's delta shape: each call whole, with its index among the choice's calls
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, engine, tokens, logprobs, top_logprobs, offset: int, before=()) -> tuple[dict, int]:
        return _chat_logprobs(engine, tokens, logprobs, top_logprobs), offset


COMPLETION, CHAT = _Completion(), _Chat()


class _Snapshot:
    __slots__ = ("error", "finish", "index", "logprobs", "text", "tokens", "top_logprobs")

    def __init__(self, index, text, tokens, logprobs, top_logprobs, finish, error):
        self.index, self.text, self.tokens, self.logprobs = index, text, tokens, logprobs
        self.top_logprobs, self.finish, self.error = top_logprobs, finish, error


class ClientGone(Exception):
    """The client disconnected."""


def _ended_error(message: str) -> APIError:
    """A request that ended without a completion: shutting down (503) or failed in the engine (500)."""
    if "shutting down" in message:
        return APIError(503, message, kind="service_unavailable")
    return APIError(500, message, kind="server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


MAX_LOGPROB_ENTRIES = 2_000_000  # in one answer (each about 25 bytes of JSON): a bigger one is refused up front


@functools.lru_cache(maxsize=1 << 18)
def _token_text(tokenizer, token: int) -> str:
    """One token's text (U+FFFD for part of a character), cached: an answer with logprobs names each token
    and its alternatives, the same few thousand over and over."""
    return tokenizer.decode([token])


def _char_offsets(tokenizer, ids, offset: int = 0, before=()) -> tuple[list[int], int]:
    """Where each token starts in the text, in characters (OpenAI's text_offset indexes the text), and where
    the text ends. A token inside a character (a byte-level tokenizer splits "é" over two) starts where that
    character does. Decoded in short windows, each with a few tokens of context before it (a decoder may
    treat the first token apart: SentencePiece drops its leading space), so a long prompt stays linear.
    `before`: the tokens ahead of `ids` (a stream's earlier chunks), whose text is already in `offset`."""
    ids = list(before) + list(ids)
    done = len(before)  # tokens whose characters are counted in `offset`
    lo = max(0, done - 4)
    base = len(tokenizer.decode(ids[lo:done]))
    out = []
    for k in range(len(before), len(ids)):
        out.append(offset)
        text = tokenizer.decode(ids[lo : k + 1])
        if text.endswith(REPLACEMENT) and k + 1 - done < 8 and k + 1 < len(ids):
            continue  # an unfinished character: the next tokens complete it (8: a real U+FFFD token moves on)
        offset += len(text) - base
        done, lo = k + 1, max(0, k + 1 - 4)
        base = len(tokenizer.decode(ids[lo:done]))
    return out, offset


def _completion_logprobs(engine, tokens, logprobs, top_logprobs, offset: int, before=()) -> tuple[dict, int]:
    """The completions format for generated tokens from character `offset` on, and the offset after them."""
    tok = engine.tokenizer
    offsets, end = _char_offsets(tok, tokens, offset, before)
    top = [_by_string(engine, alts) for alts in top_logprobs] if top_logprobs else None
    strings = [_token_text(tok, t) for t in tokens]
    return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}, end


def _prompt_logprobs(engine, s: Sequence) -> dict:
    """The completions format for a sequence's prompt tokens: their logprobs (null for the first) and top
    alternatives with the prompt's own token added (as vLLM); offsets count from the start of the echo."""
    tok = engine.tokenizer
    tops = [None] + [
        _by_string(engine, {**alts, t: lp})
        for t, lp, alts in zip(s.prompt[1:], s.prompt_logprobs[1:], s.prompt_top_logprobs[1:], strict=True)
    ]
    strings = [_token_text(tok, t) for t in s.prompt]
    offsets = _char_offsets(tok, s.prompt)[0]
    return {"tokens": strings, "token_logprobs": s.prompt_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _joined(prompt: dict, generated: dict) -> dict:
    """The prompt's entries, then the generated tokens' (none with max_tokens 0: their top_logprobs is None)."""
    return {k: prompt[k] + (generated[k] or []) for k in prompt}


def _by_string(engine, alts: dict[int, float]) -> dict[str, float]:
    """{token text: logprob}, the format's keys; two ids with the same text (e.g. partial UTF-8 bytes,
    both shown as U+FFFD) keep apart under the vocabulary's own token names."""
    out: dict[str, float] = {}
    for i, lp in alts.items():
        text = _token_text(engine.tokenizer, i)
        out[text if text not in out else engine.tokenizer.tok.id_to_token(i)] = lp
    return out


def _chat_logprobs(engine, tokens, logprobs, top_logprobs) -> dict:
    tok, content = engine.tokenizer, []
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        alts = top_logprobs[i] if top_logprobs else {}
        top = [{"token": _token_text(tok, a), "logprob": v, "bytes": None} for a, v in alts.items()]
        content.append({"token": _token_text(tok, t), "logprob": lp, "bytes": None, "top_logprobs": top})
    return {"content": content}
