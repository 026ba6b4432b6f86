"""Cold start (issue 45): how long a user waits for `serve.py http`, `LLM`, a resumed `train.py` and `rl.py`.

    python bench/cold_start.py                          # default and llama-small, every part (~30 min, 2 cores)
    python bench/cold_start.py --models default --parts serve --work /tmp/cs

Every figure comes from real processes: the run folders are trained here (offline: the stdlib corpus, the
byte tokenizer; llama-small's shapes with a byte tokenizer), `serve.py http` is started as a user starts it and
polled over HTTP (httpx) until /health is ok. Two ways to keep programs, each in folders of its own: "xla",
jax's persistent cache alone ($JAXGEN_EXECUTABLES empty: each program traced and lowered, then loaded), and
"store", the persistent cache and `jaxgen.executables`' store ($JAXGEN_EXECUTABLES set: loaded without
tracing). Cold: empty folders; warm: the same folders again, in a new process. Each with
serve.precompile=false (nothing compiled before ready but the engine's state) and true
(`jaxgen.inference.precompile`). Printed as markdown tables:

- ready: seconds from the process's start (Popen) to /health ok, split as the server measured it
  (/metrics' jaxgen_startup_seconds: import = interpreter, imports and the backend's start; load = weights;
  engine = the engine built, its state's programs compiled; precompile = every program a request can reach)
  and the rest (the HTTP server's start, the polls);
- first token: a streamed one-token request just after ready (what compiles then made it wait);
- programs: per program, compilations and compile seconds (jaxgen_compile_seconds_total) before ready and
  after ready under a mixed workload (short and long prompts, n > 1, logprobs, echo, a JSON schema,
  speculation), and the loads from jax's persistent cache or the store (jaxgen_compile_cache_hits_total);
- train, rl: seconds from a resumed `train.py`'s (`rl.py`'s) start to its first step's record in metrics.jsonl;
- llm: `LLM(run)` in a new process with the command lines' caches: seconds to build it and to its first
  generate, and the programs it traced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# a tiny run folder each: a few steps, enough for a checkpoint (the figures do not depend on the weights)
LLAMA = ["data.source=stdlib", "data.tokenizer=byte", "data.seq_len=64", "training.batch_size=2"]
MODELS = {
    "default": ["--config", "configs/default.yaml"],
    "llama-small": ["--config", "configs/llama-small.yaml", *LLAMA],
}
RL = ["rl.warm_start_steps=10", "checkpoint.every=1", "--no-progress"]
TRAIN = ["training.steps=2", "checkpoint.every=1", "training.eval_every=1000", "data.eval_batches=1", "--no-progress"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def mixed_workload() -> list[dict]:
    """/v1/completions bodies that reach the engine's programs a plain request does not."""
    long = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3  # 240 bytes
    return [
        {"prompt": "a", "max_tokens": 4},
        {"prompt": "import os\nimport sys\n", "max_tokens": 8, "n": 3, "temperature": 0.8, "seed": 1},
        {"prompt": long, "max_tokens": 4},
        {"prompt": long[:200], "max_tokens": 4, "logprobs": 3},
        {"prompt": "x = 1\n", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "json: ", "max_tokens": 16, "response_format": {"type": "json_schema",
                                                                   "json_schema": {"name": "a", "schema": SCHEMA}}},
        {"prompt": "abcabcabcabcabc", "max_tokens": 8, "num_speculative_tokens": 4},
    ]  # fmt: skip


def run(cmd: list[str], env: dict, log: Path) -> None:
    """A command to its end, its output in `log`; exits with the log's tail when it fails."""
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{log.read_text()[-3000:]}")


