"""The HTTP server, through the official `openai` client and raw HTTP, against `Generator` results."""

import concurrent.futures
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.engine import Engine
from jaxgen.generate import Generator
from jaxgen.sampling import SamplingConfig
from jaxgen.server import create_app
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
NAME = "tiny"


@pytest.fixture(scope="module")
def stack():
    """A live server on 127.0.0.1 (uvicorn in a thread, the engine in another) and a Generator."""
    params = model.init_params(CFG, jax.random.key(1))
    params = jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, params)
    tok = Tokenizer.byte_level()
    tok.chat_template = TEMPLATE
    engine = Engine(params, CFG, tok, ServeConfig(slots=8, num_pages=128, chunk_steps=4, prefill_chunk=64))
    engine.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, url, engine, Generator(params, CFG, tok, max_batch=64, chunk_steps=16)
    server.should_exit = True
    thread.join(timeout=10)
    engine.stop()


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
    before = _metric(url, "jaxgen_prefix_cache_hit_tokens")
    first = client.completions.create(model=NAME, prompt=system + "Q1", max_tokens=8, temperature=0)
    second = client.completions.create(model=NAME, prompt=system + "Q2", max_tokens=8, temperature=0)
    assert _metric(url, "jaxgen_prefix_cache_hit_tokens") - before == 6 * 16
    for out, prompt in ((first, system + "Q1"), (second, system + "Q2")):
        assert out.choices[0].text == _want(gen, prompt, max_new_tokens=8, temperature=0.0)[0].text
    text = httpx.get(f"{url}/metrics").text
    for name in ("queue_length", "running_slots", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "tokens_per_second", "cache_pages_in_use", "prefix_cache_hit_rate"):  # fmt: skip
        assert f"# TYPE jaxgen_{name} gauge" in text


def _metric(url, name):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
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
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the stream has started
        assert engine.pool.in_use() > 0
    deadline = time.time() + 20
    while time.time() < deadline and (engine.pool.in_use() or any(engine.slots)):
        time.sleep(0.1)
    assert engine.pool.in_use() == 0 and not any(engine.slots)
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
           "--kv-memory-gb", "0.05", "--api-key", "k3y"]  # fmt: skip
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
    finally:
        proc.terminate()
        proc.wait(timeout=30)
