"""Where the test suite's time goes: a pytest plugin that writes, for every test, its wall time and the
seconds jax spent tracing, lowering and compiling in that test's process (and that process's id: which
worker ran it); and, run as a script, a table of those figures per test file.

    PYTHONPATH=. pytest -p bench.suite_profile          # writes suite-profile.jsonl (SUITE_PROFILE= elsewhere)
    python bench/suite_profile.py suite-profile.jsonl   # the table, slowest file first

(`bench` itself must not be on the path: its multiprocess.py would hide the `multiprocess` package that
`datasets` imports, and the evaluation and preference tests would fail to import.) A test's wall time
includes the set-up of the fixtures it is the first to ask for. What the processes a test starts compile is
not counted (their seconds show in the wall time only)."""

import collections
import json
import os
import sys
import time

import pytest

_PHASES = {  # jax.monitoring's events, as the table names them
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_seconds = collections.Counter()


def _listen(event: str, duration: float, **_):
    if event in _PHASES:
        _seconds[_PHASES[event]] += duration


def pytest_configure(config):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = dict(_seconds), time.perf_counter()
    try:
        return (yield)
    finally:
        row = {"test": item.nodeid, "wall": time.perf_counter() - start, "pid": os.getpid()}
        row |= {k: v - before.get(k, 0.0) for k, v in _seconds.items()}
        with open(os.environ.get("SUITE_PROFILE", "suite-profile.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def table(path: str) -> str:
    files = collections.defaultdict(collections.Counter)
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    for row in rows:
        f = files[row["test"].split("::")[0]]
        f["tests"] += 1
        for k in ("wall", *_PHASES.values()):
            f[k] += row.get(k, 0.0)
    total = sum((f for f in files.values()), collections.Counter())
    out = ["| file | tests | wall s | compile s | trace + lower s | compile share |", "|---|---|---|---|---|---|"]
    for name, f in [*sorted(files.items(), key=lambda kv: -kv[1]["wall"]), ("all", total)]:
        share = f["compile"] / f["wall"] if f["wall"] else 0.0
        out.append(f"| {name} | {f['tests']} | {f['wall']:.0f} | {f['compile']:.0f} | "
                   f"{f['trace'] + f['lower']:.0f} | {share:.0%} |")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(table(sys.argv[1]))
