"""Fuzzing the live OpenAI-compatible server with hypothesis.

Each example sends one to three requests at once to a live server (uvicorn and the engine in threads):
bodies over the whole schema of /v1/completions and /v1/chat/completions, valid, with one bad field, or
with every field drawn from valid, edge (0, -1, 2**31, 2**63, 1e308, NaN, Infinity) and wrong-typed
values, unknown fields and models, lone surrogates, 10 KB strings, and malformed bytes; streaming or
not; some clients read a stream for a few lines and hang up, some give up on an answer after 0.05 s.
Properties:

- no 5xx: client input never gets a 500 (nor a 503: the engine never stops here);
- every answer is a well-formed completion (id, object, choices with index and text or message,
  finish_reason in {stop, length}, usage) or an OpenAI-shaped error {"error": {"message", "type",
  "param", "code"}} with a 4xx status; a valid body always gets its completion;
- no hung stream: every stream read to its end ends with `data: [DONE]` (client timeouts are 120 s:
  a slow machine never fails this, a hang does);
- afterwards the server is back to zero: no request handler left, no slot or page in use, nothing
  queued, every sequence finished or cancelled (none failed), /health 200.

CI runs a fixed (derandomized) set of examples; for more, random ones locally:

    JAXGEN_FUZZ_EXAMPLES=1000 pytest tests/test_fuzz_server.py -q
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import time

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from jaxgen.config import ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.serving import responses
from jaxgen.serving.responses import ClientGone, Job
from jaxgen.serving.server import create_app
from jaxgen.tokenizer import Tokenizer
from tests.live import live_server, tiny_engine

NAME = "tiny"
TIMEOUT = 120.0  # a slow machine never reaches it; a hung request does
COMPILING = 900.0  # a constraint's first request compiles its automaton and may regrow the engine's table
GIVE_UP = 0.05  # the impatient client's timeout
EXAMPLES = int(os.environ.get("JAXGEN_FUZZ_EXAMPLES", "60"))
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    """A live server on 127.0.0.1: uvicorn in a thread, the engine in another."""
    engine, _ = tiny_engine()
    with live_server(engine, create_app(engine, NAME)) as (url, uv):
        yield url, engine, uv


# --- values ------------------------------------------------------------------------------------------

LONE = "\udc80"  # a lone surrogate: json.dumps writes the escape "\udc80", which no text may hold
EDGE = st.sampled_from(
    [0, -1, 1, 3, 255, 256, 257, 2**31 - 1, 2**31, 2**63, -(2**63), 2**64, 10**30,
     0.0, -0.0, -1.0, 1e-300, 0.5, 1.5, 100.0, 1e4, 1e308, -1e308, math.nan, math.inf, -math.inf]
)  # fmt: skip
WRONG = st.sampled_from([None, "", "x", "1", "NaN", LONE, "9" * 5000, [], [1], ["a"], {}, {"a": 1}, True, False])
ANY = st.one_of(EDGE, WRONG, st.integers(), st.floats(), st.text(max_size=12), st.booleans())
HUGE = ["x" * 10_000, "é" * 3000, "a b " * 2500, "x" * 300]  # over the context, or far over it


STOP = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3))
BAD_STOP = st.sampled_from(["", [""], [LONE], "x" * 300, ["a"] * 17, [1], 5, [None], {"a": "b"}])
BIAS = st.dictionaries(st.integers(0, 256).map(str), st.floats(-100, 100), max_size=4)
BAD_BIAS_KEY = st.sampled_from(["-1", "257", "999999", "abc", "", " 5", "５", "²", "--5", "1e3", "9" * 5000, LONE])
BAD_BIAS = st.one_of(
    st.dictionaries(st.one_of(BAD_BIAS_KEY, st.integers(0, 256).map(str)), ANY, min_size=1, max_size=3),
    st.sampled_from([[], [[1, 2]], "x", 5]),
)

# (valid, any) strategies per field; "any" mixes the valid ones with edge and wrong values
COMMON = {
    "model": (st.just(NAME), st.one_of(st.sampled_from(["gpt-4", "", LONE, NAME.upper()]), st.text(max_size=12))),
    "temperature": (st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(0, 2)), ANY),
    "top_p": (st.floats(0.01, 1), ANY),
    "top_k": (st.integers(0, 257), ANY),
    "min_p": (st.floats(0, 1), ANY),
    "seed": (st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([-(2**63), 2**64 - 1])), ANY),
    "n": (st.integers(1, 3), ANY),
    "stop": (STOP, st.one_of(BAD_STOP, ANY)),
    "stream": (st.booleans(), ANY),
    "stream_options": (
        st.one_of(st.none(), st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
        st.one_of(st.sampled_from([{"include_usage": 1}, {"x": True}, []]), ANY),
    ),
    "presence_penalty": (st.floats(-2, 2), ANY),
    "frequency_penalty": (st.floats(-2, 2), ANY),
    "repetition_penalty": (st.one_of(st.floats(0.5, 2), st.just(1e-300), st.just(100.0)), ANY),
    "logit_bias": (BIAS, st.one_of(BAD_BIAS, ANY)),
    "ignore_eos": (st.booleans(), ANY),
    "user": (st.text(max_size=12), ANY),
}
LENGTH = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 2**31 - 1])  # mostly short; sometimes to the end of the context
PROMPT = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, 256), min_size=1, max_size=30),
    st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),  # one choice per prompt
    st.lists(st.lists(st.integers(0, 256), min_size=1, max_size=10), min_size=1, max_size=3),
)
BAD_PROMPTS = ["", [], [""], [LONE], "a" + LONE, [-1], [257], [2**63], [1.5], ["a", ""], [1, "a"], [[1], []],
               [[257]], [["a"]], [[1], "a"], list(range(256)), *HUGE, [HUGE[0]]]  # fmt: skip
BAD_PROMPT = st.one_of(st.sampled_from(BAD_PROMPTS), ANY)
COMPLETION = {
    **COMMON,
    "prompt": (PROMPT, BAD_PROMPT),
    "max_tokens": (st.one_of(LENGTH, st.just(0)), st.one_of(st.sampled_from([-1, 2**31 - 1, 2**31, 255]), ANY)),
    "logprobs": (st.one_of(st.none(), st.integers(0, 5)), ANY),
    "echo": (st.booleans(), ANY),
    "best_of": (st.none(), st.one_of(st.sampled_from([0, 2, 5, -1]), ANY)),  # (valid_body sets it equal to n)
}
ROLE = st.sampled_from(["system", "user", "assistant"])
TEXT_PARTS = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}), min_size=1, max_size=2
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE, "content": st.one_of(st.text(max_size=12), TEXT_PARTS)}, optional={"name": st.text(max_size=8)}
)
BAD_MESSAGES = st.one_of(
    st.sampled_from([[], [{}], [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": None}],
                     [{"role": LONE, "content": "x"}], [{"role": "user", "content": LONE}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "hi", [None],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": []}],
                     [{"role": "user", "content": "x"}] * 100, [{"role": "user", "content": h} for h in HUGE[:1]]]),
    ANY,
)  # fmt: skip
CHAT_FIELDS = {
    **COMMON,
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3), BAD_MESSAGES),  # at most 3 * 61 + 11 tokens
    "max_tokens": (LENGTH, st.one_of(st.sampled_from([0, 2**31, 2**31 - 1]), ANY)),
    "max_completion_tokens": (LENGTH, st.one_of(st.sampled_from([0, 2**31]), ANY)),
    "logprobs": (st.booleans(), ANY),
    "top_logprobs": (st.integers(0, 5), ANY),
}
UNKNOWN = st.dictionaries(st.sampled_from(["best_of", "suffix", "tools", "", LONE, "x" * 2000]), ANY, max_size=2)


@st.composite
def valid_body(draw, chat: bool) -> dict:
    """A body the server must answer with a completion: every field valid, each present or not."""
    fields = CHAT_FIELDS if chat else COMPLETION
    body = {k: draw(valid) for k, (valid, _) in fields.items() if draw(st.booleans())}
    required = "messages" if chat else "prompt"
    body[required] = draw(fields[required][0])
    if chat:
        body.setdefault("max_tokens", draw(LENGTH))  # else up to the whole context
        if body.get("top_logprobs") and not body.get("logprobs"):
            del body["top_logprobs"]
    elif "best_of" in body and draw(st.booleans()):
        body["best_of"] = body.get("n", 1)  # the one value besides null that is accepted
    return body


@st.composite
def fuzzed_body(draw, chat: bool) -> dict:
    """A valid body with one field bad or gone, or every field drawn from anything, plus unknown fields."""
    fields = CHAT_FIELDS if chat else COMPLETION
    if draw(st.booleans()):
        body = draw(valid_body(chat))
        key = draw(st.sampled_from(sorted(fields)))
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(fields[key][1])
    else:
        body = {k: draw(st.one_of(valid, bad)) for k, (valid, bad) in fields.items() if draw(st.booleans())}
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(UNKNOWN))
    return body


@dataclasses.dataclass
class Call:
    """One request: what is sent, and how the client behaves."""

    path: str
    raw: bytes
    body: object = None  # the JSON value encoded in raw (None for malformed bytes)
    valid: bool = False  # the server must answer it with a completion
    headers: dict = dataclasses.field(default_factory=lambda: {"content-type": "application/json"})
    method: str = "POST"
    # patient: reads to the end; hangs_up: after `lines` lines of a stream; impatient: gives up after GIVE_UP s;
    # leaves_early: sends half the body, then closes the connection
    client: str = "patient"
    lines: int = 0
    chunked: bool = False  # the body in two chunks, no content-length

    def __repr__(self):
        raw = self.raw if len(self.raw) <= 300 else self.raw[:300] + b"...(%d bytes)" % len(self.raw)
        return f"Call({self.method} {self.path} {raw!r} {self.headers} {self.client}:{self.lines} valid={self.valid})"


def encoded(body) -> st.SearchStrategy[bytes]:
    """JSON text (NaN and Infinity as Python writes them), ASCII-escaped or raw UTF-8 (a lone surrogate then
    makes bytes that are not UTF-8)."""
    utf8 = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return st.sampled_from([json.dumps(body).encode(), utf8])


MALFORMED = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"[]", b"null", b"1", b'"x"', b"{", b'{"prompt": "x",', b'{"prompt": "x"} x', b"prompt=x",
                     b"[" * 100_000, b'{"a":' * 5000, b"\xff\xfe{}", b'\xef\xbb\xbf{"prompt": "x"}',
                     b'{"prompt": "x", "prompt": 5}', b'{"prompt": "\\ud800\\udc00x"}', b'{"prompt": "\\u0000"}']),
)  # fmt: skip
HEADERS = st.sampled_from(
    [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
     {"content-type": "application/json; charset=latin-1"}, {"content-type": "application/vnd.api+json"},
     {"content-type": "multipart/form-data; boundary=x"}, {"content-type": b"\xff/json"}]
)  # fmt: skip


@st.composite
def calls(draw) -> Call:
    chat = draw(st.booleans())
    path = CHAT if chat else COMPLETIONS
    kind = draw(st.sampled_from(["valid", "valid", "fuzzed", "fuzzed", "malformed"]))
    if kind == "malformed":
        call = Call(path, draw(MALFORMED))
    else:
        body = draw(valid_body(chat) if kind == "valid" else fuzzed_body(chat))
        call = Call(path, draw(encoded(body)), body, valid=kind == "valid")
    if not call.valid and draw(st.integers(0, 5)) == 0:  # odd headers, methods and paths
        call.headers = draw(HEADERS)
        call.method = draw(st.sampled_from(["POST", "POST", "GET", "PUT"]))
        call.path = draw(st.sampled_from([COMPLETIONS, CHAT, "/v1/completion", "/v1/chat/completions/"]))
    if isinstance(call.body, dict) and call.body.get("stream") is True:
        call.client = draw(st.sampled_from(["patient", "hangs_up", "hangs_up"]))
    else:
        call.client = draw(st.sampled_from(["patient", "patient", "impatient", "leaves_early"]))
    call.lines = draw(st.integers(0, 5))
    call.chunked = draw(st.integers(0, 3)) == 0
    return call


# --- checks --------------------------------------------------------------------------------------------


def _strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity are not JSON, whatever Python's json accepts."""

    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def check_error(status: int, data) -> None:
    assert 400 <= status < 500, status
    assert isinstance(data, dict) and set(data) == {"error"}, data
    e = data["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), e
    assert e["param"] is None or isinstance(e["param"], str), e
    assert e["code"] is None or isinstance(e["code"], str), e


def _n(call: Call) -> int | None:
    """The choices a request asks: n per prompt (a list of strings or of id lists is several prompts)."""
    n = call.body.get("n", 1) if isinstance(call.body, dict) else None
    prompt = call.body.get("prompt") if isinstance(call.body, dict) else None
    several = isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
    return n * (len(prompt) if several else 1) if type(n) is int else None  # "2" or 2.0 are accepted, uncounted


def check_completion(call: Call, data) -> None:
    chat = call.path == CHAT
    assert data["object"] == ("chat.completion" if chat else "text_completion"), data
    assert isinstance(data["id"], str) and data["id"].startswith("chatcmpl-" if chat else "cmpl-"), data
    assert isinstance(data["created"], int) and data["model"] == NAME, data
    choices = data["choices"]
    assert sorted(c["index"] for c in choices) == list(range(len(choices))) and choices, data
    assert _n(call) in (None, len(choices)), data
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), c
        if chat:
            assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str), c
        else:
            assert isinstance(c["text"], str), c
        assert c["logprobs"] is None or isinstance(c["logprobs"], dict), c
    u = data["usage"]
    assert all(type(u[k]) is int for k in ("prompt_tokens", "completion_tokens", "total_tokens")), u
    assert u["prompt_tokens"] >= 1 and u["completion_tokens"] >= 0, u
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u


