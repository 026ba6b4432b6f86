"""Structured output and tool calls through the doors: the HTTP server (the official `openai` client and raw
HTTP) and the batch job. One live server over a random-weight byte-level model; bounded schemas, so that the
model completes each within max_tokens."""

import concurrent.futures
import json
import re
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from jaxgen.inference import structured
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.structured import compiler
from jaxgen.serving import chat, protocol, structured_fields, tools
from jaxgen.serving.batch_job import run_job
from jaxgen.serving.chat import ChatTemplate
from jaxgen.serving.server import create_app
from tests.live import live_server, serving, tiny_engine

NAME = "tiny"
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
}


MANY_OPTIONAL = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(200)}}  # a 1.4 MB regex


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def stack():
    engine, _ = tiny_engine()
    engine.grammars.reserve(1024)  # its steps compile for one grammar table, not again at each growth
    with live_server(engine, create_app(engine, NAME)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, url, engine


def _format(schema) -> dict:
    """OpenAI's response_format for a JSON schema."""
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def _post(url, path, body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_openai_parse_returns_the_pydantic_object(stack):
    client, _, _ = stack
    messages = [{"role": "user", "content": "a pet"}]
    out = client.chat.completions.parse(model=NAME, messages=messages, response_format=Pet, max_tokens=200, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet), choice.message.content


def test_completions_regex_choice_and_guided_json(stack):
    client, _, _ = stack
    out = client.completions.create(model=NAME, prompt="when: ", max_tokens=20, seed=2,
                                    extra_body={"structured_outputs": {"regex": DATE}})  # fmt: skip
    assert re.fullmatch(DATE, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "peut-être"]
    out = client.completions.create(model=NAME, prompt="ok? ", max_tokens=20, n=3, seed=3,
                                    extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert all(c.text in choices for c in out.choices)
    out = client.completions.create(model=NAME, prompt="{", max_tokens=60, seed=4, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


# properties in the order the model should think in (not alphabetical); \d, \w and a format's digits ASCII
ORDERED = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^\\d\\w$"}, "day": {"type": "string", "format": "date"},
                   "answer": {"enum": [1, 2]}},
    "required": ["zone", "day", "answer"],
}  # fmt: skip
NON_ASCII = {str(b): 100 for b in (0xD9, 0xDB, 0xE0, 0xF0)}  # lead bytes of Arabic, Devanagari, Wancho... digits


def test_schema_keys_in_declared_order_and_ecma_classes(stack):
    """Issue 44: the keys come in the schema's order (not sorted), and a `pattern`'s or a `format`'s \\d and \\w
    are ECMA-262's, ASCII, as are a regex constraint's: a bias toward non-ASCII digits' bytes finds none."""
    client, _, _ = stack
    kw = dict(model=NAME, messages=[{"role": "user", "content": "go"}], seed=3, max_tokens=80, logit_bias=NON_ASCII)
    out = client.chat.completions.create(**kw, response_format=_format(ORDERED))
    choice = out.choices[0]
    data = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and list(data) == ["zone", "day", "answer"], choice.message.content
    assert re.fullmatch(r"[0-9][0-9A-Za-z_]", data["zone"]) and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", data["day"])
    out = client.completions.create(model=NAME, prompt="code: ", max_tokens=20, seed=2, logit_bias=NON_ASCII,
                                    extra_body={"guided_regex": r"\d{3}\w"})  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}[0-9A-Za-z_]", out.choices[0].text), out.choices[0].text


def test_streamed_schema_reassembles_to_valid_json(stack):
    client, _, _ = stack
    fmt = _format(SCHEMA)
    chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "go"}], seed=5,
                                            max_tokens=60, response_format=fmt, stream=True)  # fmt: skip
    text, finish = "", None
    for c in chunks:
        text += c.choices[0].delta.content or ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "guided_regex and guided_choice both"),
        (
            {"response_format": _format({"type": "array", "uniqueItems": True})},
            "response_format",
            "'uniqueItems' at # is not supported",
        ),
        ({"structured_outputs": {"grammar": 'start: "a" ('}}, "structured_outputs", "Lark grammar: Unclosed paren"),
        ({"guided_grammar": 'start: a\na: "x" b'}, "guided_grammar", "Rule 'b' used but not defined"),
        ({"guided_grammar": 'root ::= "a" x'}, "guided_grammar", "the rule 'x' is used (in 'root') but not defined"),
        ({"guided_grammar": "start: /a(?=b)/"}, "guided_grammar", "uses a lookaround"),
        ({"guided_grammar": "%import os.X\nstart: X"}, "guided_grammar", "only lark's own common and unicode"),
        ({"guided_grammar": 'start: "a" start'}, "guided_grammar", "derives no finite text"),
        (
            {"guided_grammar": 'start: s\ns: "(" ' + "s " * 150 + '")" | "x"'},
            "guided_grammar",
            "is a regular expression of more than 1000000 characters",
        ),
        ({"guided_grammar": 5}, "guided_grammar", "should be a valid string"),
        ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "unknown structured field 'regx'"),
        ({"guided_regex": "(a"}, "guided_regex", "does not compile"),
        ({"guided_json": "{not json"}, "guided_json", "is not JSON"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs"),
        ({"guided_json": {"type": "object", "x": 1}}, "guided_json", "'x' at # is not supported"),
        ({"guided_json": MANY_OPTIONAL}, "guided_json", "1388605 characters; at most 1000000"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_clients_field(stack, body, param, says):
    _, url, _ = stack
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


ARITH = """
?start: expr
?expr: expr "+" term | expr "-" term | term
?term: term "*" factor | factor
?factor: DIGIT | "(" expr ")"
DIGIT: /[1-9]/
"""  # left-recursive


def test_a_grammar_constrains_completions_and_chat(stack):
    import lark

    client, url, _ = stack
    parser = lark.Lark(ARITH, parser="earley", lexer="dynamic_complete")
    out = client.completions.create(model=NAME, prompt="1+", max_tokens=60, n=2, seed=9,
                                    extra_body={"structured_outputs": {"grammar": ARITH}})  # fmt: skip
    for c in out.choices:
        assert c.finish_reason == "stop", c.text
        parser.parse(c.text)
    gbnf = 'root ::= ("yes" | "no") " " [0-9]'
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "sum"}], "max_tokens": 60,
                                            "guided_grammar": gbnf, "seed": 1})  # fmt: skip
    assert re.fullmatch("(yes|no) [0-9]", r.json()["choices"][0]["message"]["content"]), r.text


