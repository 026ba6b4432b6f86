"""The compile worker of `compiler.py`, run as a script (`python worker.py`) so that it imports
neither jaxgen nor JAX, nor the caller's main module (multiprocessing's spawn would re-run a user's script
that has no `if __name__ == "__main__"` guard). It reads (kind, text, token bytes, end-of-sequence ids, width)
requests as pickles on stdin, kind "regex" or "grammar" (a context-free grammar, turned into a regular
expression here by grammar.py, under the same time and memory limits), and answers each with ("ok", edges),
("grammar", what was wrong with a grammar) or ("error", message) on stdout.
"""

import pickle
import sys

import numpy as np

END = "\U0010fffd\U0010fffe"  # text no output holds: it marks where the pattern may end (see `edges`)


def edges(pattern: str, tokens, eos_ids, size: int):
    """outlines-core's automaton of `pattern` over the tokens (bytes per id, None for special ones) as
    (states, src, token, dst, final states), numbered from 0 = the start. Edges, not a dense table, cross
    the pipe: a few KB where the table can be a hundred MB.

    outlines-core 0.2.14 drops a token that leads from a state where a match ended into one where it did not
    (`a(bc)*` would never write "b" after "a": fixed upstream after that release). So the automaton is
    built for the pattern followed by END, read by a token of its own: no match ends before END, so no edge
    is dropped, and a state is final exactly when END leads from it to a match (w END matches pattern END
    exactly when w matches pattern)."""
    from outlines_core import Index, Vocabulary

    by_bytes = {}
    for i, b in enumerate(tokens):
        if b and i not in eos_ids:
            by_bytes.setdefault(b, []).append(i)
    end_token = max(size, len(tokens), *eos_ids) + 1
    by_bytes[END.encode()] = [end_token]
    index = Index(f"({pattern}){END}", Vocabulary(eos_ids[0], by_bytes))
    transitions = index.get_transitions()
    matched = set(index.get_final_states())
    names = [index.get_initial_state()]
    names += sorted((set(transitions) | matched) - {names[0]})
    local = {s: k for k, s in enumerate(names)}
    src, tok, dst = [], [], []
    finals = sorted(local[s] for s, moves in transitions.items() if moves.get(end_token) in matched)
    for s, moves in transitions.items():
        for t, n in moves.items():
            if t not in eos_ids and t < size:
                src.append(local[s]), tok.append(t), dst.append(local[n])
    src, tok, dst = trim(*(np.asarray(x, np.int64) for x in (src, tok, dst)), np.asarray(finals, np.int64))
    return minimal(len(names), src, tok, dst, np.asarray(finals, np.int64))


def trim(src, tok, dst, finals):
    """The edges into states from which a final state can be reached: a token that starts END (or leads
    nowhere else) must not be drawn, or its row could never end. (A breadth-first search backwards from the
    final states: linear in the edges, however long the automaton's chains.)"""
    states = max(src.max(initial=0), dst.max(initial=0), finals.max(initial=0)) + 1
    order = np.argsort(dst, kind="stable")
    starts = np.searchsorted(dst[order], np.arange(states + 1))
    live = np.zeros(states, bool)
    live[finals] = True
    frontier = list(np.unique(finals))
    while frontier:
        s = frontier.pop()
        before = src[order[starts[s] : starts[s + 1]]]
        new = np.unique(before[~live[before]])
        live[new] = True
        frontier.extend(new.tolist())
    keep = live[dst]
    return src[keep], tok[keep], dst[keep]


MOORE_ROUNDS = 256  # refinement rounds before minimising is given up (each round costs one pass over the edges)


def minimal(states: int, src, tok, dst, finals):
    """The same automaton with equivalent states merged (Moore's refinement: states are split by finality,
    then by the class each token leads to, until nothing splits), the start still state 0, as int32 arrays.
    outlines-core does not minimise, and a regular expression with repeated parts (a grammar unrolled, JSON
    with nested objects) determinises to thousands of states that a handful can do. Each round groups states
    by a 64-bit hash of their edges; the result is then checked exactly (every member of a class has the
    same edges to the same classes) and the automaton is returned unminimised in the rare case it fails."""
    order = np.lexsort((tok, src))
    src, tok, dst = src[order], tok[order], dst[order]
    cls = np.zeros(states, np.int64)
    cls[finals] = 1
    count = len(np.unique(cls))
    key = _mix(tok.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]]) if len(src) else np.zeros(0, np.int64)
    for _ in range(MOORE_ROUNDS):
        h = np.zeros(states, np.uint64)
        if len(src):
            h[src[starts]] = np.add.reduceat(_mix(key ^ (cls[dst].astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9))),
                                             starts)  # fmt: skip
        with np.errstate(over="ignore"):
            h = _mix(h ^ (cls.astype(np.uint64) * np.uint64(0x94D049BB133111EB)))
        _, cls = np.unique(h, return_inverse=True)
        cls = cls.reshape(-1).astype(np.int64)
        if cls.max() + 1 == count:
            break
        count = int(cls.max()) + 1
    else:  # a long chain of states splits one state a round: left as it is (correct, only larger)
        return states, *(x.astype(np.int32) for x in (src, tok, dst)), finals.astype(np.int32)
    triples = np.unique(np.stack([cls[src], tok, cls[dst]], 1), axis=0)
    final = np.zeros(states, np.int64)
    final[finals] = 1
    first = np.unique(cls, return_index=True)[1]  # a member of each class
    degree = np.bincount(src, minlength=states)
    exact = np.all(degree == degree[first][cls]) and np.all(final == final[first][cls])
    if not exact or len(triples) != degree[first].sum():  # a hash collision merged states that differ
        return states, *(x.astype(np.int32) for x in (src, tok, dst)), finals.astype(np.int32)
    rename = np.full(count, -1, np.int64)  # the start's class first, then the others in order
    rename[cls[0]] = 0
    rename[rename < 0] = np.arange(1, count)
    src, tok, dst = rename[triples[:, 0]], triples[:, 1], rename[triples[:, 2]]
    return count, *(x.astype(np.int32) for x in (src, tok, dst)), np.unique(rename[cls[finals]]).astype(np.int32)


def _mix(x):
    """splitmix64's finaliser: a 64-bit hash of each value (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


MEMORY_LIMIT = 4 * 2**30  # address space: a pattern whose automaton explodes fails here, not the machine


def answer(kind: str, text: str, tokens, eos_ids, size: int):
    """("ok", edges) for a regular expression or a grammar (`grammar.py`, beside this file, unrolls it to one);
    ("grammar", what was wrong) for a grammar that cannot be used."""
    if kind == "grammar":
        import grammar

        try:
            text = grammar.grammar_regex(text)
        except grammar.GrammarError as e:
            return "grammar", str(e)
    return "ok", edges(text, tokens, eos_ids, size)


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
            result = answer(*request)
        except MemoryError:
            result = ("error", f"the automaton needs more than {MEMORY_LIMIT / 2**30:.0f} GB to build")
        except Exception as e:  # outlines-core's errors for a pattern it cannot read, said back to the caller
            result = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(result, stdout)
        stdout.flush()


if __name__ == "__main__":
    main()
