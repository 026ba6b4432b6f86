"""The HTTP server, through the official `openai` client and raw HTTP, against `Generator` results."""

import concurrent.futures
import contextlib
import copy
import dataclasses
import json
import signal
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from jaxgen.inference.generator import Generator
from jaxgen.inference.precompile import precompile
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.serving.server import create_app
from tests.live import CFG, TEMPLATE, live_server, tiny_engine

NAME = "tiny"


@pytest.fixture(scope="module")
def stack():
    """A live server on 127.0.0.1 (uvicorn in a thread, the engine in another) and a Generator. The engine's
    programs are compiled before it starts, as serve.py http does (`jaxgen.inference.precompile`)."""
    engine, params = tiny_engine()
    precompile(engine)
    with live_server(engine, create_app(engine, NAME)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, url, engine, Generator(params, CFG, engine.tokenizer, max_batch=64, chunk_steps=16)


@contextlib.contextmanager
def held(engine, when=lambda: True):
    """Holds the engine thread before any step at which `when()` is true, until the block exits: a
    request is then surely still queued or running, however fast or slow the machine is."""
    gate = threading.Event()
    real = engine.step

    def step():
        if when():
            gate.wait()
        real()

    engine.step = step
    try:
        yield
    finally:
        del engine.step  # the class's step again
        gate.set()


def _wait_for(condition, timeout=120.0):
    """Polls a condition that must come true (a generous bound: a failure, not a timing assumption)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0.02)


def _want(gen, prompt, **kw):
    return gen.generate([prompt], SamplingConfig(**kw))


def test_models_and_health(stack):
    client, url, _, _ = stack
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_greedy_completion_equals_generate(stack):
    client, _, _, gen = stack
    out = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=20, temperature=0)
    (want,) = _want(gen, "def fib(n):", max_new_tokens=20, temperature=0.0)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    assert out.usage.completion_tokens == len(want.tokens) and out.usage.prompt_tokens == len("def fib(n):")
    echo = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=20, temperature=0, echo=True)
    assert echo.choices[0].text == "def fib(n):" + want.text


def test_chat_completion_uses_the_chat_template(stack):
    client, _, _, gen = stack
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    (want,) = _want(gen, "<system>Be brief.\n<user>Hi\n<assistant>", max_new_tokens=16, temperature=0.0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text


def test_streaming_equals_the_whole_response(stack):
    client, _, _, _ = stack
    kw = dict(
        model=NAME, prompt="import numpy", max_tokens=30, temperature=0.9, seed=11, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
    assert len(pieces) > 2 and "".join(pieces) == whole
    messages = [{"role": "user", "content": "stream please"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    deltas = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content


def test_logprobs_n_seed_and_stop(stack):
    client, _, _, gen = stack
    out = client.completions.create(model=NAME, prompt="x = ", max_tokens=10, temperature=0, logprobs=2)
    (want,) = _want(gen, "x = ", max_new_tokens=10, temperature=0.0, logprobs=2)
    lp = out.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, want.logprobs, atol=1e-4)
    assert all(len(alts) == 2 for alts in lp.top_logprobs) and len(lp.tokens) == len(want.tokens)
    many = client.completions.create(model=NAME, prompt="for i in", max_tokens=12, temperature=1.0, n=3, seed=7)
    wants = _want(gen, "for i in", max_new_tokens=12, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [w.text for w in wants]
    stop = wants[0].text[3:5]
    cut = client.completions.create(model=NAME, prompt="for i in", max_tokens=12, temperature=1.0, seed=7, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == wants[0].text[: wants[0].text.find(stop)]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "a"}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_64_concurrent_requests_equal_their_results_alone(stack):
    client, _, engine, gen = stack
    rng = np.random.default_rng(0)
    jobs = [
        dict(prompt="".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(n))), max_tokens=int(m),
             temperature=float(t), seed=int(s))
        for n, m, t, s in zip(rng.integers(1, 150, 64), rng.integers(1, 40, 64), rng.choice([0.0, 0.8], 64),
                              rng.integers(0, 99, 64), strict=True)
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda j: client.completions.create(model=NAME, **j).choices[0], jobs))
    wants = gen.generate(
        [j["prompt"] for j in jobs],
        [SamplingConfig(max_new_tokens=j["max_tokens"], temperature=j["temperature"], seed=j["seed"]) for j in jobs],
    )
    for out, want in zip(outs, wants, strict=True):
        assert (out.text, out.finish_reason) == (want.text, want.finish_reason)
    assert engine.pool.in_use() == 0


def test_prefix_cache_hit_is_visible_in_metrics(stack):
    client, url, _, gen = stack
    system = "You are a helpful assistant that answers in Python. " * 2  # 106 tokens: 6 whole pages
    before = _metric(url, "jaxgen_prefix_cache_hit_tokens_total")
    first = client.completions.create(model=NAME, prompt=system + "Q1", max_tokens=8, temperature=0)
    second = client.completions.create(model=NAME, prompt=system + "Q2", max_tokens=8, temperature=0)
    assert _metric(url, "jaxgen_prefix_cache_hit_tokens_total") - before == 6 * 16
    for out, prompt in ((first, system + "Q1"), (second, system + "Q2")):
        assert out.choices[0].text == _want(gen, prompt, max_new_tokens=8, temperature=0.0)[0].text
    text = httpx.get(f"{url}/metrics").text
    for name in ("queue_length", "running_slots", "tokens_per_second", "cache_pages_in_use", "prefix_cache_hit_rate"):
        assert f"# TYPE jaxgen_{name} gauge" in text
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "request_latency_seconds"):
        assert f"# TYPE jaxgen_{name} histogram" in text and f'jaxgen_{name}_bucket{{le="+Inf"}}' in text
    for name in ("requests", "requests_finished", "requests_preempted", "generated_tokens", "prefix_cache_hit_tokens"):
        assert f"# TYPE jaxgen_{name}_total counter" in text
    assert _metric(url, "jaxgen_requests_finished_total") >= 2 and _metric(url, "jaxgen_requests_preempted_total") == 0


def test_speculative_requests_answer_as_plain_ones_and_show_in_metrics(stack):
    """The extension field num_speculative_tokens: the same text as without it, the drafts counted in
    /metrics; a bad value is a 400 naming the field and what is allowed."""
    client, url, _, gen = stack
    before = _metric(url, "jaxgen_spec_draft_tokens_total")
    prompt = "abcabcabcabcabcabcabc"
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"num_speculative_tokens": 4}
    )
    assert out.choices[0].text == _want(gen, prompt, max_new_tokens=12, temperature=0.0)[0].text
    assert _metric(url, "jaxgen_spec_draft_tokens_total") > before
    assert 0 <= _metric(url, "jaxgen_spec_acceptance_rate") <= 1
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "num_speculative_tokens": 99})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_speculative_tokens"
    assert "an integer in [0, 8]" in bad.json()["error"]["message"]


def test_a_mixed_workload_after_precompile_compiles_nothing(stack):
    """After `precompile`, short and long prompts (several prefill chunks), n > 1, logprobs, echo (the prompt
    scored), stop strings, penalties, speculation and structured output (a schema, a regex: the grammar table
    holds serve.grammar_states from the start) compile no program: no request waits for one."""
    _, url, _, _ = stack
    before = _compiles(url)
    assert before[("decode_chunk", "before_ready")] == 1 and ("decode_chunk", "after_ready") not in before
    long = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 2  # 3 chunks
    bodies = [
        {"prompt": "a", "max_tokens": 3},
        {"prompt": long, "max_tokens": 3, "n": 2, "temperature": 0.9, "seed": 3, "logprobs": 2},
        {"prompt": long[:40], "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "abcabcabcabc", "max_tokens": 6, "num_speculative_tokens": 7, "stop": ["zz"]},
        {"prompt": "x = ", "max_tokens": 4, "presence_penalty": 0.5, "num_speculative_tokens": 1},
        {"prompt": "n: ", "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        {"prompt": "p: ", "max_tokens": 12, "num_speculative_tokens": 2, "response_format": {"type": "json_schema",
         "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                 "required": ["ok"]}}}},
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        for r in pool.map(lambda body: _post(url, body), bodies):
            assert r.status_code == 200, r.text
    assert _compiles(url) == before


def test_compilations_after_ready_are_named_in_metrics(stack):
    """jaxgen_compiles_total{program, phase}: the start's programs before ready; a program compiled for a
    request after ready is counted by its name; the same request again compiles nothing; the labelled
    counts add up to the engine's own trace counter."""
    client, url, engine, _ = stack
    assert _compiles(url)[("init_state", "before_ready")] == 1
    engine.runner._admit_rows.jitted.clear_cache()  # admit_rows is then new to jax, whatever ran before (precompile)
    before = _compiles(url)
    client.completions.create(model=NAME, prompt="compile me", max_tokens=2, temperature=0)
    after = _compiles(url)
    assert after.get(("admit_rows", "after_ready"), 0) - before.get(("admit_rows", "after_ready"), 0) == 1
    client.completions.create(model=NAME, prompt="compile me", max_tokens=2, temperature=0)
    assert _compiles(url) == after  # a shape seen before: nothing compiles
    assert sum(after.values()) == engine.compilations
    text = httpx.get(f"{url}/metrics").text
    assert 'jaxgen_compile_seconds_total{phase="after_ready",program="admit_rows"}' in text


def _compiles(url) -> dict[tuple[str, str], float]:
    """{(program, phase): compilations} from /metrics' jaxgen_compiles_total."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("jaxgen_compiles_total{"):
            labels, value = line[len("jaxgen_compiles_total{") :].split("} ")
            fields = dict(item.split("=") for item in labels.split(","))
            out[(fields["program"].strip('"'), fields["phase"].strip('"'))] = float(value)
    return out


def _metric(url, name):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature=-1.0 is not allowed: a number in [0,"),
        (
            {"prompt": "x", "max_tokens": -1},
            "max_tokens",
            "max_tokens=-1 is not allowed: an integer in [0, 2147483647]",
        ),
        ({"prompt": "x", "colour": "blue"}, "colour", "Extra inputs are not permitted"),
        ({"max_tokens": 3}, "prompt", "Field required"),
        ({"prompt": "x" * 300}, "prompt", "the prompt has 300 tokens; the model's context is 256"),
        ({"prompt": "x", "logprobs": 9}, "logprobs", "logprobs=9 is not allowed: at most 5"),
    ],
)
def test_bad_requests_get_400_naming_the_field(stack, body, field, message):
    _, url, _, _ = stack
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and message in error["message"]


def test_api_key_is_required_when_set(stack):
    engine = stack[2]
    from fastapi.testclient import TestClient

    with TestClient(create_app(engine, NAME, api_key="s3cret")) as tc:
        assert tc.get("/v1/models").status_code == 401
        assert tc.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert tc.get("/health").status_code == 200


def test_client_disconnect_frees_slot_and_pages(stack):
    _, url, engine, _ = stack
    body = {"prompt": "long story", "max_tokens": 240, "temperature": 0.8, "stream": True, "ignore_eos": True}
    cancelled = engine.metrics()["requests_cancelled"]
    with held(engine, when=lambda: any(engine.slots)):  # running: it cannot finish while held
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator would close the connection at once
            next(lines)  # the stream has started
            _wait_for(lambda: any(s is not None and s.status == "running" for s in engine.slots))
            assert engine.pool.in_use() > 0
        _wait_for(lambda: all(s is None or s.status == "cancelled" for s in engine.slots))
    _wait_for(lambda: not engine.pool.in_use() and not any(engine.slots))
    assert engine.metrics()["requests_cancelled"] == cancelled + 1


def test_serve_py_http_command(tiny_run):
    """`python serve.py http` as a user starts it: a real process, the key required, greedy = generate."""
    import subprocess
    import sys

    import jaxgen
    from tests.conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "serve.py", "http", "--checkpoint", str(tiny_run), "--port", str(port), "--slots", "2",
           "--kv-memory-gb", "0.05", "--api-key", "k3y", "--shutdown-grace", "0", "serve.precompile=false"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [tiny_run.name]
        out = client.completions.create(model=tiny_run.name, prompt="def ", max_tokens=6, temperature=0)
        (want,) = jaxgen.generate(tiny_run, ["def "], SamplingConfig(max_new_tokens=6, temperature=0.0))
        assert out.choices[0].text == want.text
        wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        # SIGTERM with a stream open: the stream still ends (a final event, then [DONE]) and the server exits
        body = {"prompt": "def ", "max_tokens": 10_000, "stream": True, "ignore_eos": True}
        headers = {"Authorization": "Bearer k3y"}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- hardening: no request hurts another, every stream ends, the OpenAI error shape everywhere ---------


def _post(url, body, **kw):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120, **kw)


def _sse_events(url, body, path="/v1/completions"):
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in r.iter_lines() if x]


def test_bad_values_fail_alone_among_16_running_requests(stack):
    """Values that overflowed int32 in the engine thread (and failed every request in flight) are 400s
    naming the field; 16 requests running meanwhile return exactly what they return alone."""
    _, url, engine, gen = stack
    bad = [
        ({"prompt": "a", "max_tokens": 2**31}, "max_tokens"),
        ({"prompt": "a", "top_k": 2**31}, "top_k"),
        ({"prompt": "a", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"prompt": "a", "n": 10**6}, "n"),
        ({"prompt": "a", "seed": 2**80}, "seed"),
        ({"prompt": [300]}, "prompt"),
    ]
    good = [
        {"prompt": f"job {i}:", "max_tokens": 24, "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(16)
    ]
    with concurrent.futures.ThreadPoolExecutor(24) as pool, held(engine):  # held released first
        running = [pool.submit(_post, url, body) for body in good]
        _wait_for(lambda: engine.queue_length() == 16)
        for body, field in bad:
            r = _post(url, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 2**31})  # fmt: skip
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text
    configs = [SamplingConfig(max_new_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(16)]
    wants = gen.generate([b["prompt"] for b in good], configs)
    for future, want in zip(running, wants, strict=True):
        assert future.result().json()["choices"][0]["text"] == want.text


def test_a_failed_engine_step_ends_every_stream_and_the_server_goes_on(stack, monkeypatch):
    _, url, engine, gen = stack
    real_chunk, calls = engine.runner._chunk, []

    def failing_once(params, state, limit, retire, cfg):
        calls.append(1)
        if len(calls) == 1:
            for x in jax.tree.leaves(state):  # what a failed donated call leaves behind
                x.delete()
            raise RuntimeError("device lost")
        return real_chunk(params, state, limit, retire, cfg=cfg)

    body = {"prompt": "abc", "max_tokens": 30, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool, held(engine):  # held released first
        streamed = pool.submit(_sse_events, url, body | {"stream": True})
        whole = pool.submit(_post, url, body)
        _wait_for(lambda: engine.queue_length() == 2)
        monkeypatch.setattr(engine.runner, "_chunk", failing_once)
    events = streamed.result()
    assert events[-1] == "[DONE]" and "device lost" in events[-2]["error"]["message"]
    assert whole.result().status_code == 500 and "device lost" in whole.result().json()["error"]["message"]
    after = _post(url, {"prompt": "abc", "max_tokens": 8, "temperature": 0})
    assert after.json()["choices"][0]["text"] == _want(gen, "abc", max_new_tokens=8, temperature=0.0)[0].text
    assert httpx.get(f"{url}/health").status_code == 200


def test_non_streaming_disconnect_cancels(stack):
    _, url, engine, _ = stack
    cancelled = engine.metrics()["requests_cancelled"]
    body = {"prompt": "long story", "max_tokens": 240, "ignore_eos": True}
    with held(engine, when=lambda: any(engine.slots)):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
        _wait_for(lambda: all(s is None or s.status == "cancelled" for s in engine.slots))
    _wait_for(lambda: not engine.pool.in_use() and not any(engine.slots))
    assert engine.metrics()["requests_cancelled"] == cancelled + 1


def _app_client(engine, **serve):
    from fastapi.testclient import TestClient

    return TestClient(create_app(engine, NAME, serve=dataclasses.replace(engine.serve, **serve)))


def test_queue_limit_answers_429_and_timeout_408(stack):
    _, _, engine, _ = stack
    body = {"prompt": "q", "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(1) as pool, held(engine):  # held released first
        first = pool.submit(lambda: _app_client(engine, max_queue=1).post("/v1/completions", json=body))
        _wait_for(lambda: engine.queue_length() == 1)
        r = _app_client(engine, max_queue=1).post("/v1/completions", json=body)
        assert (
            r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        )
        slow = _app_client(engine, request_timeout_s=0.5)
        r = slow.post("/v1/completions", json=body)  # held: it cannot finish in time
        assert r.status_code == 408 and "request_timeout_s=0.5" in r.json()["error"]["message"]
        with slow.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            events = [x for x in s.iter_lines() if x]
        assert events[-1] == "data: [DONE]" and "request_timeout_s" in events[-2]
    assert first.result().status_code == 200
    _wait_for(lambda: engine.idle())


def test_body_limit_and_huge_values_are_refused_cheaply(stack):
    _, url, engine, _ = stack
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + b"x" * 20_000_000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=120)  # fmt: skip
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = _post(url, {"prompt": "x", "temperature": "y" * 1_000_000})
    assert r.status_code == 400 and len(r.text) < 1000 and r.json()["error"]["param"] == "temperature"
    r = _post(url, {"prompt": "x" * 3_000_000})  # under the body limit, but no tokenizer makes it fit
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and len(r.text) < 1000
    assert (
        _app_client(engine, max_body_bytes=100).post("/v1/completions", json={"prompt": "x" * 200}).status_code == 413
    )


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", b'{"prompt": "\\udc80 lone"}', 400, "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc80"}]}', 400, "messages.0.content"),
        ("/v1/completions", b'{"prompt": "x",', 400, None),
        ("/v1/completions", b"prompt=x", 400, None),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
        ("/v1/nothing-here", b"{}", 404, None),
    ],
)
def test_every_error_has_the_openai_shape(stack, path, raw, status, param):
    _, url, _, _ = stack
    r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found"


def test_chat_templates_cannot_run_code(stack, tmp_path):
    _, _, engine, _ = stack
    from fastapi.testclient import TestClient

    target = tmp_path / "pwned"
    hostile = engine.tokenizer.__class__(engine.tokenizer.tok, engine.tokenizer.eos_ids)
    hostile.chat_template = "{{ cycler.__init__.__globals__.os.system('touch " + str(target) + "') }}"
    evil = copy.copy(engine)
    evil.tokenizer = hostile
    r = TestClient(create_app(evil, NAME)).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 500 and "unsafe" in r.json()["error"]["message"] and not target.exists()
    hostile.chat_template = "{{ raise_exception('roles must alternate') }}"
    r = TestClient(create_app(evil, NAME)).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]


def test_health_is_503_when_the_engine_is_not_running(stack):
    _, _, engine, _ = stack
    from fastapi.testclient import TestClient

    stopped = copy.copy(engine)
    stopped._thread = None
    assert TestClient(create_app(stopped, NAME)).get("/health").status_code == 503


def test_logit_bias_is_accepted_and_applied(stack):
    _, url, _, gen = stack
    r = _post(url, {"prompt": "x", "max_tokens": 6, "temperature": 0, "logit_bias": {"65": 100}})
    want = gen.generate(["x"], SamplingConfig(max_new_tokens=6, temperature=0.0, logit_bias=((65, 100.0),)))[0]
    assert r.json()["choices"][0]["text"] == want.text == "AAAAAA"


def test_streamed_text_and_logprobs_equal_the_whole_response_with_split_characters(stack):
    """The byte-level tokenizer splits every non-ASCII character over several tokens, and 4-step chunks
    end inside them: each stream must still equal its whole response, character for character."""
    _, url, _, _ = stack
    bias = {str(b): 4.0 for b in "日😀é".encode()}  # push the model towards multi-byte characters
    seen_multibyte = False
    for seed in range(4):
        body = {"prompt": "日本", "max_tokens": 40, "temperature": 1.0, "seed": seed, "logit_bias": bias,
                "ignore_eos": True, "logprobs": 2}  # fmt: skip
        whole = _post(url, body).json()["choices"][0]
        events = _sse_events(url, body | {"stream": True})
        assert events[-1] == "[DONE]"
        choices = [e["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in choices) == whole["text"]
        streamed = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        np.testing.assert_allclose(streamed, whole["logprobs"]["token_logprobs"], atol=1e-5)
        assert [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
        seen_multibyte |= any(ord(ch) > 127 and ch != "\ufffd" for ch in whole["text"])
    assert seen_multibyte


def _post_json(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(stack):
    """lm-evaluation-harness's loglikelihood request: the prompt (context + continuation) as token ids,
    echo, max_tokens 1, logprobs 1. token_logprobs cover the prompt first (null for the first token),
    equal to teacher-forced `score`; each top_logprobs entry holds the most likely token."""
    _, url, _, gen = stack
    context, continuation = list(b"The cat sat on the "), list(b"mat.")
    ids = context + continuation
    body = {"model": NAME, "prompt": [ids], "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0}
    (choice,) = _post_json(url, "/v1/completions", body)["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith("The cat sat on the mat.")
    assert lp["text_offset"][: len(ids)] == list(range(len(ids)))  # one character per byte-level token
    (want,) = gen.score([context], [continuation])
    np.testing.assert_allclose(lp["token_logprobs"][len(context) : -1], want["token_logprobs"], atol=1e-4)
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1]))
    assert greedy == want["greedy"]
    (generated,) = gen.generate([ids], SamplingConfig(max_new_tokens=1, temperature=0.0))
    np.testing.assert_allclose(lp["token_logprobs"][-1], generated.logprobs[0], atol=1e-4)
    # max_tokens 0 (older harnesses): the prompt's scores only, the same numbers
    body.update(max_tokens=0)
    (zero,) = _post_json(url, "/v1/completions", body)["choices"]
    assert zero["text"] == bytes(ids).decode() and zero["finish_reason"] == "length"
    np.testing.assert_allclose(zero["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:-1], atol=1e-5)


def test_a_list_of_prompts_gives_one_choice_each_in_order(stack):
    """A list of strings or of token-id lists: choices indexed prompt * n + sample, each equal to its
    prompt alone; usage counts every prompt."""
    client, url, _, gen = stack
    prompts = ["def fib(n):", "import os", "x"]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    want = gen.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0, n=2))
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    as_ids = _post_json(url, "/v1/completions", {"prompt": [list(p.encode()) for p in prompts], "max_tokens": 6,
                                            "temperature": 0})  # fmt: skip
    assert [c["text"] for c in as_ids["choices"]] == [w.text for w in want[::2]]


def test_tokenizer_endpoints_round_trip(stack):
    _, url, engine, _ = stack
    text = "héllo <|endoftext|>"
    got = _post_json(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert got["tokens"] == engine.tokenizer.encode(text, special=False) and got["count"] == len(got["tokens"])
    assert _post_json(url, "/detokenize", {"tokens": got["tokens"]})["prompt"] == text
    info = httpx.get(f"{url}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == engine.tokenizer.tok.id_to_token(engine.tokenizer.eos_id)
    assert _post_json(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"] == [
        engine.tokenizer.eos_id
    ]  # lm-eval finds the end-of-text id this way
    assert info["model_max_length"] == CFG.max_seq_len and info["chat_template"] == TEMPLATE
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 99999]}, timeout=60)
    assert bad.status_code == 400 and "99999" in bad.json()["error"]["message"]
