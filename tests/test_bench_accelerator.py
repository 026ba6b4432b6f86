"""bench/accelerator.py without an accelerator: every configuration its parts load (full shapes and --smoke's),
built and checked as the parts build them, nothing run; and its trace summary on fabricated events."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jaxgen.config import Config
from jaxgen.inference.budget import check_serving
from jaxgen.inference.decode import bucket
from jaxgen.inference.sampling import SamplingConfig, check_prompt

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_accelerator", ROOT / "bench" / "accelerator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("smoke", ["full", "smoke", "cpu-proxy"])
def test_every_part_configuration_loads(bench, smoke):
    shapes = {"full": bench.Shapes(), "smoke": bench.SMOKE, "cpu-proxy": bench.CPU_PROXY}[smoke]
    configs = bench.part_configs(shapes)  # load_config checks each (data.seq_len <= model.max_seq_len among them)
    expected = {f"train {rows}" for rows in shapes.train_rows} | {"decode small", "decode large", "batch", "engine"}
    assert set(configs) == expected
    for key, part in configs.items():
        cfg = part.run
        assert isinstance(cfg, Config) and cfg.model.dtype == "bfloat16", key
        if key.startswith("train"):
            assert (cfg.data.seq_len, cfg.model.remat) == (shapes.train_seq, shapes.remat), key
            assert cfg.training.batch_size == int(key.split()[1])
            continue
        # what the generation parts submit: prompt + new tokens within the context (Generator and engine alike)
        check_prompt([1] * part.prompt, cfg.model.vocab_size, cfg.model.max_seq_len)
        assert part.prompt + part.new_tokens < cfg.model.max_seq_len <= bucket(part.prompt + part.new_tokens + 1), key
        SamplingConfig(max_new_tokens=part.new_tokens, temperature=0.0, ignore_eos=True).check_for_model(
            cfg.model.vocab_size
        )
        if part.serve is not None:
            check_serving(cfg.model, part.serve)  # what Engine(...) checks before it allocates
            assert part.serve.slots == shapes.batch


def test_the_full_shapes_are_the_named_models(bench):
    """The figures in issue 50's tables are for these shapes: a config edit that changes them shows here."""
    configs = bench.part_configs(bench.Shapes())
    small, large = configs["decode small"].run.model, configs["decode large"].run.model
    assert (small.num_layers, small.d_model, small.vocab_size) == (16, 2048, 128256)
    assert (large.num_layers, large.d_model, large.d_ff) == (32, 4096, 14336)
    assert configs["train 8"].run.data.seq_len == 4096
    assert (configs["engine"].prompt, configs["engine"].new_tokens, bench.Shapes().requests) == (128, 128, 256)


@pytest.mark.parametrize("smoke", [False, True], ids=["full", "smoke"])
def test_the_transformers_side_builds_the_same_shapes(bench, smoke):
    pytest.importorskip("transformers")
    shapes = bench.SMOKE if smoke else bench.Shapes()
    for key in ("train 1" if not smoke else "train 2", "decode small", "batch"):
        model = bench.part_configs(shapes)[key].run.model
        theirs = bench.torch_config(model)
        assert (theirs.num_hidden_layers, theirs.hidden_size, theirs.vocab_size) == (
            model.num_layers,
            model.d_model,
            model.vocab_size,
        )
        assert (theirs.num_attention_heads, theirs.num_key_value_heads) == (model.num_heads, model.kv_heads)


def _events(device: bool) -> list[dict]:
    process = "/device:GPU:0" if device else "/host:CPU"
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": process}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "stream" if device else "python"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "tf_XLAEigen/1"}},
    ]
    ops = [("fusion", 7, 3.0), ("fusion", 8, 1.0), ("$python frame", 8, 50.0), ("gemm", 8, 10.0), ("host op", 2, 9.0)]
    ops.append(("ThunkExecutor::Execute", 8, 20.0))
    return meta + [{"ph": "X", "pid": 2 if n == "host op" else 1, "tid": t, "name": n, "dur": d} for n, t, d in ops]


def test_trace_summary_counts_device_operations(bench):
    # a device plane present: its events alone, whatever the thread
    on_device, source = bench._device_ops(_events(device=True))
    assert source == "the device's trace"
    assert on_device == {
        "fusion": (2, 4.0),
        "$python frame": (1, 50.0),
        "gemm": (1, 10.0),
        "ThunkExecutor::Execute": (1, 20.0),
    }
    # no device plane (XLA:CPU): the executor threads' events, not Python's frames nor its thread
    on_host, _ = bench._device_ops(_events(device=False))
    # not Python's frames, its thread, nor the runtime's spans (Class::method)
    assert on_host == {"fusion": (1, 1.0), "gemm": (1, 10.0), "host op": (1, 9.0)}
    per_step = bench._per_step({"gemm": (9, 90.0), "copy": (4, 8.0)}, {"gemm": (1, 10.0), "copy": (4, 8.0)}, 4)
    assert per_step == {"gemm": (2.0, 20.0)}
