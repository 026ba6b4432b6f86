"""serve.py generate: the JSONL batch job, its error records and resuming after a kill."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxgen.config import MeshConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.loading import load_run
from jaxgen.inference.sampling import SamplingArrays, SamplingConfig
from jaxgen.serving.batch_job import run_job
from jaxgen.sharding import make_mesh
from tests.conftest import ROOT


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_become_error_records_and_the_job_goes_on(tiny_run, tmp_path):
    cfg, tok, params = load_run(tiny_run, mesh=make_mesh(MeshConfig(data=1)))
    gen = Engine(params, cfg.model, tok, ServeConfig(slots=4, num_pages=64))
    lines = [
        {"id": "ok1", "prompt": "import os", "max_new_tokens": 5},
        "this is not json",
        {"id": "neg", "prompt": "x", "temperature": -0.5},
        {"id": "topp", "prompt": "x", "top_p": 1.5},
        {"id": "field", "prompt": "x", "colour": "blue"},
        {"id": "long", "prompt": "y" * 500},
        {"id": "noprompt"},
        {"id": "ok2", "prompt": "def f(", "n": 2, "temperature": 0.7, "seed": 3},
        {"id": "ok1", "prompt": "duplicate"},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run_job(gen, inp, out, SamplingConfig(max_new_tokens=6))
    records = {r["id"]: r for r in read(out)}
    assert summary["requests"] == 2 and summary["errors"] == 7
    assert "not valid JSON" in records["line-2"]["error"]
    assert "temperature=-0.5 is not allowed" in records["neg"]["error"]
    assert "top_p=1.5 is not allowed" in records["topp"]["error"]
    assert "unknown sampling field 'colour'" in records["field"]["error"]
    assert "has 500 tokens; the model's context is 128" in records["long"]["error"]
    assert "field 'prompt' is missing" in records["noprompt"]["error"]
    assert "duplicate id 'ok1'" in records["line-9"]["error"]
    assert len(records["ok1"]["choices"][0]["tokens"]) <= 5
    assert len(records["ok2"]["choices"]) == 2
    assert summary["compilations"] >= 1 and summary["tokens"] > 0
    again = run_job(gen, inp, out, SamplingConfig(max_new_tokens=6))
    assert again["requests"] == 0 and again["errors"] == 0 and len(read(out)) == len(records)


def test_killed_job_resumes_without_lost_or_duplicated_ids(tiny_run, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"r{i}" for i in range(60)]
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}("}) + "\n" for i in ids))
    cmd = [
        sys.executable, "serve.py", "generate", "--checkpoint", str(tiny_run), "--input", str(inp),
        "--output", str(out), "--slots", "2", "--max-new-tokens", "48",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (out.exists() and len(out.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(out.read_text().splitlines())
    assert 3 <= partial < 60
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["skipped_done"] >= partial - 1 and summary["errors"] == 0
    got = [r["id"] for r in read(out)]
    assert sorted(got) == sorted(ids)  # every id exactly once


def test_quick_look_prompt(tiny_run):
    cmd = [sys.executable, "serve.py", "generate", "--checkpoint", str(tiny_run), "--prompt", "def fib(",
           "--max-new-tokens", "8", "--temperature", "0"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("def fib(") and len(out.stdout) > len("def fib(\n")
    bad = subprocess.run([*cmd[:-2], "--temperature", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "temperature=-1.0 is not allowed" in bad.stderr


def test_package_level_generate_on_a_run_folder(tiny_run):
    import jaxgen

    outs = jaxgen.generate(tiny_run, ["def ", "import"], jaxgen.SamplingConfig(temperature=0, max_new_tokens=4))
    assert [len(o.tokens) for o in outs] == [4, 4] and all(isinstance(o.text, str) for o in outs)


# --- hardening: one bad line never costs the good ones ------------------------------------------------

GOOD = [
    {"id": "g1", "prompt": "import os", "temperature": 0},
    {"id": "g2", "prompt": "def f(", "n": 2, "temperature": 0.7, "seed": 3},
    {"id": "g3", "prompt": "class A:", "top_k": 5, "seed": 1},
]
DEFAULTS = SamplingConfig(max_new_tokens=4)


@pytest.fixture(scope="module")
def engine(tiny_run):
    cfg, tok, params = load_run(tiny_run, mesh=make_mesh(MeshConfig(data=1)))
    return Engine(params, cfg.model, tok, ServeConfig(slots=4, num_pages=64))


@pytest.fixture(scope="module")
def baseline(engine, tmp_path_factory):
    """The good lines' tokens and texts from a run without any bad line."""
    tmp = tmp_path_factory.mktemp("baseline")
    write_lines(tmp / "in.jsonl", GOOD)
    run_job(engine, tmp / "in.jsonl", tmp / "out.jsonl", DEFAULTS)
    return outputs(read(tmp / "out.jsonl"))