def check_event(call: Call, line: str) -> tuple[int, str | None]:
    """One event of a stream (not [DONE]); returns its choice's index and finish_reason."""
    assert line.startswith("data: "), line
    data = _strict_json(line[6:])
    assert "error" not in data, f"an error event for client input: {data}"
    chat = call.path == CHAT
    assert data["object"] == ("chat.completion.chunk" if chat else "text_completion"), data
    assert isinstance(data["id"], str) and data["model"] == NAME, data
    if data["choices"] == []:  # stream_options.include_usage: the usage, last
        assert (call.body.get("stream_options") or {}).get("include_usage") is True, data
        assert all(type(data["usage"][k]) is int for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
        return -1, None
    (choice,) = data["choices"]
    assert choice["finish_reason"] in (None, "stop", "length"), choice
    if chat:
        assert isinstance(choice["delta"], dict), choice
    else:
        assert isinstance(choice["text"], str), choice
    return choice["index"], choice["finish_reason"]


def check_stream(call: Call, lines) -> None:
    """A stream read to its end: events, each sequence's final one, then [DONE] last."""
    events = [x for x in lines if x]
    assert events and events[-1] == "data: [DONE]", f"the stream did not end with [DONE]: {events[-3:]}"
    ends = []
    indices = set()
    for i, line in enumerate(events[:-1]):
        index, finish = check_event(call, line)
        if index == -1:
            assert i == len(events) - 2, "the usage chunk is not the last event"
            continue
        indices.add(index)
        if finish:
            ends.append(index)
    assert sorted(ends) == sorted(indices) == list(range(len(indices))), events
    assert _n(call) in (None, len(indices)), events


def check_answer(call: Call, r: httpx.Response, engine: Engine) -> None:
    """A whole answer (not a stream): a completion, or an error in OpenAI's shape with a 4xx status."""
    if r.status_code == 503:
        assert not engine.running, r.text
    if call.path.endswith("/") and r.status_code == 307:  # the framework's redirect to the path without "/"
        assert r.headers["location"].endswith(call.path.rstrip("/")), r.headers
        return
    assert r.status_code < 500, r.text
    data = _strict_json(r.text)
    if r.status_code == 200:
        check_completion(call, data)
    else:
        check_error(r.status_code, data)
        assert not call.valid, f"a valid body was refused: {r.status_code} {r.text}"


def send(url: str, call: Call, engine: Engine) -> str:
    """Sends one call and checks what comes back; returns what happened (for the notes)."""
    timeout = GIVE_UP if call.client == "impatient" else TIMEOUT
    half = len(call.raw) // 2
    content = iter([call.raw[:half], call.raw[half:]]) if call.chunked else call.raw
    if call.client == "leaves_early":

        def content():
            yield call.raw[:half]
            raise _LeftEarly

        content = content()
    try:
        with httpx.stream(call.method, url + call.path, content=content, headers=call.headers, timeout=timeout) as r:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert r.status_code == 200, r.status_code
                lines = r.iter_lines()  # kept: a dropped iterator would close the connection at once
                if call.client == "hangs_up":
                    for _, line in zip(range(call.lines), lines):
                        if line and line != "data: [DONE]":
                            check_event(call, line)
                    return "hung up"  # leaving the block closes the connection
                check_stream(call, lines)
                return "stream"
            r.read()
            check_answer(call, r, engine)
            assert not (r.status_code == 200 and isinstance(call.body, dict) and call.body.get("stream") is True)
            return str(r.status_code)
    except httpx.TimeoutException:
        if call.client != "impatient":
            raise AssertionError(f"no answer within {TIMEOUT} s: a hung request") from None
        return "gave up"
    except _LeftEarly:
        return "left early"


class _LeftEarly(Exception):
    """The client stops sending its body and closes the connection."""


def back_to_zero(url: str, engine: Engine, uv: uvicorn.Server) -> None:
    """Every request handler has returned and the engine holds nothing: no slot, page or queued request,
    every sequence finished or cancelled, none failed. Polled with a generous bound, never assumed."""

    def zero():
        return (
            not uv.server_state.tasks
            and all(s is None for s in engine.slots)
            and engine.pool.in_use() == 0
            and engine.queue_length() == 0
        )

    deadline = time.monotonic() + TIMEOUT
    while not zero():
        assert time.monotonic() < deadline, f"not back to zero after {TIMEOUT} s: {engine.metrics()}"
        time.sleep(0.05)
    m = engine.metrics()
    assert m["requests_failed"] == 0, m
    assert m["requests_total"] == m["requests_finished"] + m["requests_cancelled"], m
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


def test_fuzzed_requests_never_break_the_server(server):
    url, engine, uv = server
    pool = concurrent.futures.ThreadPoolExecutor(3)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize="JAXGEN_FUZZ_EXAMPLES" not in os.environ,  # CI: the same examples every run
        database=None,  # nothing written into the repository
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=st.lists(calls(), min_size=1, max_size=3))
    def run(batch):
        futures = [pool.submit(send, url, call, engine) for call in batch]  # at once: they run side by side
        outcomes = [f.result() for f in futures]
        note(f"outcomes: {outcomes}")

    try:
        run()
    finally:
        pool.shutdown()
    back_to_zero(url, engine, uv)


