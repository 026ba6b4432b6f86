"""A reward for the kill -9 test of tests/test_rl_loop.py: the built-in task's exact match, which in a run
started with $JAXGEN_TEST_PAUSE_AFTER=K stops (sleeps until killed) once K steps' rewards are done, so that
the test kills the run mid-way however fast or slow the machine is. Imports nothing of the test suite (a
child process of rl.py imports it)."""

import itertools
import os
import time

from jaxgen.rl.tasks import exact_match

_calls = itertools.count()


def exact_match_pausing(prompt: str, completion: str, **fields) -> float:
    pause_after = int(os.environ.get("JAXGEN_TEST_PAUSE_AFTER", "0"))
    if pause_after and next(_calls) >= pause_after * int(os.environ["JAXGEN_TEST_ROWS_PER_STEP"]):
        time.sleep(3600)  # the test kills this process here
    return exact_match(prompt, completion, **fields)
