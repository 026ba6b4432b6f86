"""Compiling for an NVIDIA GPU this machine lacks, and counting what a compiled loop launches per step.

    device = cuda_device(spec_text)                  # None (and why: `unavailable`) without the plugin
    text = decode_loop_text(generator, prompts, sampling, device)
    loop_ops(text)                                   # the decode loop body's operations, by opcode

    python -m jaxgen.targets.gpu [--config configs/tiny.yaml] [--slots 512] [--rows 1] [--engine] [--set K=V]
        # JSON: per cache layout, the conditionals, kernels and HBM megabytes a layer adds to a decode step (sm_90);
        # --engine: also the serving engine's paged decode chunk; --set: a dotted override of the config

The CUDA plugin (`pip install '.[gpu-compile]'`) compiles for a GPU described by a target config, a
`GpuTargetConfigProto` text (targets/specs/), under `JAX_PLATFORMS=cpu` and without a device:
`jax.experimental.topologies` gives a device of that GPU to place abstract arguments on, and the program
is XLA:GPU's optimised HLO, the kernels a real GPU would launch (bench/decode.py, tests/test_gpu_compile.py).
The plugin registers only where jax's platforms are cpu (elsewhere its CUDA version check fails without a
GPU), so the command line sets them and a process whose backends already started runs it as a subprocess.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import jax

from jaxgen.targets.catalog import SPECS
from jaxgen.targets.devices import traced_for
from jaxgen.targets.hlo import computations, hlo_counts, ops


def unavailable() -> str | None:
    """Why this machine cannot compile for a CUDA target (the plugin is not installed), or None."""
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        found = False
    return None if found else "the CUDA plugin is not installed (pip install '.[gpu-compile]')"


def cuda_device(spec_text: str):
    """A device of the GPU that `spec_text` (a GpuTargetConfigProto text) describes, to place abstract
    arguments on for `lower(...).compile()`; None where the plugin is not installed (`unavailable`)."""
    if unavailable():
        return None
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=spec_text, topology="1x1x1").devices[0]


class _Caught(Exception):
    pass


def decode_loop_text(generator, prompts, sampling, device) -> str:
    """Optimised HLO text of the decode loop (`inference.decode.decode_loop`, its `lax.while_loop`) that
    `generator` (a `Generator`) runs for `prompts` under `sampling`, compiled for `device` (`cuda_device`)
    and traced as a GPU traces it (`traced_for`). The loop's arguments are caught on their way in (the
    prompts' prefill runs here; the loop does not), so the cache has the layout `generator`'s config
    builds on this machine: set `model.cache_layout` to compile the other."""
    caught, loop = {}, generator._loop

    def catch(params, state, cfg):
        caught.update(params=params, state=state, cfg=cfg)
        raise _Caught

    generator._loop = catch
    try:
        generator.generate(prompts, sampling)
    except _Caught:
        pass
    finally:
        generator._loop = loop
    args = placed(caught["params"], device), placed(caught["state"], device)
    with traced_for("gpu"):
        return loop.jitted.lower(*args, cfg=caught["cfg"]).compile().as_text()


def placed(tree, device):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s on `device` (nothing allocated)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def loop_ops(hlo_text: str) -> collections.Counter:
    """The operations of one iteration of the largest `while` loop the entry computation runs (the
    decode loop), by opcode (`ops`), with "total" the sum: what a step launches."""
    comps = computations(hlo_text)
    bodies = [re.search(r"body=%?([\w.\-]+)", line).group(1) for line in comps["ENTRY"] if " while(" in line]
    if not bodies:
        raise ValueError("the compiled program runs no while loop")
    counts = max((ops(comps, body) for body in bodies), key=lambda c: sum(c.values()))
    counts["total"] = sum(counts.values())
    return counts


def per_layer(layout: str, cfg, slots: int, rows: int, device) -> dict:
    """For the contiguous cache's `layout`: the operations of a decode step of `cfg` at 1 layer (`rows`
    rows, a cache of `slots`), and what each further layer adds ("conditional", "kernels": all but the free
    ones), from compiles at 1 and 2 layers. The prompts' prefill runs here, on CPU."""
    from jaxgen import model
    from jaxgen.inference.generator import Generator
    from jaxgen.inference.sampling import SamplingConfig
    from jaxgen.tokenizer import Tokenizer

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    texts = []
    for layers in (1, 2):
        c = dataclasses.replace(cfg, num_layers=layers, cache_layout=layout, max_seq_len=max(cfg.max_seq_len, slots))
        gen = Generator(model.init_params(c, jax.random.key(0)), c, Tokenizer.byte_level(), max_batch=rows,
                        chunk_steps=8, min_cache_len=slots)  # fmt: skip
        texts.append(decode_loop_text(gen, [[1, 2, 3]] * rows, greedy, device))
    return _layer_adds(*texts)