def build(name: str, work: Path) -> Path:
    """The run folder of `name` (trained for 2 steps, once; kept in `work` for later runs)."""
    run_dir = work / "runs" / name
    if not (run_dir / "config.yaml").exists():
        env = os.environ | {"JAXGEN_XLA_CACHE": "", "JAXGEN_EXECUTABLES": "", "JAX_PLATFORMS": "cpu"}
        run([sys.executable, "train.py", *MODELS[name], "--run-dir", str(run_dir), *TRAIN], env, work / f"{name}.log")
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, dict[tuple, float]]:
    """/metrics' labelled samples: {name: {labels as a sorted tuple of (key, value): value}}."""
    out: dict[str, dict[tuple, float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("jaxgen_") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            pairs = tuple(sorted(tuple(p.split("=", 1)) for p in labels.split(",")))
            out.setdefault(name, {})[tuple((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


def caches(cache: Path, store: bool = True) -> dict:
    """The environment of a process whose compiled programs are kept in `cache` (the store too, if `store`)."""
    return {"JAXGEN_XLA_CACHE": str(cache / "xla"), "JAXGEN_EXECUTABLES": str(cache / "executables") if store else "",
            "JAX_PLATFORMS": "cpu"}  # fmt: skip


def serve(run_dir: Path, cache: Path, work: Path, tag: str, precompile: bool, store: bool = True) -> dict:
    """One `serve.py http` start on `cache`: ready, first token, the workload's compilations; then SIGTERM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "serve.py", "http", "--checkpoint", str(run_dir), "--port", str(port), "--slots", "4",
           "--kv-memory-gb", "0.25", "--shutdown-grace", "0", f"serve.precompile={precompile}"]  # fmt: skip
    env = os.environ | caches(cache, store)
    with open(work / f"serve-{tag}.log", "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = wait_ready(proc, url, t0)
            out = {"ready_s": ready, "startup": metrics(url).get("jaxgen_startup_seconds", {})}
            out["first_token_s"] = first_token(url)
            out["after_first"] = metrics(url)
            for body in mixed_workload():
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
                assert r.status_code == 200, (body, r.text)
            out["after_mixed"] = metrics(url)
            return out
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def wait_ready(proc: subprocess.Popen, url: str, t0: float) -> float:
    """Seconds from `t0` to the first /health 200 (polled every 20 ms)."""
    while True:
        if proc.poll() is not None:
            sys.exit(f"serve.py exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.02)


def first_token(url: str) -> float:
    """Seconds to the first streamed text of a short prompt (the first request the server sees; the stream's
    first event, sent when the request is queued, holds no text)."""
    t0 = time.perf_counter()
    body = {"prompt": "def ", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            choices = json.loads(line[6:]).get("choices") if line.startswith("data: {") else None
            if choices and (choices[0]["text"] or choices[0]["finish_reason"]):  # a byte may hold its text back
                return time.perf_counter() - t0
    raise AssertionError("no token streamed")


def resumed_train(name: str, run_dir: Path, cache: Path, work: Path, tag: str, store: bool = True) -> float:
    """Seconds from a resumed train.py's start to its first step's record (a fresh copy of the 2-step run)."""
    copy = work / f"resume-{tag}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy)
    cmd = [sys.executable, "train.py", *MODELS[name], "--run-dir", str(copy), *TRAIN[1:], "training.steps=4"]
    return _first_record(cmd, copy / "metrics.jsonl", caches(cache, store), work / f"train-{tag}.log")


LLM_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from jaxgen.runtime import enable_compilation_cache
enable_compilation_cache()
from jaxgen import LLM, SamplingConfig
t1 = time.perf_counter()
llm = LLM(sys.argv[1], slots=4, kv_memory_gb=0.25)
t2 = time.perf_counter()
llm.generate(["def "], SamplingConfig(max_new_tokens=4, temperature=0.0))
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "LLM()": t2 - t1, "first generate": t3 - t2,
                  "compiles": llm.engine.compilations}))
"""


def llm_start(run_dir: Path, cache: Path, store: bool) -> dict:
    """An `LLM(run)` in a new process (the command lines' caches turned on): seconds to build it, to its
    first generate (4 greedy tokens), and the programs it traced."""
    env = os.environ | caches(cache, store)
    out = subprocess.run([sys.executable, "-c", LLM_SCRIPT, str(run_dir)], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_rl(work: Path) -> Path:
    """A 2-step rl.py run of configs/rl-arithmetic.yaml (a 10-step warm start), made afresh."""
    run_dir = work / "runs" / "rl"
    shutil.rmtree(run_dir, ignore_errors=True)  # the resumed runs below add steps to it
    env = os.environ | {"JAXGEN_XLA_CACHE": "", "JAXGEN_EXECUTABLES": "", "JAX_PLATFORMS": "cpu"}
    run([sys.executable, "rl.py", "--run-dir", str(run_dir), *RL, "training.steps=2"], env, work / "rl.log")
    return run_dir


def resumed_rl(run_dir: Path, cache: Path, work: Path, tag: str, store: bool, steps: int) -> float:
    """Seconds from rl.py's start, resuming `run_dir` in place to `steps` (one more step than it holds: its
    warm start's folder records where it was made, so a copy would not resume), to that step's record."""
    cmd = [sys.executable, "rl.py", "--run-dir", str(run_dir), *RL, f"training.steps={steps}"]
    return _first_record(cmd, run_dir / "metrics.jsonl", caches(cache, store), work / f"rl-{tag}.log")


def _first_record(cmd: list[str], records: Path, env: dict, log_path: Path) -> float:
    """Seconds from `cmd`'s start to a new line in `records` (its first step); then it runs to its end."""
    seen = records.read_text().count("\n") if records.exists() else 0
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not (records.exists() and records.read_text().count("\n") > seen):
                if proc.poll() is not None:
                    sys.exit(f"{cmd[1]} exited with {proc.returncode} before its first step: {log_path}")
                time.sleep(0.02)
            return time.perf_counter() - t0
        finally:
            proc.wait(timeout=600)


def programs(figures: dict) -> dict[str, dict[str, float]]:
    """{program: {"before", "after", "before_s", "after_s", "hits"}} from /metrics' samples."""
    out: dict[str, dict[str, float]] = {}
    for metric, key in (("jaxgen_compiles_total", ""), ("jaxgen_compile_seconds_total", "_s"),
                        ("jaxgen_compile_cache_hits_total", "hits")):  # fmt: skip
        for labels, value in figures.get(metric, {}).items():
            d = dict(labels)
            row = out.setdefault(d["program"], {})
            slot = "hits" if key == "hits" else ("before" if d["phase"] == "before_ready" else "after") + key
            row[slot] = row.get(slot, 0) + value
    return out


def report(name: str, runs: dict[str, dict]) -> None:
    print(f"\n### {name}\n")
    print("| start | ready (s) | import | load | engine | precompile | rest | first token (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for tag, r in runs.items():
        phases = {dict(k)["phase"]: v for k, v in r["startup"].items()}
        rest = r["ready_s"] - sum(phases.get(p, 0.0) for p in ("import", "load", "engine", "precompile"))
        cells = [f"{phases.get(p, 0.0):.2f}" for p in ("import", "load", "engine", "precompile")]
        print(f"| {tag} | {r['ready_s']:.2f} | {' | '.join(cells)} | {rest:.2f} | {r['first_token_s']:.2f} |")
    print("\n| program | " + " | ".join(f"{t}: before ready n/s | {t}: after ready n/s | {t}: cache hits"
                                        for t in runs) + " |")  # fmt: skip
    print("|---|" + "---|---|---|" * len(runs))
    tables = {tag: programs(r["after_mixed"]) for tag, r in runs.items()}
    names = sorted({p for t in tables.values() for p in t})
    for p in names:
        cells = []
        for t in tables.values():
            row = t.get(p, {})
            before = f"{row.get('before', 0):.0f} / {row.get('before_s', 0):.2f}"
            cells += [before, f"{row.get('after', 0):.0f} / {row.get('after_s', 0):.2f}", f"{row.get('hits', 0):.0f}"]
        print(f"| {p} | " + " | ".join(cells) + " |")
    for tag, r in runs.items():
        first = programs(r["after_first"])
        waited = sorted(p for p, row in first.items() if row.get("after"))
        print(f"\n{tag}: compiled after ready by the first request: {', '.join(waited) or 'nothing'}")
        later = {p: row.get("after", 0) - first.get(p, {}).get("after", 0) for p, row in tables[tag].items()}
        print(f"{tag}: compiled after ready by the mixed workload: "
              + (", ".join(f"{p} x{n:.0f}" for p, n in sorted(later.items()) if n) or "nothing"))  # fmt: skip


# (name, store of executables in use); each mode's cold run empties its folders, its warm run reuses them
STARTS = (("cold (xla)", False), ("warm (xla)", False), ("cold (store)", True), ("warm (store)", True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,llama-small", help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--parts", default="serve,train,llm,rl", help="comma-separated, of: serve, train, llm, rl "
                   "(rl: configs/rl-arithmetic.yaml, once, whatever --models)")  # fmt: skip
    p.add_argument("--work", type=Path, default=Path("/tmp/jaxgen-cold-start"), help="run folders, caches, logs")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    everything = {}
    for name in args.models.split(","):
        run_dir = build(name, args.work)
        runs = everything.setdefault(name, {})
        if "serve" in parts:
            for precompile in (False, True):
                for start, store in STARTS:
                    cache = _cache(args.work / f"cache-{name}-{precompile}-{store}", start)
                    tag = f"{start}{', precompiled' if precompile else ''}"
                    log = f"{name}-{start[:4]}{store}-{precompile}"
                    runs[tag] = serve(run_dir, cache, args.work, log, precompile, store)
            report(name, runs)
        if "train" in parts:
            t = {tag: resumed_train(name, run_dir, _cache(args.work / f"cache-train-{name}-{store}", tag), args.work,
                                    f"{name}-{tag[:4]}{store}", store) for tag, store in STARTS}  # fmt: skip
            print(f"\n{name}: resumed train.py to its first step (s): {_seconds(t)}")
            runs["train"] = t
        if "llm" in parts:
            t = {tag: llm_start(run_dir, _cache(args.work / f"cache-llm-{name}-{store}", tag), store)
                 for tag, store in STARTS}  # fmt: skip
            print(f"\n{name}: LLM(run) in a new process (s):")
            for tag, r in t.items():
                print(f"- {tag}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in r.items()))  # fmt: skip
            runs["llm"] = t
    if "rl" in parts:
        run_dir = build_rl(args.work)
        t = {tag: resumed_rl(run_dir, _cache(args.work / f"cache-rl-{store}", tag), args.work, f"{tag[:4]}{store}",
                             store, steps) for steps, (tag, store) in enumerate(STARTS, start=3)}  # fmt: skip
        print(f"\nrl-arithmetic: resumed rl.py to its first step (s): {_seconds(t)}")
        everything["rl"] = t
    if args.json:
        args.json.write_text(json.dumps(jsonable(everything), indent=1))


def _cache(folder: Path, start: str) -> Path:
    """`folder`, emptied for a cold start."""
    if start.startswith("cold"):
        shutil.rmtree(folder, ignore_errors=True)
    return folder


def _seconds(t: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in t.items())


def jsonable(x):
    """`x` with its tuple keys (labels) as text."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    return x


if __name__ == "__main__":
    main()
