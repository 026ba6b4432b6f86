"""lm-evaluation-harness (the real `lm-eval` package) against jaxgen: through `serve.py http` with lm-eval's
`local-completions` model, and in-process with jaxgen's own model (`jaxgen.evaluation.harness`).

Tasks are local JSON files (tests/eval_tasks), since nothing can be downloaded. Every log-likelihood is
checked against an independent computation (`Generator.score`, or transformers for a Hugging Face model),
the accuracy against one computed by hand from those, and every generation against `Generator.generate`.
"""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files; nothing to fetch
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval
import numpy as np
import pytest
from lm_eval.tasks import TaskManager

from jaxgen.config import ServeConfig
from jaxgen.evaluation.harness import JaxgenLM
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.loading import load_model
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.serving.server import create_app
from tests.conftest import ROOT
from tests.live import live_server

MC = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None", " print"], 0),
    ("import os\nimport", [" sys", " the", " 42", " )"], 0),
    ("for i in range(10):\n   ", [" print(i)", " return", " else", " 3"], 0),
    ("class Foo:\n    def __init__(self", ["):", ", x):", " lambda", " +"], 1),
    ("The quick brown fox jumps over the", [" lazy dog", " moon", " table", " 7"], 0),
    ("x = [1, 2, 3]\ny = len(", ["x)", "y)", "1)", "[)"], 0),
    ("if __name__ == ", ['"__main__":', "0:", "None:", "x"], 0),
    ("    raise ValueError(", ['"bad value")', "1 + 1", "import", ")"], 0),
    ("Hello", [", world", " there", "!", " 1"], 2),
    ("with open(path) as", [" f:", " x", " 1", ")"], 0),
]
GEN = [("def add(a, b):\n", "    return a + b"), ("import os\n", "import sys"), ("# ", "Copyright"),
       ("class ", "Foo:"), ("x = ", "1"), ("    ", "return")]  # fmt: skip


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The two task files with their data, in a folder for lm-eval's include_path."""
    folder = tmp_path_factory.mktemp("eval_tasks")
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt, target in GEN:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    for name in ("jaxgen_mc.yaml", "jaxgen_gen.yaml"):
        text = (ROOT / "tests" / "eval_tasks" / name).read_text().replace("DATA_DIR", str(folder))
        (folder / name).write_text(text)
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def tiny(tiny_run):
    cfg, tok, params = load_model(tiny_run)
    return cfg, tok, params, Generator(params, cfg, tok, max_batch=16, chunk_steps=16)


def _evaluate(model, tasks, names=("jaxgen_mc", "jaxgen_gen"), **kw):
    return lm_eval.simple_evaluate(model=model, tasks=list(names), task_manager=tasks, log_samples=True,
                                   batch_size=kw.pop("batch_size", 8), random_seed=0, **kw)  # fmt: skip


def _check_against_jaxgen(results, gen: Generator, tok) -> None:
    """Every log-likelihood equals `score` of the same tokens; the accuracy is the share of examples whose
    best-scoring choice is the answer; every generation equals Generator's greedy output cut at "\\n"."""
    samples = results["samples"]["jaxgen_mc"]
    assert len(samples) == len(MC)
    correct = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        got = [r[0] for r in s["resps"]]  # one (loglikelihood, is_greedy) per choice
        pairs = [_encode_pair(tok, ctx, cont) for ctx, cont in s["arguments"]]  # the choices, " " before each
        want = gen.score([p[0] for p in pairs], [p[1] for p in pairs])
        np.testing.assert_allclose([g[0] for g in got], [w["logprob"] for w in want], atol=1e-4)
        assert [bool(g[1]) for g in got] == [w["greedy"] for w in want]
        correct.append(int(np.argmax([w["logprob"] for w in want])) == MC[s["doc_id"]][2])
    assert results["results"]["jaxgen_mc"]["acc,none"] == pytest.approx(np.mean(correct))
    prompts = [p for p, _ in GEN]
    outs = gen.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0.0, stop=("\n",)))
    by_doc = {s["doc_id"]: s["resps"][0][0] for s in results["samples"]["jaxgen_gen"]}
    assert [by_doc[i] for i in range(len(GEN))] == [o.text for o in outs]