# --- constraints and tools ----------------------------------------------------------------------------

# properties not in alphabetical order (the output keeps the declared one), and \d \w (ASCII, as ECMA-262 reads them)
SCHEMA = {"type": "object", "properties": {"k": {"enum": [1, 2]}, "c": {"type": "string", "pattern": r"^\d\w$"}},
          "required": ["k", "c"]}  # fmt: skip
REGEX = r"\d\w{1,2}"
ASCII = {"c": r"[0-9][0-9A-Za-z_]", "regex": r"[0-9][0-9A-Za-z_]{1,2}"}  # what they may write
NEVER_END = {str(Tokenizer.byte_level().eos_id): -100}  # a model that does not stop by itself
GRAMMAR = 'start: "(" start ")" | "x"'
BAD_SCHEMAS = [
    {"type": "foo"},
    {"type": "array", "uniqueItems": True},
    {"$ref": "#/nope"},
    {"minimum": "a"},
    {"type": "number", "maximum": 3},
    {"type": "integer", "minimum": 5, "maximum": 1},
    [],
    "x",
    5,
]
BAD_GRAMMARS = [
    'start: "a" (',
    "start: b",
    'root ::= "a" x',
    "start: /(?<=a)b/",
    "%import os.X\nstart: X",
    'start: "a" start',
    "root ::= [z-a]",
    'root ::= "\\q"',
    "",
    "::=",
    LONE,
    'start: "' + LONE + '"',
]
BAD_REGEXES = ["(a", "a{2,1}", "(?<=a)b", "\\", "[", LONE, "a" * 100_001]
STRUCTURED = st.one_of(
    st.sampled_from([{"json": SCHEMA}, {"json_object": True}, {"regex": REGEX}, {"choice": ["yes", "no"]},
                     {"grammar": GRAMMAR}, {"grammar": 'root ::= "a" [0-9]?'}]),
    st.sampled_from([{}, {"regex": "a", "choice": ["b"]}, {"regx": "a"}, {"choice": []}, {"choice": [1]},
                     {"choice": [""]}, {"json": "{"}, {"json_object": 1}, *({"grammar": g} for g in BAD_GRAMMARS),
                     *({"regex": r} for r in BAD_REGEXES), *({"json": x} for x in BAD_SCHEMAS)]),
    ANY,
)  # fmt: skip
RESPONSE_FORMAT_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"},
                     RESPONSE_FORMAT_SCHEMA]),
    st.sampled_from([{"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "json_schema": {"name": 1}},
                     *({"type": "json_schema", "json_schema": {"name": "x", "schema": b}} for b in BAD_SCHEMAS),
                     {"type": "json_object", "extra": 1}, "json", []]),
    ANY,
)  # fmt: skip
GUIDED = {
    "guided_json": st.one_of(st.sampled_from([SCHEMA, *BAD_SCHEMAS, "{"]), ANY),
    "guided_regex": st.one_of(st.sampled_from([REGEX, *BAD_REGEXES]), ANY),
    "guided_choice": st.one_of(st.sampled_from([["a", "b"], [], [""], [1], ["x"] * 1025]), ANY),
    "guided_grammar": st.one_of(st.sampled_from([GRAMMAR, *BAD_GRAMMARS]), ANY),
}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
TOOLS = st.one_of(
    st.just([FUNCTION]),
    st.sampled_from([[], [{}], "f", [{"type": "function", "function": {"name": "a b"}}], [FUNCTION, FUNCTION],
                     [{"type": "retrieval"}], [{"type": "function", "function": {"name": "g", "parameters": {
                         "type": "object", "patternProperties": {}}}}], [{"type": "function", "function": {
                         "name": "g", "parameters": {"type": "foo"}}}]]),
    ANY,
)  # fmt: skip
TOOL_CHOICE = st.one_of(
    st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
    st.sampled_from(["always", {"type": "function"}, {"type": "function", "function": {"name": "nope"}}, {}]),
    ANY,
)
CONSTRAINT_FIELDS = {"response_format": RESPONSE_FORMAT, "structured_outputs": STRUCTURED, **GUIDED}