def write_lines(path, lines):
    """Each line: a dict (written as JSON, non-ASCII kept raw) or bytes (written as they are)."""
    path.write_bytes(
        b"".join(x if isinstance(x, bytes) else json.dumps(x, ensure_ascii=False).encode() + b"\n" for x in lines)
    )


def outputs(records):
    return {r["id"]: [(c["tokens"], c["text"]) for c in r["choices"]] for r in records if "choices" in r}


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**31),
        ("max_new_tokens", 3e9),
        ("max_new_tokens", 2**31),
        ("logit_bias", {"999999": 1}),
        ("logit_bias", {"-1": 5}),
        ("logit_bias", {"abc": 1}),
        ("stop_token_ids", [2**40]),
        ("stop_token_ids", ["x"]),
    ],
)
def test_an_out_of_range_value_is_its_lines_error_and_the_good_lines_match(engine, baseline, tmp_path, field, value):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [GOOD[0], {"id": "bad", "prompt": "x = 1", field: value}, *GOOD[1:]])
    summary = run_job(engine, inp, out, DEFAULTS)
    records = read(out)
    assert sorted(r["id"] for r in records) == ["bad", "g1", "g2", "g3"]
    assert field in next(r for r in records if r["id"] == "bad")["error"]
    assert outputs(records) == baseline and summary["errors"] == 1


def test_a_line_that_is_not_utf8_is_its_own_error(engine, baseline, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lone_surrogate = b'{"id": "surrogate", "prompt": "a\\ud800b"}\n'  # valid JSON, not encodable text
    write_lines(
        inp, [GOOD[0], b'{"id": "latin1", "prompt": "caf\xe9"}\n', GOOD[1], b"\xff\xfe\n", lone_surrogate, GOOD[2]]
    )
    run_job(engine, inp, out, DEFAULTS)
    records = {r["id"]: r for r in read(out)}
    assert sorted(records) == ["g1", "g2", "g3", "latin1", "line-4", "surrogate"]  # every line, once
    assert "not UTF-8" in records["latin1"]["error"] and "not UTF-8" in records["line-4"]["error"]
    assert outputs(records.values()) == baseline


def test_line_separators_inside_a_json_string_stay_in_one_request(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompt = "a = 1\u2028b = 2\u2029c\x85 = 3"  # str.splitlines() splits at each of these
    write_lines(inp, [{"id": "seps", "prompt": prompt}, json.dumps({"id": "crlf", "prompt": "x"}).encode() + b"\r\n"])
    summary = run_job(engine, inp, out, DEFAULTS)
    records = {r["id"]: r for r in read(out)}
    assert summary["requests"] == 2 and summary["errors"] == 0
    assert sorted(records) == ["crlf", "seps"] and all("choices" in r for r in records.values())
    assert records["seps"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt))


@pytest.mark.parametrize("where", ["in a request", "in the step"])
def test_a_failed_engine_step_costs_only_the_failing_line(engine, baseline, tmp_path, monkeypatch, where):
    stack, step = SamplingArrays.stack.__func__, engine.step

    def failing_stack(cls, configs, vocab_size):  # as if a bad value had slipped past every check
        if any(c.seed == 666 for c in configs):
            raise OverflowError("injected failure")
        return stack(cls, configs, vocab_size)

    def failing_step():  # a step that raises while the bad line is in the engine, good ones beside it
        if any(r.sampling.seed == 666 and r.status != "cancelled" for r in engine.waiting):
            raise RuntimeError("injected failure")
        step()

    if where == "in a request":
        monkeypatch.setattr(SamplingArrays, "stack", classmethod(failing_stack))
    else:
        monkeypatch.setattr(engine, "step", failing_step)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [GOOD[0], {"id": "bad", "prompt": "x = 1", "seed": 666}, *GOOD[1:]])
    summary = run_job(engine, inp, out, DEFAULTS)
    records = {r["id"]: r for r in read(out)}
    assert sorted(records) == ["bad", "g1", "g2", "g3"] and summary["errors"] == 1
    assert "injected failure" in records["bad"]["error"]
    assert outputs(records.values()) == baseline
    assert engine.idle()  # nothing left behind for the next job