def _layer_adds(one_layer: str, two_layers: str) -> dict:
    """From a decode program's HLO at 1 and 2 layers: a step's operations at 1 layer, and what the second
    layer adds: conditionals, kernels (every operation but the free ones) and HBM megabytes (`hlo_counts`)."""
    one, two = loop_ops(one_layer), loop_ops(two_layers)
    return {
        "step": dict(one),
        "conditional": two["conditional"] - one["conditional"],
        "kernels": two["total"] - one["total"],
        "layer_mb": round((hlo_counts(two_layers)[1] - hlo_counts(one_layer)[1]) / 1e6, 3),
    }


def engine_per_layer(cfg, slots: int, page_size: int, device) -> dict:
    """The serving engine's decode chunk (`inference.steps.decode_chunk`: the paged cache, every slot live)
    compiled for `device` at 1 and 2 layers of `cfg`: a step's operations and what each further layer adds,
    as `per_layer` counts them. Nothing runs: the state is abstract."""
    from jaxgen import model
    from jaxgen.config import ServeConfig
    from jaxgen.inference import steps

    one = jax.sharding.SingleDeviceSharding(device)
    texts = []
    for layers in (1, 2):
        c = dataclasses.replace(cfg, num_layers=layers, max_seq_len=max(cfg.max_seq_len, slots))
        serve = ServeConfig(slots=slots, page_size=page_size, num_pages=4 * slots, cache_dtype="bfloat16")
        params = jax.eval_shape(lambda c=c: model.decode_params(model.init_params(c, jax.random.key(0)), slots, c))
        pages = -(-c.max_seq_len // page_size)
        state = jax.eval_shape(lambda c=c, serve=serve, pages=pages: steps.init_state(c, serve, 4 * slots, pages))
        limit, retire = (
            jax.ShapeDtypeStruct((), "int32", sharding=one),
            jax.ShapeDtypeStruct((slots,), bool, sharding=one),
        )
        with traced_for("gpu"):
            lowered = jax.jit(steps.decode_chunk, static_argnames="cfg").lower(
                placed(params, device), placed(state, device), limit, retire, cfg=c
            )
        texts.append(lowered.compile().as_text())
    return _layer_adds(*texts)


def main(argv=None) -> int:
    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(SPECS / "h200.txtpb"), help="a GpuTargetConfigProto text")
    parser.add_argument("--config", default=str(root / "configs" / "tiny.yaml"))
    parser.add_argument("--slots", type=int, default=512, help="cache slots (the Generator's min_cache_len)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=["flat", "blocks"], choices=["flat", "blocks"])
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also the engine's paged decode chunk, every slot of --rows live (page size 16)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override of --config (repeatable), e.g. --set model.dtype=bfloat16",
    )
    args = parser.parse_args(argv)
    for setting in args.set:  # only the model is read: anything else would be ignored without a word
        if not setting.startswith("model."):
            parser.error(f"--set {setting} is not allowed: model.KEY=VALUE only (the model is what this compiles)")
    jax.config.update("jax_platforms", "cpu")  # before any backend starts: the plugin then registers
    reason = unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    from jaxgen.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set).model
    except ConfigError as e:  # a bad --set or config: one line, not a traceback
        parser.error(str(e))
    device = cuda_device(Path(args.spec).read_text())
    out = {layout: per_layer(layout, cfg, args.slots, args.rows, device) for layout in args.layouts}
    if args.engine:
        out["engine"] = engine_per_layer(cfg, args.rows, 16, device)
    print(json.dumps({"device": device.device_kind, "slots": args.slots, "rows": args.rows, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