@st.composite
def constrained_body(draw) -> tuple[str, dict]:
    """(path, a short valid body with one or two constraint fields, or tools fields, drawn from valid and
    hostile values)."""
    chat = draw(st.booleans())
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"}
    body |= {"max_tokens": draw(st.sampled_from([1, 4, 12, 30])), "seed": draw(st.integers(0, 3))}
    for key in draw(st.lists(st.sampled_from(sorted(CONSTRAINT_FIELDS)), min_size=0, max_size=2, unique=True)):
        body[key] = draw(CONSTRAINT_FIELDS[key])
    if chat and draw(st.booleans()):
        body |= {"tools": draw(TOOLS), "tool_choice": draw(TOOL_CHOICE)}
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.one_of(st.booleans(), ANY))
        if draw(st.booleans()):  # calls until max_tokens cuts one (a call of FUNCTION is 40 to 50 tokens)
            body |= {"logit_bias": NEVER_END, "max_tokens": draw(st.sampled_from([30, 100]))}
    return (CHAT if chat else COMPLETIONS), body


# drawn rarely among the hostile values, so always sent: calls from a model that does not stop (cut at max_tokens,
# or one call), and the schema and regex written out whole
ASK = {"messages": [{"role": "user", "content": "hi"}], "seed": 1}
SURE = [
    (CHAT, ASK | {"tools": [FUNCTION], "tool_choice": "required", "logit_bias": NEVER_END, "max_tokens": 100}),
    (CHAT, ASK | {"tools": [FUNCTION], "tool_choice": "required", "logit_bias": NEVER_END, "max_tokens": 100,
                  "parallel_tool_calls": False}),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 30, "guided_json": SCHEMA}),
    (CHAT, ASK | {"max_tokens": 30, "response_format": RESPONSE_FORMAT_SCHEMA}),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 30, "structured_outputs": {"regex": REGEX}}),
]  # fmt: skip