def _encode_pair(tok, context: str, continuation: str):
    """lm-eval's split for causal models: the context's trailing spaces go to the continuation, then the
    whole string is encoded and the context's tokens split off."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation, special=False), tok.encode(context, special=False)
    return ctx, whole[len(ctx) :]


def test_lm_eval_local_completions_against_the_server(tiny, tasks):
    """lm-eval as a new user runs it: `local-completions` at the server, its default settings (token-id
    prompts, the server's tokenizer through /tokenizer_info and /tokenize), batches of 8 prompts."""
    cfg, tok, params, gen = tiny
    engine = Engine(params, cfg, tok, ServeConfig(slots=8, num_pages=64, chunk_steps=8, prefill_chunk=64))
    with live_server(engine, create_app(engine, "tiny")) as (url, _):
        args = {"base_url": f"{url}/v1/completions", "model": "tiny", "tokenizer_backend": "auto",
                "max_retries": 1, "num_concurrent": 2}  # fmt: skip
        results = _evaluate("local-completions", tasks, model_args=args)
    assert results["config"]["model_args"]["tokenizer_backend"] == "auto"
    _check_against_jaxgen(results, gen, tok)


def test_lm_eval_native_model(tiny, tasks):
    cfg, tok, params, gen = tiny
    lm = JaxgenLM(model=(cfg, tok, params), batch_size=8, slots=4)
    _check_against_jaxgen(_evaluate(lm, tasks), gen, tok)
    (rolling,) = lm.loglikelihood_rolling([_Instance(("def add(a, b):\n    return a + b\n",))])
    ids = tok.encode("def add(a, b):\n    return a + b\n", special=False)
    (want,) = gen.score([[tok.eos_id]], [ids])  # one window: the end-of-text token, then the whole text
    assert rolling == pytest.approx(want["logprob"], abs=1e-4)


class _Instance:
    def __init__(self, args):
        self.args = args


def test_command_line_on_a_hugging_face_folder_equals_transformers(tmp_path, tasks):
    """`python -m jaxgen.evaluation --model jaxgen --model_args checkpoint=DIR` (lm-eval's command line) on a
    Llama from transformers' config class (random weights, saved with save_pretrained): every
    multiple-choice log-likelihood equals transformers' own."""
    import subprocess
    import sys

    import torch
    import transformers

    from jaxgen.tokenizer import Tokenizer

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                      eos_token_id=256, bos_token_id=256)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    folder, out = tmp_path / "llama", tmp_path / "out"
    ref.save_pretrained(folder)
    Tokenizer.byte_level().save_folder(folder)
    command = [sys.executable, "-m", "jaxgen.evaluation", "--model", "jaxgen", "--model_args",
               f"checkpoint={folder}", "--tasks", "jaxgen_mc", "--include_path", str(tasks.include_path),
               "--batch_size", "16",
               "--log_samples", "--output_path", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jaxgen_mc" in done.stdout and "acc" in done.stdout  # lm-eval's results table
    (samples,) = out.rglob("samples_jaxgen_mc_*.jsonl")
    tok = Tokenizer.byte_level()
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == len(MC)
    for s in lines:
        for (got,), args in zip(s["resps"], s["arguments"].values(), strict=True):  # the file's shape
            ctx, cont = _encode_pair(tok, args["arg_0"], args["arg_1"])
            with torch.no_grad():
                logp = torch.log_softmax(ref(torch.tensor([ctx + cont])).logits[0].double(), -1)
            want = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
            assert float(got[0]) == pytest.approx(want, abs=1e-4)


def test_command_line_on_a_run_without_a_checkpoint_says_so_in_one_line(tmp_path, tasks):
    """Issue 31: the right error, then a traceback and orbax's thread failing at interpreter exit."""
    import shutil
    import subprocess
    import sys

    from jaxgen.tokenizer import Tokenizer

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", run / "config.yaml")
    Tokenizer.byte_level().save_folder(run)
    command = [sys.executable, "-m", "jaxgen.evaluation", "--model", "jaxgen", "--model_args", f"checkpoint={run}",
               "--tasks", "jaxgen_mc", "--include_path", str(tasks.include_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1
    assert f"error: {run} has no checkpoint yet" in done.stderr
    assert "Traceback" not in done.stderr and "RuntimeError" not in done.stderr, done.stderr[-3000:]


def test_command_line_offline_says_in_one_line_that_the_task_data_could_not_be_downloaded(tiny_run, tmp_path):
    """Issue 44: the Quick start's hellaswag line without network ended in a ConnectionError traceback."""
    import os
    import subprocess
    import sys

    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # no cache
    command = [sys.executable, "-m", "jaxgen.evaluation", "--model", "jaxgen", "--model_args",
               f"checkpoint={tiny_run}", "--tasks", "hellaswag", "--limit", "1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 1
    assert "error: a task's data could not be downloaded" in done.stderr and "--include_path" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
