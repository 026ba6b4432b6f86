"""The compile worker of `grammar.py`, run as a script (`python automaton_worker.py`) so that it imports
neither jaxgen nor JAX, nor the caller's main module (multiprocessing's spawn would re-run a user's script
that has no `if __name__ == "__main__"` guard). It reads (pattern, token bytes, end-of-sequence ids, width)
requests as pickles on stdin and answers each with ("ok", edges) or ("error", message) on stdout.
"""

import pickle
import sys

import numpy as np


def edges(pattern: str, tokens, eos_ids, size: int):
    """outlines-core's automaton of `pattern` over the tokens (bytes per id, None for special ones) as
    (states, src, token, dst, final states), numbered from 0 = the start. Edges, not a dense table, cross
    the pipe: a few KB where the table can be a hundred MB."""
    from outlines_core import Index, Vocabulary

    by_bytes = {}
    for i, b in enumerate(tokens):
        if b and i not in eos_ids:
            by_bytes.setdefault(b, []).append(i)
    index = Index(pattern, Vocabulary(eos_ids[0], by_bytes))
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    names = [index.get_initial_state()]
    names += sorted((set(transitions) | finals) - {names[0]})
    local = {s: k for k, s in enumerate(names)}
    src, tok, dst = [], [], []
    for s, moves in transitions.items():
        for t, n in moves.items():
            if t not in eos_ids and t < size:
                src.append(local[s]), tok.append(t), dst.append(local[n])
    arrays = (np.asarray(x, np.int32) for x in (src, tok, dst))
    return len(names), *arrays, np.asarray(sorted(local[f] for f in finals), np.int32)


MEMORY_LIMIT = 4 * 2**30  # address space: a pattern whose automaton explodes fails here, not the machine


def main() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            request = pickle.load(stdin)
        except EOFError:
            return
        try:
            answer = ("ok", edges(*request))
        except MemoryError:
            answer = ("error", f"the automaton needs more than {MEMORY_LIMIT / 2**30:.0f} GB to build")
        except Exception as e:  # outlines-core's errors for a pattern it cannot read, said back to the caller
            answer = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(answer, stdout)
        stdout.flush()


if __name__ == "__main__":
    main()
