"""Run by test_multiprocess under launch.py: Generator on a tensor-parallel mesh over every process's devices.

python launch.py -n 2 --cpu-devices 1 -- python tests/mp_generate.py RUN_DIR OUT.json
"""

import json
import sys

from jaxgen.config import DistributedConfig, MeshConfig
from jaxgen.distributed import initialize

initialize(DistributedConfig())

import jax  # noqa: E402

from jaxgen.inference.generator import Generator  # noqa: E402
from jaxgen.inference.loading import load_run  # noqa: E402
from jaxgen.inference.sampling import SamplingConfig  # noqa: E402
from jaxgen.sharding import make_mesh  # noqa: E402

PROMPTS = ["def main(", "import os\n", "class Config:", "x"]
CONFIGS = [SamplingConfig(max_new_tokens=12, temperature=t, seed=7) for t in (0.0, 0.9, 0.0, 1.2)]


def main(run_dir: str, out: str) -> None:
    mesh = make_mesh(MeshConfig(data=1, tensor=-1))  # every device of every process
    cfg, tokenizer, params = load_run(run_dir, mesh=mesh)
    gen = Generator(params, cfg.model, tokenizer, mesh=mesh)
    results = gen.generate(PROMPTS, CONFIGS)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"devices": jax.device_count(), "tokens": [r.tokens for r in results]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