def test_a_request_the_engine_cancels_is_its_lines_error(engine, baseline, tmp_path, monkeypatch):
    submit = engine.submit

    def cancelling_submit(prompt, sampling, **kw):
        seqs = submit(prompt, sampling, **kw)
        if sampling.seed == 13:
            engine.cancel(seqs[-1])
        return seqs

    monkeypatch.setattr(engine, "submit", cancelling_submit)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [GOOD[0], {"id": "cancelled", "prompt": "x = 1", "n": 2, "seed": 13}, *GOOD[1:]])
    summary = run_job(engine, inp, out, DEFAULTS)
    records = {r["id"]: r for r in read(out)}
    assert "cancelled" in records["cancelled"]["error"] and summary["errors"] == 1
    assert outputs(records.values()) == baseline


def test_resume_cuts_a_torn_last_line_in_place(engine, tmp_path, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, GOOD)
    run_job(engine, inp, out, DEFAULTS)
    complete = b"".join(out.read_bytes().splitlines(keepends=True)[:2])  # g1 and one more survive the kill
    out.write_bytes(complete + b'{"id": "g')  # killed mid-write
    inode = out.stat().st_ino

    def whole_file(*args, **kwargs):
        raise AssertionError("the resume read or rewrote the whole output")

    for name in ("read_bytes", "read_text", "write_bytes", "write_text"):
        monkeypatch.setattr(type(out), name, whole_file)
    summary = run_job(engine, inp, out, DEFAULTS)
    monkeypatch.undo()
    assert summary["skipped_done"] == 2 and summary["requests"] == 1
    assert out.stat().st_ino == inode and out.read_bytes().startswith(complete)
    assert sorted(r["id"] for r in read(out)) == ["g1", "g2", "g3"]  # each id exactly once


def test_resume_skips_a_corrupt_complete_line_of_the_output(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, GOOD)
    write_lines(out, [{"id": "g1", "choices": [], "prompt_tokens": 2}, b"\x00\xff garbage\n", b"[1, 2]\n"])
    summary = run_job(engine, inp, out, DEFAULTS)
    assert summary["skipped_done"] == 1 and summary["requests"] == 2


def test_a_corpus_is_scored_offline_with_prompt_logprobs(engine, tiny_run, tmp_path):
    """`max_new_tokens: 0, prompt_logprobs: 0` lines: each record's prompt_logprobs equal `score`."""
    from jaxgen.inference.generator import Generator

    texts = ["import os\nimport sys\n", "def add(a, b):\n    return a + b\n"]
    write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": t, "max_new_tokens": 0, "prompt_logprobs": 0}
                                        for i, t in enumerate(texts)])  # fmt: skip
    run_job(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", DEFAULTS)
    records = sorted(read(tmp_path / "out.jsonl"), key=lambda r: r["id"])
    gen = Generator(engine.params, engine.cfg, engine.tokenizer)
    for r, text in zip(records, texts, strict=True):
        ids = engine.tokenizer.encode(text)
        assert r["choices"][0]["tokens"] == [] and r["prompt_logprobs"][0] is None
        (want,) = gen.score([ids[:1]], [ids[1:]])
        assert r["prompt_logprobs"][1:] == pytest.approx(want["token_logprobs"], abs=1e-4)
