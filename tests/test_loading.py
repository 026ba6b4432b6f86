"""Loading a model for inference brings no training machinery with it."""

import subprocess
import sys
from pathlib import Path


def test_importing_loading_imports_no_trainer_data_pipeline_or_optimizer():
    code = (
        "import sys, jaxgen.inference.loading\n"
        "print(sorted(m for m in ('jaxgen.training.trainer', 'grain', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_training_package_still_offers_train():
    from jaxgen.training import TrainResult, train
    from jaxgen.training.trainer import TrainResult as result
    from jaxgen.training.trainer import train as run

    assert (train, TrainResult) == (run, result)
