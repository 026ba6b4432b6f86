"""Loading the store of executables (issue 45): one at a time against threads, and an engine's start with and
without `Store.prefetch`.

    python bench/store_loads.py --store ~/.cache/jaxgen/executables          # every entry, 1, 2 and 4 threads
    python bench/store_loads.py --store S --run runs/default --repeat 3       # an engine's start, prefetch on/off

`--store` alone: every entry of the folder deserialized and loaded (`deserialize_and_load`) one after another,
then in 2 and 4 threads, twice each, in one process (the fingerprint is not checked: the bytes are loaded as
they are). With `--run`: `serve.py http`'s start in a new process per row (the engine built from the run folder
as serve.py builds it, 4 slots, 0.25 GB of pages, then its precompile) on the store S (which should hold that
engine's programs: start serve.py once with JAXGEN_EXECUTABLES=S first), alternating prefetch on and off.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

START = """
import json, sys, time
t0 = time.perf_counter()
from jaxgen import executables
from jaxgen.inference.precompile import precompile
from jaxgen.serving import cli
if sys.argv[2] == "off":
    executables.Store.prefetch = lambda self, group, workers=2: 0
_, args = cli.parse_args(["http", "--checkpoint", sys.argv[1], "--slots", "4", "--kv-memory-gb", "0.25"])
engine = cli._engine(args, cli.command_config(args))
t1 = time.perf_counter()
precompile(engine)
t2 = time.perf_counter()
print(json.dumps({"engine_s": t1 - t0, "precompile_s": t2 - t1, "loaded": executables.current().loaded,
                  "traced": engine.compilations}))
"""


def loads(store: Path) -> None:
    import jax
    from jax.experimental.serialize_executable import deserialize_and_load

    payloads = [f.read_bytes().partition(b"\n")[2] for f in sorted(store.glob("*.jaxexe"))]
    jax.devices()

    def one(payload: bytes) -> None:
        deserialize_and_load(*pickle.loads(payload))

    print(f"{len(payloads)} entries in {store}\n\n| threads | seconds (run 1) | seconds (run 2) |\n|---|---|---|")
    for workers in (1, 2, 4):
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, payloads))
            seconds.append(time.perf_counter() - t0)
        print(f"| {workers} | {seconds[0]:.2f} | {seconds[1]:.2f} |")


def starts(store: Path, run: Path, repeat: int) -> None:
    env = os.environ | {"JAXGEN_EXECUTABLES": str(store), "JAX_PLATFORMS": "cpu"}
    print("| prefetch | imports + weights + engine (s) | precompile (s) | loaded | traced |\n|---|---|---|---|---|")
    for _ in range(repeat):
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, "-c", START, str(run), mode], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {mode} | {r['engine_s']:.2f} | {r['precompile_s']:.2f} | {r['loaded']} | {r['traced']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, required=True, help="a folder of stored executables")
    p.add_argument("--run", type=Path, help="a run folder: time an engine's start on the store instead")
    p.add_argument("--repeat", type=int, default=3, help="starts with prefetch on and off, alternating (default 3)")
    args = p.parse_args()
    store = args.store.expanduser()
    if not store.is_dir():
        p.error(f"--store {store} is not a folder")
    if args.run is None:
        loads(store)
    else:
        starts(store, args.run, args.repeat)


if __name__ == "__main__":
    main()