def test_response_format_text_is_free_and_json_object_is_an_object(stack):
    _, url, _ = stack
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                            "response_format": {"type": "text"}})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                                            "response_format": {"type": "json_object"}, "seed": 3})  # fmt: skip
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice["message"]["content"].startswith("{")


def test_hostile_constraints_are_refused_or_bounded(stack, monkeypatch):
    _, url, engine = stack
    huge = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40_000)}}  # over 1 MB
    r = _post(url, "/v1/completions", {"prompt": "x", "guided_json": huge})
    assert r.status_code == 400 and "at most 100000" in r.json()["error"]["message"]
    for rx in ("(a|aa)*b", "(x+x+)+y"):  # backtracking regexes: a DFA does not backtrack
        r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 30, "guided_regex": rx, "seed": 1})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" or re.fullmatch(rx, choice["text"]), r.text
    many = [f"v{i}" for i in range(10_000)]
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 12, "guided_json": {"enum": many}})
    assert json.loads(r.json()["choices"][0]["text"]) in many
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 30}
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 5, "guided_json": digits})  # needs 61 tokens
    assert r.json()["choices"][0]["finish_reason"] == "length"
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 3.0)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # while it compiles, free requests are served
        exploding = pool.submit(_post, url, "/v1/completions", {"prompt": "x", "guided_regex": "(a|b)*a(a|b){24}"})
        time.sleep(0.3)
        free = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert free.status_code == 200 and not exploding.done()
        r = exploding.result()
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    one = time.monotonic() - start
    assert one < 20
    start = time.monotonic()  # the same again: refused at once, the compile worker not held a second time
    r = _post(url, "/v1/completions", {"prompt": "y", "guided_regex": "(a|b)*a(a|b){24}"})
    assert r.status_code == 400 and "did not compile" in r.json()["error"]["message"]
    assert time.monotonic() - start < 1.5
    start = time.monotonic()  # another one sent 4 times at once: compiled once (4 times in a row before issue 44)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: _post(url, "/v1/completions", {"prompt": "z", "guided_regex": "(a|b)*a(a|b){25}"}),
                           range(4)))  # fmt: skip
    assert all(r.status_code == 400 and "did not compile" in r.json()["error"]["message"] for r in rs)
    assert time.monotonic() - start < 2 * one
    assert httpx.get(f"{url}/health").status_code == 200
    assert engine.pool.in_use() == 0 and engine.idle()


