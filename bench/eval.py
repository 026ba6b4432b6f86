"""Evaluation throughput: a multiple-choice task through lm-evaluation-harness, three ways.

    python bench/eval.py [--config llama-small] [--layers 4] [--examples 500] [--batch-size 8] [--context-lines 3]

The task: `--examples` four-way questions made from the standard library's Python source (each question
`--context-lines` other lines, then a line's first half; the choices its true second half and three other
lines' second halves; fixed seed), written as a local JSON task. Long contexts and short endings, as in
HellaSwag, are where running each context once (`Generator.score_shared`) pays. Each is answered:
- `score()` one at a time: `Generator.score` called per example (its four choices in one call): the
  baseline a user would write by hand;
- native: lm-eval's `simple_evaluate` on `JaxgenLM` (every choice of every example scored in length-
  sorted batches of `--batch-size`, in-process);
- server: lm-eval's `local-completions` model (its defaults: token-id prompts, the server's tokenizer
  through /tokenize) at the OpenAI server (uvicorn in a thread of this process), `--http-batch`
  prompts per request, `--concurrent` requests at a time.
Reported: examples/s (an example is four log-likelihoods) in steady state: `score()` and the native model
first run the whole task once untimed (every batch shape compiled), the server `--warmup` other examples
(its prefill programs are few); and the ratios. All three must agree: the accuracy is printed for each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import lm_eval
from lm_eval.tasks import TaskManager

from jaxgen import model
from jaxgen.config import ServeConfig, load_config
from jaxgen.evaluation.harness import JaxgenLM
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.serving.server import create_app
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def questions(n: int, seed: int, context_lines: int = 0) -> list[dict]:
    """Four-way questions from the standard library's source lines (real text on every machine)."""
    rng = random.Random(seed)
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]:
        lines += [s.strip() for s in path.read_text(errors="ignore").splitlines() if 40 <= len(s.strip()) <= 100]
    rng.shuffle(lines)
    out = []
    context = lines[4 * n : 4 * n + n * context_lines]
    for i in range(n):
        line, others = lines[i], lines[n + 3 * i : n + 3 * i + 3]
        before = "".join(x + "\n" for x in context[i * context_lines : (i + 1) * context_lines])
        cut = len(line) // 2
        choices = [line[cut:]] + [o[len(o) // 2 :] for o in others]
        order = list(range(4))
        rng.shuffle(order)
        out.append({"question": before + line[:cut], "choices": [choices[j] for j in order], "answer": order.index(0)})
    return out


def write_task(folder: Path, name: str, docs: list[dict]) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data))


def by_hand(gen: Generator, lm: JaxgenLM, docs: list[dict]) -> float:
    """`score()` per example (its four choices together); returns the accuracy. The text is split into
    context and continuation tokens as lm-eval splits it (a space before each choice; `_encode_pair`)."""
    right = 0
    for d in docs:
        pairs = [lm._encode_pair(d["question"], " " + c) for c in d["choices"]]
        scores = gen.score([p[0] for p in pairs], [p[1] for p in pairs])
        right += max(range(4), key=lambda j: scores[j]["logprob"]) == d["answer"]
    return right / len(docs)


def through_lm_eval(lm, name: str, tasks: TaskManager, **kw) -> float:
    results = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=tasks, **kw)
    return results["results"][name]["acc,none"]


def timed(fn, *args, **kw) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama-small")
    parser.add_argument("--layers", type=int, default=4, help="model depth (default 4, to keep the run short)")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=64, help="examples run first, untimed (compilation)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows the native model scores together")
    parser.add_argument("--context-lines", type=int, default=3, help="source lines before each question")
    parser.add_argument("--http-batch", type=int, default=16, help="prompts per HTTP request (server)")
    parser.add_argument("--concurrent", type=int, default=4, help="HTTP requests in flight (server)")
    args = parser.parse_args()
    overrides = [f"model.num_layers={args.layers}", "model.vocab_size=257"]
    cfg = load_config(ROOT / "configs" / f"{args.config}.yaml", overrides).model
    params = model.init_params(cfg, jax.random.key(0))
    tok = Tokenizer.byte_level()
    docs = questions(args.examples + args.warmup, seed=0, context_lines=args.context_lines)
    warm, docs = docs[: args.warmup], docs[args.warmup :]
    folder = Path(tempfile.mkdtemp(prefix="jaxgen-eval-bench-"))
    write_task(folder, "bench_warm", warm)
    write_task(folder, "bench_mc", docs)
    tasks = TaskManager(include_path=str(folder))
    tokens = sum(len(d["question"]) for d in docs) / len(docs)
    print(f"{args.config} with {args.layers} layers, float32, byte-level tokens; {len(docs)} four-way examples, "
          f"contexts of {tokens:.0f} tokens on average; native batch {args.batch_size}")  # fmt: skip

    lm = JaxgenLM(model=(cfg, tok, params), batch_size=args.batch_size)
    gen = Generator(params, cfg, tok, max_batch=4)  # one example's four choices per call
    by_hand(gen, lm, docs)  # compiles every shape: the timed run is steady state
    rows = [("score() one example at a time", *timed(by_hand, gen, lm, docs))]

    through_lm_eval(lm, "bench_mc", tasks)
    rows.append(("native lm-eval model (JaxgenLM)", *timed(through_lm_eval, lm, "bench_mc", tasks)))

    sys.path.insert(0, str(ROOT))
    from tests.live import live_server  # the tests' in-thread uvicorn

    engine = Engine(params, cfg, tok, ServeConfig(slots=16, kv_memory_gb=1.0, prefill_chunk=512))
    with live_server(engine, create_app(engine, "bench")) as (url, _):
        http = {"base_url": f"{url}/v1/completions", "model": "bench", "tokenizer_backend": "auto",
                "num_concurrent": args.concurrent, "max_retries": 1}  # fmt: skip
        through_lm_eval("local-completions", "bench_warm", tasks, model_args=http, batch_size=args.http_batch)
        run = timed(through_lm_eval, "local-completions", "bench_mc", tasks, model_args=http,
                    batch_size=args.http_batch)  # fmt: skip
        rows.append(("server, lm-eval local-completions", *run))

    print("\n| way | examples/s | seconds | accuracy |\n|---|---|---|---|")
    for name, seconds, acc in rows:
        print(f"| {name} | {len(docs) / seconds:.1f} | {seconds:.1f} | {acc:.3f} |")
    native, server, single = rows[1][1], rows[2][1], rows[0][1]
    print(f"\nnative / score() one at a time: {single / native:.2f}x faster")
    print(f"server / native time: {server / native:.2f}x (target: within 2x)")


if __name__ == "__main__":
    main()
