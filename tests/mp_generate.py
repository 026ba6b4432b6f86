"""Run by test_multiprocess under launch.py: `serve.py generate` (when its arguments follow `--`), then Generator on
a tensor-parallel mesh over every process's devices, in the same processes (one start-up for both).

python launch.py -n 2 --cpu-devices 1 -- python tests/mp_generate.py RUN_DIR OUT.json [-- generate ARGS...]
"""

import json
import sys

from jaxgen.inference.sampling import SamplingConfig

PROMPTS = ["def main(", "import os\n", "class Config:", "x"]
CONFIGS = [SamplingConfig(max_new_tokens=12, temperature=t, seed=7) for t in (0.0, 0.9, 0.0, 1.2)]


def main(run_dir: str, out: str, *serve_argv: str) -> None:
    if serve_argv:  # serve.py's command line joins the processes (jaxgen.distributed.initialize) and runs its job
        from jaxgen.serving.cli import main as serve

        assert serve_argv[0] == "--" and serve(list(serve_argv[1:])) == 0, "serve.py generate failed"
    else:
        from jaxgen.config import DistributedConfig
        from jaxgen.distributed import initialize

        initialize(DistributedConfig())
    import jax

    from jaxgen.config import MeshConfig
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.loading import load_run
    from jaxgen.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=1, tensor=-1))  # every device of every process
    cfg, tokenizer, params = load_run(run_dir, mesh=mesh)
    gen = Generator(params, cfg.model, tokenizer, mesh=mesh)
    results = gen.generate(PROMPTS, CONFIGS)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"devices": jax.device_count(), "tokens": [r.tokens for r in results]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