def test_batch_job_takes_a_constraint_per_line(tmp_path):
    engine, _ = tiny_engine()
    lines = [
        {"id": "good", "prompt": "x", "response_format": _format(SCHEMA)},
        {"id": "choice", "prompt": "y", "structured": {"choice": ["up", "down"]}},
        {"id": "bad", "prompt": "x", "response_format": _format({"type": "object", "patternProperties": {}})},
        {"id": "both", "prompt": "x", "structured": {"regex": "a"}, "guided_regex": "b"},
        {"id": "grammar", "prompt": "x", "guided_grammar": 'root ::= ("up" | "down") [0-9]'},
        {"id": "bad grammar", "prompt": "x", "structured_outputs": {"grammar": "start: nothing"}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_job(engine, inp, out, SamplingConfig(max_new_tokens=60, seed=1))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert summary["requests"] == 3 and summary["errors"] == 3
    jsonschema.validate(json.loads(records["good"]["choices"][0]["text"]), SCHEMA)
    assert records["choice"]["choices"][0]["text"] in ("up", "down")
    assert records["bad"]["error"].startswith("response_format: ") and "patternProperties" in records["bad"]["error"]
    assert "both constrain the output" in records["both"]["error"]
    assert re.fullmatch("(up|down)[0-9]", records["grammar"]["choices"][0]["text"])
    assert records["bad grammar"]["error"].startswith("structured_outputs: structured.grammar: not a Lark grammar")


# --- tool calls -------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
SMALL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}  # fmt: skip
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _validate_call(call):
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert re.fullmatch(r"call_[0-9a-f]+", call.id) and call.type == "function"


def test_tool_choice_required_and_named_return_valid_calls(stack):
    client, _, _ = stack
    out = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                         max_tokens=200)  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert 1 <= len(choice.message.tool_calls) <= tools.MAX_CALLS
    for call in choice.message.tool_calls:
        _validate_call(call)
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, seed=2,
                                         max_tokens=200)  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _validate_call(call)


def test_required_answers_several_calls_each_with_its_id_whole_and_streamed(stack, monkeypatch):
    client, _, engine = stack
    monkeypatch.setattr(tools, "MAX_CALLS", 2)  # two short calls fit the tiny model's context
    kw = dict(model=NAME, messages=ASK, tools=[SMALL, CLOCK], tool_choice="required", max_tokens=200, seed=4,
              logit_bias=_never_end(engine))  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 2, choice
    for call in choice.message.tool_calls:
        schema = SMALL if call.function.name == "f" else CLOCK
        jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])
    assert len({c.id for c in choice.message.tool_calls}) == 2
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices[0].delta.tool_calls or []:
            got = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            got["name"] += c.function.name or ""
            got["arguments"] += c.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # fmt: skip
    assert calls[0]["id"] != calls[1]["id"]


def _never_end(engine) -> dict:
    """A logit_bias that makes the model one that does not stop by itself: the end-of-sequence token is drawn
    only where a constraint allows nothing else."""
    return {str(engine.tokenizer.eos_id): -100}


def _streamed(chunks) -> tuple[list[tuple[str, str]], str, str | None, int]:
    """A chat stream's (calls as (name, arguments), text, finish_reason, completion tokens)."""
    calls: dict[int, dict] = {}
    text, finish, used = "", None, 0
    for chunk in chunks:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for c in choice.delta.tool_calls or []:
                got = calls.setdefault(c.index, {"name": "", "arguments": ""})
                got["name"] += c.function.name or ""
                got["arguments"] += c.function.arguments or ""
    return [(c["name"], c["arguments"]) for c in calls.values()], text, finish, used


