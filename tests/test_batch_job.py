"""serve.py generate: the JSONL batch job, its error records and resuming after a kill."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxgen.batch_job import run_job
from jaxgen.checkpoint import load_run
from jaxgen.config import MeshConfig, ServeConfig
from jaxgen.engine import Engine
from jaxgen.generate import Generator
from jaxgen.sampling import SamplingConfig
from jaxgen.sharding import make_mesh
from tests.conftest import ROOT


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("runner", ["engine", "generator"])
def test_bad_lines_become_error_records_and_the_job_goes_on(tiny_run, tmp_path, runner):
    cfg, tok, params = load_run(tiny_run, mesh=make_mesh(MeshConfig(data=1)))
    if runner == "engine":
        gen = Engine(params, cfg.model, tok, ServeConfig(slots=4, num_pages=64))
    else:
        gen = Generator(params, cfg.model, tok)
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
    summary = run_job(gen, inp, out, SamplingConfig(max_new_tokens=6), batch_size=4)
    records = {r["id"]: r for r in read(out)}
    assert summary["requests"] == 2 and summary["errors"] == 7
    assert "not valid JSON" in records["line-2"]["error"]
    assert "temperature=-0.5 is not allowed: a number >= 0" in records["neg"]["error"]
    assert "top_p=1.5 is not allowed: a number in (0, 1]" in records["topp"]["error"]
    assert "unknown sampling field 'colour'" in records["field"]["error"]
    assert "has 500 tokens; the model's context is 128" in records["long"]["error"]
    assert "field 'prompt' is missing" in records["noprompt"]["error"]
    assert "duplicate id 'ok1'" in records["line-9"]["error"]
    assert len(records["ok1"]["choices"][0]["tokens"]) <= 5
    assert len(records["ok2"]["choices"]) == 2
    assert summary["compilations"] >= 1 and summary["tokens"] > 0
    again = run_job(gen, inp, out, SamplingConfig(max_new_tokens=6), batch_size=4)
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
