"""The compile worker's client: constraints compiled to automata in a worker process, with a time limit.

    compile_automaton(structured, vocab) -> Automaton    cached: a schema every request repeats compiles once
    Constraints(tokenizer, model_vocab).automaton(s)     the same, the vocabulary's bytes read at first use

Compiling runs in a worker process (`worker.py`, a script: it imports neither jaxgen nor JAX): a regular
expression whose automaton explodes costs a 400 after COMPILE_TIMEOUT_S, not the server.
"""

from __future__ import annotations

import atexit
import functools
import pickle
import select
import subprocess
import sys
import threading
from pathlib import Path

from jaxgen.inference.errors import SamplingError
from jaxgen.inference.structured.automaton import Automaton, Vocabulary, dense_table
from jaxgen.inference.structured.spec import FIELD, Structured

COMPILE_TIMEOUT_S = 10.0  # one worker builds one automaton at a time: a hostile one holds the others this long


class _Compiler:
    """One worker process (`worker.py`) that builds automata, restarted when a build runs past its
    time limit or dies."""

    def __init__(self):
        self._proc = None
        self._lock = threading.Lock()

    def build(self, source: tuple[str, str], vocab: Vocabulary, timeout: float) -> tuple:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                worker = Path(__file__).with_name("worker.py")
                self._proc = subprocess.Popen([sys.executable, str(worker)], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE)  # fmt: skip
            try:
                pickle.dump((*source, vocab.tokens, vocab.eos_ids, vocab.size), self._proc.stdin)
                self._proc.stdin.flush()
                ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
                if not ready:
                    self._stop()
                    raise SamplingError(f"{FIELD}: the constraint's automaton did not compile in {timeout:.0f} s "
                                        "(a regular expression or grammar whose automaton explodes?)",
                                        FIELD)  # fmt: skip
                status, value = pickle.load(self._proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError):
                self._stop()
                raise SamplingError(f"{FIELD}: the compile worker died building the constraint's automaton (out "
                                    "of memory?)", FIELD) from None  # fmt: skip
        if status == "grammar":
            raise SamplingError(f"{FIELD}.grammar: {value}", FIELD)
        if status != "ok":
            raise SamplingError(f"{FIELD}: the constraint cannot be compiled: {value}", FIELD)
        return value

    def _stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop()


_COMPILER = _Compiler()
atexit.register(_COMPILER.close)


@functools.lru_cache(maxsize=256)
def compile_automaton(structured: Structured, vocab: Vocabulary, timeout: float | None = None) -> Automaton:
    """The automaton of `structured` over `vocab` (cached: a schema every request repeats compiles once).
    SamplingError (field `structured`) for a constraint that cannot be compiled or allows no output.
    timeout: seconds, COMPILE_TIMEOUT_S (read at the call, so a test can lower it) when None."""
    seconds = COMPILE_TIMEOUT_S if timeout is None else timeout
    table = dense_table(*_COMPILER.build(structured.source(), vocab, seconds), vocab)
    automaton = Automaton(table)
    if not (table[0] >= 0).any():
        raise SamplingError(f"{FIELD}: no output satisfies the constraint with this tokenizer", FIELD)
    return automaton


class Constraints:
    """The automata of one tokenizer and model: each token's bytes read once (at the first constrained
    request), each constraint compiled once (`compile_automaton`'s cache). Generator and Engine hold one."""

    def __init__(self, tokenizer, model_vocab: int):
        self.tokenizer, self.model_vocab = tokenizer, model_vocab
        self._vocab = None

    def automaton(self, structured: Structured | None) -> Automaton | None:
        """The token automaton of `structured` (None when free)."""
        if structured is None:
            return None
        if self._vocab is None:
            self._vocab = Vocabulary.of(self.tokenizer, self.model_vocab)
        return compile_automaton(structured, self._vocab)