def _whole(out) -> tuple[list[tuple[str, str]], str, str | None, int]:
    """An answer's (calls, text, finish_reason, completion tokens), as `_streamed` gives a stream's."""
    choice = out.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return calls, choice.message.content or "", choice.finish_reason, out.usage.completion_tokens


def test_an_answer_cut_at_max_tokens_keeps_its_complete_calls_whole_and_streamed(stack):
    """Issue 44: a model that does not stop by itself writes calls until max_tokens. The complete ones are the
    answer's tool_calls, the one it was cut in is dropped, and finish_reason says "length"."""
    client, _, engine = stack
    kw = dict(model=NAME, messages=ASK, tools=[SMALL], tool_choice="required", max_tokens=90, seed=4,
              logit_bias=_never_end(engine))  # fmt: skip
    calls, text, finish, used = whole = _whole(client.chat.completions.create(**kw))
    assert finish == "length" and used == 90 and text == "", whole  # one call is at most 65 tokens, two 115
    assert len(calls) == 1 and json.loads(calls[0][1]) in ({"x": 1}, {"x": 2}), whole
    streamed = _streamed(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed == whole


def test_parallel_tool_calls_false_ends_the_answer_after_one_call(stack):
    """Issue 44: with a model that does not stop by itself, "required" and a named function end the answer after
    one call (the constraint allows only the end after it), whole and streamed; "auto" keeps the first call."""
    client, _, engine = stack
    kw = dict(model=NAME, messages=ASK, tools=[SMALL, CLOCK], max_tokens=150, seed=5, logit_bias=_never_end(engine),
              parallel_tool_calls=False)  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        calls, text, finish, used = whole = _whole(client.chat.completions.create(**kw, tool_choice=choice))
        assert finish == "tool_calls" and len(calls) == 1 and used < 80 and text == "", whole
        streamed = client.chat.completions.create(**kw, tool_choice=choice, stream=True,
                                                  stream_options={"include_usage": True})  # fmt: skip
        assert _streamed(streamed) == whole
    said = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
    forced = kw | {"extra_body": {"guided_regex": re.escape(said * 2)}}  # "auto": what the model wrote is parsed
    calls, text, finish, _ = _whole(client.chat.completions.create(**forced))
    assert (calls, text, finish) == ([("f", '{"x": 1}')], "", "tool_calls")
    assert _streamed(client.chat.completions.create(**forced, stream=True))[:3] == (calls, text, finish)


def test_streamed_tool_call_reassembles_to_the_same_call(stack):
    client, _, _ = stack
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            got = calls.setdefault(c.index, {"name": "", "arguments": ""})
            got["name"] += c.function.name or ""
            got["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert calls == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


def test_tool_choice_none_gives_text_and_history_with_calls_renders(stack):
    client, _, _ = stack
    out = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    assert isinstance(out.choices[0].message.content, str)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, answer]
    out = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "patternProperties": {}}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ],
)  # fmt: skip
def test_a_bad_tools_request_is_a_400_naming_the_field(stack, body, param):
    _, url, _ = stack
    r = _post(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_parses_calls_out_of_the_text_whole_and_streamed(stack):
    client, _, _ = stack
    said = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=80, extra_body={"guided_regex": re.escape(said)})
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.content is None and json.loads(message.tool_calls[0].function.arguments) == {"zone": 3}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the call's text is held back
    (call,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert call.function.name == "get_time" and chunks[-1].choices[0].finish_reason == "tool_calls"


def _tools(fmt):
    return tools.Tools([protocol.Tool.model_validate(t) for t in TOOLS], "auto", fmt)


@pytest.mark.parametrize(
    "text, calls",
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>', [("get_time", {"zone": 1})]),
        ('Let me look.<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>\n<tool_call>{"name": '
         '"get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>',
         [("get_time", {"zone": 1}), ("get_weather", {"city": "Oslo", "unit": "c"})]),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": 1}}', None),  # unclosed: cut at max_tokens
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None),  # not one of the tools
        ("<tool_call>not json</tool_call>", None),
        ("just text", None),
    ],
)  # fmt: skip
def test_hermes_calls_parse_only_when_whole(text, calls):
    got = _tools(tools.HERMES).parse(text)
    assert (got and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]) == calls