def _examples(drawn: list):
    """Hypothesis's `example` for each of `drawn`."""

    def add(test):
        for d in reversed(drawn):
            test = example(drawn=d)(test)
        return test

    return add


def check_constrained(body: dict, choice: dict) -> None:
    """A 200 answer to `constrained_body`: what the constraint or the calls wrote, in the schema's order and
    with ASCII digits and word characters; complete calls are calls whatever ended the answer."""
    message = choice.get("message") or {}
    for call in message.get("tool_calls") or []:
        check_schema_output(call["function"]["arguments"])
    if message.get("tool_calls"):
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        if body.get("parallel_tool_calls") is False:
            assert len(message["tool_calls"]) == 1, message
        return
    text = message.get("content") if message else choice["text"]
    assert choice["finish_reason"] != "tool_calls" and isinstance(text, str), choice
    if body.get("tools") and body.get("tool_choice") != "none":
        assert "</tool_call>" not in text, f"a complete call left in the text: {choice}"
    if choice["finish_reason"] != "stop":  # (cut short: need not parse)
        return
    schema = (_get(body, "guided_json"), _get(body, "structured_outputs", "json"),
              _get(body, "response_format", "json_schema", "schema"))  # fmt: skip
    if SCHEMA in schema:
        check_schema_output(text)
    elif REGEX in (_get(body, "guided_regex"), _get(body, "structured_outputs", "regex")):
        assert re.fullmatch(ASCII["regex"], text), text


