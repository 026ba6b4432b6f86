"""Damaged checkpoints, a failed first attempt, a full disk and non-finite metrics: one line each, nothing lost."""

import errno
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

import train
from jaxgen.config import ConfigError, MeshConfig, load_config
from jaxgen.inference.loading import load_run
from jaxgen.sharding import make_mesh
from jaxgen.training import trainer
from jaxgen.training.checkpoint import Checkpointer, CheckpointError
from jaxgen.training.metrics import MetricsWriter, plot_loss, read_metrics


def argv(run_dir, token_cache, *overrides):
    return [
        "--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--no-progress", f"data.cache_dir={token_cache}",
        "mesh.data=1", "training.steps=4", "checkpoint.every=2", "training.eval_every=100", *overrides,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, token_cache):
    """A finished run of 4 steps with checkpoints at 2 and 4 (copied by each test that damages it)."""
    run_dir = tmp_path_factory.mktemp("four_steps") / "run"
    assert train.main(argv(run_dir, token_cache)) == 0
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4]
    return run_dir


@pytest.fixture
def run_copy(four_steps, tmp_path):
    return shutil.copytree(four_steps, tmp_path / "run")


def damage(run_dir, step, how="truncate"):
    """Cuts every array-data file of a checkpoint to half its size, or deletes it."""
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("d/*") if p.is_file()]
    assert files
    for p in files:
        os.truncate(p, p.stat().st_size // 2) if how == "truncate" else p.unlink()


def one_device():
    return make_mesh(MeshConfig(data=1))


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_damaged_newest_checkpoint_of_a_finished_run_trains_its_steps_again(run_copy, token_cache, capfd):
    damage(run_copy, 4)
    assert train.main(argv(run_copy, token_cache)) == 0
    out, err = capfd.readouterr()
    assert f"warning: checkpoint {run_copy / 'checkpoints' / '4'} does not restore" in err and "trying step 2" in err
    assert len(err.splitlines()) == 1, err
    assert f"resuming {run_copy} from step 2" in out and "already finished" not in out
    assert (run_copy / "checkpoints_damaged" / "4").is_dir()  # set aside, not deleted
    first, again = records(run_copy)[:4], records(run_copy)[4:]
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in first[2:]]  # the same steps, bitwise
    assert train.main(argv(run_copy, token_cache)) == 0
    assert "already finished: 4 of training.steps=4" in capfd.readouterr().out


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_load_run_falls_back_to_the_newest_good_checkpoint(run_copy, how, capsys):
    _, _, expected = load_run(run_copy, mesh=one_device(), step=2)
    damage(run_copy, 4, how)
    _, _, params = load_run(run_copy, mesh=one_device())
    err = capsys.readouterr().err
    assert f"warning: checkpoint {run_copy / 'checkpoints' / '4'} does not restore" in err and "trying step 2" in err
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_checkpoint_restores_is_one_clear_error(run_copy, token_cache, capfd):
    import serve

    damage(run_copy, 4)
    damage(run_copy, 2, "delete")
    folder = run_copy / "checkpoints"
    with pytest.raises(CheckpointError, match=re.escape(f"no checkpoint in {folder} restores")):
        load_run(run_copy, mesh=one_device())
    capfd.readouterr()
    assert train.main(argv(run_copy, token_cache)) == 1
    err = capfd.readouterr().err
    assert err.splitlines()[-1].startswith(f"error: no checkpoint in {folder} restores (tried steps 4, 2;")
    assert len(err.splitlines()) == 3 and "Traceback" not in err, err  # two warnings and the error
    assert serve.main(["generate", "--checkpoint", str(run_copy), "--prompt", "x"]) == 1
    assert capfd.readouterr().err.splitlines()[-1].startswith(f"error: no checkpoint in {folder} restores")


def test_finished_run_is_not_restored_to_say_so(four_steps, token_cache, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a finished run restored its optimizer state")

    monkeypatch.setattr(Checkpointer, "restore", refuse)
    assert train.main(argv(four_steps, token_cache)) == 0
    assert "already finished: 4 of training.steps=4" in capsys.readouterr().out


def test_a_failed_first_attempt_does_not_bind_the_run_folder(tmp_path, token_cache, capsys):
    (tmp_path / "empty.txt").write_text("")
    run_dir = tmp_path / "run"
    files = ["data.source=files", f"data.paths=[{tmp_path / 'empty.*'}]"]
    assert train.main(argv(run_dir, token_cache, *files)) == 1
    assert "error: the corpus has" in capsys.readouterr().err
    assert train.main(argv(run_dir, token_cache, "training.steps=2")) == 0  # the corrected command
    assert load_config(run_dir / "config.yaml").data.source == "stdlib"


def test_a_run_with_checkpoints_still_refuses_another_model(run_copy, tiny_cfg):
    import dataclasses

    other = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, num_layers=3))
    with pytest.raises(ConfigError, match="different `model` section"):
        trainer.prepare_run_dir(other, run_copy)
    assert not list(run_copy.glob(".*.tmp"))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _tensorstore_enospc(*args, **kwargs):  # how orbax's async write reports it, on wait or close
    raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']")


@pytest.mark.parametrize(
    "target, raiser, what",
    [
        ("jaxgen.training.metrics.MetricsWriter.write", _enospc, "metrics.jsonl"),
        ("jaxgen.training.checkpoint.Checkpointer.save", _enospc, "a checkpoint in"),
        ("jaxgen.training.checkpoint.Checkpointer.wait", _tensorstore_enospc, "a checkpoint in"),
    ],
)
def test_disk_full_is_one_line(tmp_path, token_cache, capfd, monkeypatch, target, raiser, what):
    monkeypatch.setattr(target, raiser)
    assert train.main(argv(tmp_path / "run", token_cache, "training.steps=2")) == 1
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: disk full while writing ") and what in err
    assert err.rstrip().endswith("free space and run the same command to resume")


def test_nonfinite_metrics_stay_valid_json(tmp_path):
    with MetricsWriter(tmp_path) as m:
        m.write({"step": 1, "loss": 2.5, "grad_norm": 1.0})
        m.write({"step": 2, "loss": float("nan"), "grad_norm": np.float32("inf"), "lr": 1e-3})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # a line cut short by a crash
    with MetricsWriter(tmp_path) as m:
        m.write({"step": 3, "loss": 2.0})

    def strict(constant):
        raise ValueError(f"bare {constant} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == '{"step": 3, "lo'  # kept on its own line, and skipped by read_metrics
    first, second, third = (json.loads(lines[i], parse_constant=strict) for i in (0, 1, 3))
    assert second == {
        "step": 2,
        "loss": None,
        "grad_norm": None,
        "lr": 1e-3,
        "nonfinite": {"loss": "nan", "grad_norm": "inf"},
    }
    assert read_metrics(tmp_path) == [first, second, third]
    assert plot_loss(tmp_path).exists()