def test_llama3_calls_and_the_format_rule():
    t = _tools(tools.LLAMA3)
    got = t.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": -2}}; {"name": "get_weather", '
                  '"parameters": {"city": "a;b", "unit": "f"}}')  # fmt: skip
    assert [json.loads(c["function"]["arguments"]) for c in got] == [{"zone": -2}, {"city": "a;b", "unit": "f"}]
    assert t.parse('The answer is {"name": "get_time"}') is None
    assert tools.format_of("{{ '<tool_call>' }}{{ tools | tojson }}") == tools.HERMES
    assert tools.format_of('{"name": function name, "parameters": ...}') == tools.LLAMA3
    assert tools.format_of(None) == tools.HERMES
    regex = tools.Tools(t.tools, "required", tools.LLAMA3).constraint().regex
    call = '{"name":"get_time","parameters":{"zone":12}}'
    assert re.fullmatch(regex, call) and re.fullmatch(regex, f"{call}; {call}")
    assert [c["function"]["arguments"] for c in t.parse(f"{call}; {call}")] == ['{"zone": 12}'] * 2
    assert not re.fullmatch(regex, "; ".join([call] * (tools.MAX_CALLS + 1)))
    single = tools.Tools(t.tools, "required", tools.LLAMA3, parallel=False).constraint().regex
    assert re.fullmatch(single, call) and not re.fullmatch(single, f"{call}; {call}")


@pytest.mark.parametrize("fmt", tools.FORMATS, ids=lambda f: f.name)
def test_each_format_in_the_table_is_found_constrains_parses_and_streams_its_calls(fmt):
    """The formats table drives every step for each family: a template naming its marker selects it, the
    text it writes for two calls fits the "required" constraint (built from the tools' schemas), parses
    back to those calls (and under no other format), and is held back whole from a stream."""
    calls = [("get_time", {"zone": -3}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert tools.format_of(f"{{{{ messages }}}} {fmt.markers[0]} {{{{ tools }}}}") is fmt
    required = tools.Tools([protocol.Tool.model_validate(t) for t in TOOLS], "required", fmt)
    text = fmt.render(calls)
    assert re.fullmatch(required.constraint().regex, text)
    assert not re.fullmatch(required.constraint().regex, fmt.render([("get_time", {"zone": 13})]))  # the bounds
    parsed = _tools(fmt).parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert [f for f in tools.FORMATS if f.parse(text) is not None] == [fmt]
    stream = _tools(fmt).streamer()
    assert "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)) == ""
    rest, streamed, finish = stream.end("stop")
    assert (rest, finish) == ("", "tool_calls") and [c["function"] for c in streamed] == [c["function"] for c in parsed]


def test_a_stream_holds_back_text_from_where_a_call_may_start():
    s = _tools(tools.HERMES).streamer()
    pieces = ["Sure", ". <tool", "_ca", 'll>{"name": "get_time", "arguments": {"zone": 0}}</tool_call>']
    assert [s.feed(p) for p in pieces] == ["Sure", ". ", "", ""]
    rest, calls, finish = s.end("stop")
    assert rest == "" and calls[0]["function"]["name"] == "get_time" and finish == "tool_calls"
    s = _tools(tools.HERMES).streamer()
    assert s.feed("a <tool") == "a " and s.end("length") == ("<tool", None, "length")  # no call: the text goes out


def test_the_template_gets_the_tools():
    template = ChatTemplate("{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}")
    assert template.render([{"role": "user", "content": "hi"}], TOOLS) == "get_weather;get_time;hi"
    said = ChatTemplate("{{ tools[0] | tojson }}").render([], [{"function": {"description": "it's <b> & é"}}])
    assert said == '{"function": {"description": "it\'s <b> & é"}}'  # as transformers writes it, not HTML-escaped


class GetPet(BaseModel):
    """Looks a pet up."""

    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_the_clients_stream_helpers_parse_the_output_and_the_call(stack):
    client, _, _ = stack
    with client.chat.completions.stream(model=NAME, messages=ASK, response_format=Pet, max_tokens=200, seed=6) as s:
        assert isinstance(s.get_final_completion().choices[0].message.parsed, Pet)
    tool = openai.pydantic_function_tool(GetPet)
    with client.chat.completions.stream(model=NAME, messages=ASK, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, seed=7) as s:  # fmt: skip
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert isinstance(final.message.tool_calls[0].function.parsed_arguments, GetPet)


QWEN_LIKE = """
{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\nReturn each call as <tool_call>\n{"name": <function-name>, "arguments": <args>}\n</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}{{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}{{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>' + message.content + '</tool_response><|im_end|>\n' }}
    {%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}{{- '<|im_start|>assistant\n' }}
"""  # the shape of Qwen2.5's template, which writes calls as it reads them back


def test_a_qwen_like_template_renders_tools_and_earlier_calls_as_hermes():
    assert tools.format_of(QWEN_LIKE) == tools.HERMES
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    assistant = protocol.Message.model_validate({"role": "assistant", "tool_calls": [call]})
    answer = protocol.Message.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "12:00"})
    messages = [chat.template_message(0, protocol.Message.model_validate(ASK[0])), chat.template_message(1, assistant),
                chat.template_message(2, answer)]  # fmt: skip
    text = ChatTemplate(QWEN_LIKE).render(messages, TOOLS)
    assert json.dumps(WEATHER) in text and "<tool_response>12:00</tool_response>" in text
    written = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert _tools(tools.HERMES).parse(written)[0]["function"]["arguments"] == '{"zone": 1}'


