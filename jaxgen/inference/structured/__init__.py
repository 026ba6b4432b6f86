"""Structured output: a JSON schema, a regular expression, a choice of strings or a context-free grammar,
compiled to a token automaton that lives on the device.

spec.py        what a row may write: `Structured` (its fields are the kinds, `KINDS`), schema -> regex
ecma.py        regular expressions read as ECMA-262 reads them (`\\d` is [0-9]): schema patterns, regex constraints
grammar.py     context-free grammars (Lark, GBNF) as regular expressions, recursion unrolled to a bounded depth
automaton.py   the token automaton as a dense (S, V) table, the vocabulary's bytes
compiler.py    the compile worker's client: time limit, restarts, the cache (`compile_automaton`, `Constraints`)
worker.py      the compile worker, run as a script (outlines-core; imports neither jaxgen nor JAX)
pool.py        the device's tables: a batch's automata (`layout`, `stack`), the engine's slots (`GrammarPool`)

A constraint is first a regular expression (outlines-core writes one for a JSON schema), then a
deterministic automaton over the tokenizer's tokens (outlines-core's `Index`), kept as a dense table:
`next_state[s, t]` is the state after token t in state s, -1 where t is not allowed. The decode loop
carries each row's state: it masks the logits to the tokens the state allows and moves along the table
after the draw, on the device, so a constrained row never waits for the host.

Why outlines-core: it hands over the whole token-level automaton, which is what can live on the device;
llguidance and xgrammar compute each step's mask on the host (fast, but a host round trip a token). The
price: regular languages only. A context-free grammar becomes one with its recursion unrolled to a fixed
depth (`grammar.py`: every output is in the grammar's language, nesting deeper is not generated), as
outlines-core unrolls recursive schemas. Its automata are not minimal: the worker merges equivalent states
(the tests' arithmetic grammar: 9,848 states -> 9).

Adding a kind: a field of `Structured` with its check and its `pattern` (spec.py); the HTTP server's
`guided_<kind>` field (serving/protocol.py; `tests/test_structured_server.py` checks the server accepts
exactly KINDS); everything else reads KINDS.
"""

from jaxgen.inference.structured.automaton import Automaton, Vocabulary
from jaxgen.inference.structured.compiler import Constraints, compile_automaton
from jaxgen.inference.structured.pool import GrammarPool, table_rows
from jaxgen.inference.structured.spec import JSON_OBJECT, KINDS, Structured, schema_regex

__all__ = [
    "JSON_OBJECT",
    "KINDS",
    "Automaton",
    "Constraints",
    "GrammarPool",
    "Structured",
    "Vocabulary",
    "compile_automaton",
    "schema_regex",
    "table_rows",
]