def _get(body, *keys):
    """body[k1][k2]...; None where a level is missing or not an object."""
    for key in keys:
        body = body.get(key) if isinstance(body, dict) else None
    return body


def check_schema_output(text: str) -> None:
    data = json.loads(text)
    assert list(data) == ["k", "c"] and re.fullmatch(ASCII["c"], data["c"]), text


def test_fuzzed_constraints_and_tools_are_a_400_naming_the_field_or_an_answer(server):
    url, engine, uv = server
    fields = {*CONSTRAINT_FIELDS, "tools", "tool_choice", "parallel_tool_calls"}

    @settings(max_examples=36, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(drawn=constrained_body())
    @_examples(SURE)
    def run(drawn):
        path, body = drawn
        r = httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                       timeout=COMPILING)  # fmt: skip
        assert r.status_code < 500, r.text
        data = _strict_json(r.text)
        if r.status_code != 200:
            check_error(r.status_code, data)
            param = data["error"]["param"] or ""
            assert param.split(".")[0] in fields and param.split(".")[0] in body, (param, body)
            return
        assert data["choices"] and all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in data["choices"])
        if path == CHAT:
            message = data["choices"][0]["message"]
            assert isinstance(message["content"], str) or message.get("tool_calls"), message
        for choice in data["choices"]:
            check_constrained(body, choice)

    # the largest automata first: the engine's grammar table grows to its size once, not a power of two at a time
    # (each growth compiles the engine's steps again)
    for body in ({"tools": [FUNCTION], "tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        body |= {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(url + CHAT, json=body, timeout=COMPILING).status_code == 200
    run()
    back_to_zero(url, engine, uv)


def test_a_client_that_left_or_ran_out_of_time_is_seen_while_tokens_keep_coming():
    """Found by the fuzzing: the disconnect and the deadline were checked only after a quiet 0.25 s, so an
    answer whose tokens kept coming ran to max_tokens after its client left, and past request_timeout_s."""

    class Client:
        def __init__(self, gone):
            self.gone = gone

        async def is_disconnected(self):
            return self.gone

    async def main():
        job = Job(None, ServeConfig(), [[1]], None, None, responses.COMPLETION, NAME, False, False)
        job.updates.put_nowait("a snapshot")  # an update is there at once: no quiet wait
        with pytest.raises(ClientGone):
            await job._next_update(Client(gone=True), None)
        job.updates.put_nowait("a snapshot")
        with pytest.raises(TimeoutError):
            await job._next_update(Client(gone=False), time.monotonic() - 1)
        job.updates.put_nowait("a snapshot")
        assert await job._next_update(Client(gone=False), time.monotonic() + TIMEOUT) == "a snapshot"

    asyncio.run(main())