LLAMA_LIKE = """{{- bos_token if bos_token is defined else '' }}
{%- if tools %}{{- 'Answer {"name": ..., "parameters": {...}} or <|python_tag|>:\\n' }}
    {%- for t in tools %}{{- t.function.name + '\\n' }}{%- endfor %}
{%- endif %}
{%- for m in messages %}{{- '<' + m.role + '>' + (m.content or '') + '\\n' }}{%- endfor %}<assistant>"""


def test_a_llama3_family_gets_and_parses_llama3_calls(stack):
    _, _, engine = stack
    tok = engine.tokenizer
    template, tok.chat_template = tok.chat_template, LLAMA_LIKE
    try:
        app = create_app(engine, NAME)  # a second app over the same engine, with a Llama-3-like template
    finally:
        tok.chat_template = template
    with serving(app) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=200, seed=8)
        one = dict(tool_choice="required", parallel_tool_calls=False)
        (call,) = client.chat.completions.create(**kw, **one).choices[0].message.tool_calls
        _validate_call(call)
        said = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}'
        forced = kw | {"extra_body": {"guided_regex": re.escape(said)}}
        message = client.chat.completions.create(**forced).choices[0].message
        assert message.content is None and json.loads(message.tool_calls[0].function.arguments)["city"] == "Rome"
        chunks = list(client.chat.completions.create(**forced, stream=True))
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        (streamed,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert streamed.function.arguments == message.tool_calls[0].function.arguments


# one example value of each kind of structured.KINDS, as a client sends it
KIND_EXAMPLES = {"json": {"type": "string"}, "regex": "[ab]", "choice": ["yes", "no"], "grammar": 'start: "a"'}


def test_the_server_takes_exactly_the_constraint_kinds_of_the_spec():
    """The kinds a client may send (guided_<kind>, structured_outputs' keys, the batch job's fields) are
    Structured's fields, read once as KINDS: each reaches Structured as that kind."""
    guided = {f.removeprefix("guided_") for f in protocol.GenerationRequest.model_fields if f.startswith("guided_")}
    assert guided == set(structured.KINDS) == set(KIND_EXAMPLES)
    assert set(structured_fields.FIELDS) <= set(protocol.GenerationRequest.model_fields)  # completions' and chat's
    for kind, value in KIND_EXAMPLES.items():
        body = protocol.CompletionRequest.model_validate({"prompt": "x", f"guided_{kind}": value})
        via_guided, field = structured_fields.requested(body)
        via_outputs, _ = structured_fields.requested({"structured_outputs": {kind: value}})
        assert field == f"guided_{kind}" and via_guided == via_outputs
        assert [k for k in structured.KINDS if getattr(via_guided, k) is not None] == [kind]
