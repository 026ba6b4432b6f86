"""The built-in task's reward for tests/test_rl_loop.py, able to stop a run mid-way: in a process started with
$JAXGEN_TEST_PAUSE_AFTER=K (and $JAXGEN_TEST_ROWS_PER_STEP), the reward sleeps until the process is killed once
K steps' rewards are done, so that the kill -9 test kills the run mid-way however fast or slow the machine is;
with $JAXGEN_TEST_PEAK_FILE, each call writes the process's peak resident memory so far (VmHWM, in kB) there.
Imports nothing of the test suite (a child process of rl.py imports it)."""

import itertools
import os
import time

from jaxgen.rl.tasks import exact_match

_calls = itertools.count()


def _pause_when_asked() -> None:
    _note_peak()
    pause_after = int(os.environ.get("JAXGEN_TEST_PAUSE_AFTER", "0"))
    if pause_after and next(_calls) >= pause_after * int(os.environ["JAXGEN_TEST_ROWS_PER_STEP"]):
        time.sleep(3600)  # the test kills this process here


def _note_peak() -> None:
    """VmHWM is this process image's own peak: unlike ru_maxrss it does not count the pages of the process that
    forked it (a pytest worker of several GB) before the exec."""
    path = os.environ.get("JAXGEN_TEST_PEAK_FILE")
    if path:
        with open("/proc/self/status") as f:
            peak = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
        with open(path, "w") as f:
            f.write(peak)


def exact_match_pausing(prompt: str, completion: str, **fields) -> float:
    """The built-in task's reward (1.0 for the exact answer), so a run with it is a run with the task's own."""
    _pause_when_asked()
    return exact_match(prompt, completion, **fields)
