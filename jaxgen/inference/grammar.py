"""Structured output: a JSON schema, a regular expression, a choice of strings or a context-free grammar,
compiled to a token automaton that lives on the device.

    Structured(json=schema) | Structured(regex=r"\\d{4}") | Structured(choice=("yes", "no"))
    Structured(grammar='start: NUMBER ("+" NUMBER)*  ...')  (Lark, or GBNF `root ::= ...`: cfg.py)
    compile_automaton(structured, vocab) -> Automaton      next_state (S, V) int32, state 0 the start
    GrammarTable: the automata of a batch (or of the engine's slots) in one (S, V) table

A constraint is first a regular expression (outlines-core writes one for a JSON schema), then a
deterministic automaton over the tokenizer's tokens (outlines-core's `Index`), kept as a dense table:
`next_state[s, t]` is the state after token t in state s, -1 where t is not allowed. The decode loop
carries each row's state: it masks the logits to the tokens the state allows and moves along the table
after the draw, on the device, so a constrained row never waits for the host and a free row (state 0 of a
batch's table allows every token and stays put) sees its logits unchanged. The end-of-sequence ids are
allowed exactly in final states: a row ends with "stop" when its output is complete, or at max_new_tokens
("length"). A final state is reached only after whole characters (the automaton reads bytes), so no
row ends inside a UTF-8 character.

Why outlines-core: it hands over the whole token-level automaton, which is what can live on the device;
llguidance and xgrammar compute each step's mask on the host (fast, but a host round trip a token). The
price: regular languages only. A context-free grammar becomes one with its recursion unrolled to a fixed
depth (`cfg.py`: every output is in the grammar's language, nesting deeper is not generated), as outlines-core
unrolls recursive schemas. It ignores integer bounds; `_with_integer_ranges` writes them. Its automata are not
minimal: the worker merges equivalent states (the tests' arithmetic grammar: 9,848 states -> 9).
Compiling runs in a worker process with a time limit: a regular expression whose automaton explodes
costs a 400, not the server.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import pickle
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from jaxgen.inference.errors import SamplingError, shown

MAX_TEXT = 100_000  # characters of a schema, a regular expression or all choices together
MAX_CHOICES = 1024
MAX_TABLE_BYTES = 2**28  # one automaton's dense table (S x V int32)
COMPILE_TIMEOUT_S = 10.0  # one worker builds one automaton at a time: a hostile one holds the others this long
RECURSION_DEPTH = 2  # how deep recursive schemas ($ref to themselves) are unrolled
FIELD = "structured"

# JSON-schema keywords outlines-core turns into the regular expression, and those that only annotate
SUPPORTED = {
    "type", "properties", "required", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "additionalProperties", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
}  # fmt: skip
_SCHEMA_VALUED = {"items", "additionalProperties"}  # keywords whose value is a schema
_SCHEMA_MAPS = {"properties", "$defs", "definitions"}  # name -> schema
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCALARS = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
# OpenAI's response_format {"type": "json_object"}: any object whose values are scalars, or arrays and objects of
# scalars. outlines-core's own free-form object nests three levels deep: 1623 states, 7 s to compile; this: 399, 0.2 s
JSON_OBJECT = {
    "type": "object",
    "additionalProperties": {"anyOf": [*_SCALARS, {"type": "array", "items": {"anyOf": _SCALARS}},
                                       {"type": "object", "additionalProperties": {"anyOf": _SCALARS}}]},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a constrained row may write: exactly one of `json` (a JSON schema, kept as JSON text), `regex`
    (the whole output matches it), `choice` (the output is one of the strings) or `grammar` (a Lark or GBNF
    context-free grammar, its recursion unrolled `cfg.DEPTH` levels: see cfg.py)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingError(f"{FIELD} takes exactly one of json, regex, choice, grammar; got {given or 'none'}",
                                FIELD)  # fmt: skip
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict | bool):  # a schema given as an object: kept as canonical text
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        kind = given[0]
        value = getattr(self, kind)
        if kind == "choice":
            ok = isinstance(value, tuple) and 0 < len(value) <= MAX_CHOICES
            if not (ok and all(isinstance(c, str) and c for c in value)):
                allowed = f"1 to {MAX_CHOICES} non-empty strings"
                raise SamplingError(f"{FIELD}.choice={shown(value)} is not allowed: {allowed}", FIELD)
            size = sum(len(c) for c in value)
        else:
            if not isinstance(value, str):
                raise SamplingError(f"{FIELD}.{kind}={shown(value)} is not allowed: a string", FIELD)
            size = len(value)
        if size > MAX_TEXT:
            raise SamplingError(f"{FIELD}.{kind} has {size} characters; at most {MAX_TEXT}", FIELD)

    @classmethod
    def from_dict(cls, data) -> Structured:
        """From JSON: {"json": schema (object or text)}, {"json_object": true}, {"regex": ...}, {"choice": [...]},
        {"grammar": ...} (vLLM's `structured_outputs` shape)."""
        if isinstance(data, Structured):
            return data
        if not isinstance(data, dict):
            raise SamplingError(f'{FIELD}={shown(data)} is not allowed: an object such as {{"json": schema}}', FIELD)
        data = dict(data)
        if data.pop("json_object", False):
            data.setdefault("json", JSON_OBJECT)
        unknown = sorted(set(data) - {"json", "regex", "choice", "grammar"})
        if unknown:
            raise SamplingError(f"unknown {FIELD} field {unknown[0]!r}; allowed: json, json_object, regex, choice, "
                                "grammar", FIELD)  # fmt: skip
        if isinstance(data.get("json"), str):
            data["json"] = _parse_schema(data["json"])
        return cls(**data)

    def source(self) -> tuple[str, str]:
        """What the compile worker gets: ("grammar", the grammar's text) or ("regex", `pattern()`)."""
        return ("grammar", self.grammar) if self.grammar is not None else ("regex", self.pattern())

    def pattern(self) -> str:
        """The regular expression of the whole output (a grammar's: its recursion unrolled, `cfg.py`)."""
        if self.grammar is not None:
            from jaxgen.inference import cfg

            try:
                return cfg.grammar_regex(self.grammar)
            except cfg.GrammarError as e:
                raise SamplingError(f"{FIELD}.grammar: {e}", FIELD) from None
        if self.regex is not None:
            _check_regex(self.regex)
            return self.regex
        if self.choice is not None:
            return "|".join(f"({re.escape(c)})" for c in self.choice)
        return schema_regex(json.loads(self.json))


def _parse_schema(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SamplingError(f"{FIELD}.json is not JSON: {e}", FIELD) from None


def _check_regex(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise SamplingError(f"{FIELD}.regex {shown(pattern)} does not compile: {e}", FIELD) from None


def schema_regex(schema) -> str:
    """The regular expression of the JSON texts that satisfy `schema` (outlines-core's, with integer bounds
    written in). SamplingError naming an unsupported keyword, or what outlines-core said."""
    from outlines_core.json_schema import build_regex_from_schema

    if not isinstance(schema, dict | bool):
        raise SamplingError(f"{FIELD}.json={shown(schema)} is not allowed: a JSON schema (an object)", FIELD)
    ranges: dict[str, str] = {}
    schema = _with_integer_ranges(schema, ranges, "#")
    try:
        pattern = build_regex_from_schema(json.dumps(schema), max_recursion_depth=RECURSION_DEPTH)
    except Exception as e:  # outlines-core raises its own error types for schemas it cannot express
        raise SamplingError(f"{FIELD}.json: the schema cannot be compiled: {e}", FIELD) from None
    for placeholder, rx in ranges.items():
        pattern = pattern.replace(f'"{placeholder}"', f"({rx})")
    return pattern


def _with_integer_ranges(node, ranges: dict, path: str):
    """A copy of schema `node` with every bounded integer replaced by a placeholder constant (filled in with
    its range's regular expression after outlines-core); SamplingError for a keyword it cannot honour."""
    if not isinstance(node, dict):
        return node
    for key in node:
        if key not in SUPPORTED:
            raise SamplingError(f"{FIELD}.json: the keyword {key!r} at {path} is not supported; supported: "
                                f"{', '.join(sorted(SUPPORTED))}", FIELD)  # fmt: skip
    bounds = {k: node[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node}
    if bounds:
        if node.get("type") != "integer":
            raise SamplingError(f"{FIELD}.json: bounds ({', '.join(bounds)}) at {path} are supported on integers "
                                f"only, not on type {node.get('type')!r}", FIELD)  # fmt: skip
        placeholder = f"JAXGENRANGE{len(ranges)}X"
        ranges[placeholder] = integer_regex(*_integer_bounds(bounds, path))
        return {"const": placeholder}
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_VALUED and isinstance(value, dict):
            value = _with_integer_ranges(value, ranges, f"{path}/{key}")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {k: _with_integer_ranges(v, ranges, f"{path}/{key}/{k}") for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_with_integer_ranges(v, ranges, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        out[key] = value
    return out


def _integer_bounds(bounds: dict, path: str) -> tuple[int | None, int | None]:
    lo = hi = None
    for key, value in bounds.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
            raise SamplingError(f"{FIELD}.json: {key}={shown(value)} at {path} is not allowed: a number", FIELD)
    if "minimum" in bounds:
        lo = int(np.ceil(bounds["minimum"]))
    if "exclusiveMinimum" in bounds:
        lo = max(lo if lo is not None else -(2**63), int(np.floor(bounds["exclusiveMinimum"])) + 1)
    if "maximum" in bounds:
        hi = int(np.floor(bounds["maximum"]))
    if "exclusiveMaximum" in bounds:
        hi = min(hi if hi is not None else 2**63, int(np.ceil(bounds["exclusiveMaximum"])) - 1)
    if lo is not None and hi is not None and lo > hi:
        raise SamplingError(f"{FIELD}.json: no integer lies in the bounds at {path} ({bounds})", FIELD)
    return lo, hi


def integer_regex(lo: int | None, hi: int | None) -> str:
    """A regular expression of the integers in [lo, hi] as JSON writes them (None: unbounded)."""
    parts = []
    if lo is None or lo < 0:  # the negatives, as "-" and their absolute values
        top = None if lo is None else -lo
        bottom = 1 if hi is None or hi >= 0 else -hi
        parts.append(f"-({_natural_regex(bottom, top)})")
    if hi is None or hi >= 0:
        start = 0 if lo is None or lo <= 0 else lo
        if start == 0:
            parts.append("0")
            start = 1
        if hi is None or hi >= start:
            parts.append(_natural_regex(start, hi))
    return "|".join(f"({p})" for p in parts)


def _natural_regex(lo: int, hi: int | None) -> str:
    """The integers in [lo, hi], lo >= 1, without leading zeros (hi None: unbounded)."""
    parts = []
    top_len = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top_len + 1):
        a, b = max(lo, 10 ** (n - 1)), (10**n - 1 if hi is None else min(hi, 10**n - 1))
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{top_len},}}")
    return "|".join(f"({p})" for p in parts)


def _same_length(lo: str, hi: str) -> str:
    """The numbers from `lo` to `hi`, written with the same number of digits."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    rest = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + f"({_same_length(lo[1:], hi[1:])})"
    parts = [lo[0] + f"({_same_length(lo[1:], '9' * rest)})"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{rest}}}")
    parts.append(hi[0] + f"({_same_length('0' * rest, hi[1:])})")
    return "|".join(f"({p})" for p in parts)


# --- the automaton ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Automaton:
    """A constraint's token automaton: `next_state` (S, V) int32, -1 where a token is not allowed; state 0
    is the start. End-of-sequence ids are allowed (and stay put) in final states only."""

    next_state: np.ndarray

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    def walk(self, tokens, state: int = 0) -> int:
        """The state after `tokens` from `state` (-1 once a token was not allowed)."""
        for t in tokens:
            if state < 0:
                break
            state = int(self.next_state[state, t])
        return state

    def allowed(self, state: int) -> np.ndarray:
        return np.flatnonzero(self.next_state[state] >= 0)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The bytes of each token id (None for special tokens, which no constraint allows), the end-of-sequence
    ids and the model's vocabulary size (the table's width; it may exceed the tokenizer's)."""

    tokens: tuple[bytes | None, ...]
    eos_ids: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, tokenizer, model_vocab: int) -> Vocabulary:
        return cls(token_bytes(tokenizer), tuple(tokenizer.eos_ids), model_vocab)


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


def token_bytes(tokenizer) -> tuple[bytes | None, ...]:
    """What each token id writes, as bytes: byte-level BPE (GPT-2's character map), byte fallback (<0xNN>)
    and SentencePiece's "▁" for a space; None for special (added) tokens."""
    from jaxgen.tokenizer import _bytes_to_unicode

    tok = tokenizer.tok
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in repr(tok.decoder)
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        piece = tok.id_to_token(i)
        if piece is None or i in special:
            out.append(None)
        elif byte_level and all(c in to_byte for c in piece):
            out.append(bytes(to_byte[c] for c in piece))
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return tuple(out)


def _table(states: int, src, tok, dst, finals, vocab: Vocabulary) -> np.ndarray:
    """The dense table (states, V) int32 of an automaton's edges; end-of-sequence ids stay put in final states."""
    if states * vocab.size * 4 > MAX_TABLE_BYTES:
        raise SamplingError(f"{FIELD}: the constraint's automaton has {states} states; its table would take "
                            f"{states * vocab.size * 4 / 2**20:.0f} MB, at most {MAX_TABLE_BYTES // 2**20} MB",
                            FIELD)  # fmt: skip
    table = np.full((states, vocab.size), -1, np.int32)
    table[src, tok] = dst
    eos = np.asarray(vocab.eos_ids)
    table[finals[:, None], eos[None]] = finals[:, None]
    return table


class _Compiler:
    """One worker process (`automaton_worker.py`) that builds automata, restarted when a build runs past its
    time limit or dies."""

    def __init__(self):
        self._proc = None
        self._lock = threading.Lock()

    def build(self, source: tuple[str, str], vocab: Vocabulary, timeout: float) -> tuple:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                worker = Path(__file__).with_name("automaton_worker.py")
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
    table = _table(*_COMPILER.build(structured.source(), vocab, seconds), vocab)
    automaton = Automaton(table)
    if not (table[0] >= 0).any():
        raise SamplingError(f"{FIELD}: no output satisfies the constraint with this tokenizer", FIELD)
    return automaton


# --- a batch's table ----------------------------------------------------------------------------------


def layout(automata: list[Automaton | None]) -> tuple[tuple[Automaton, ...], np.ndarray]:
    """Where a batch's automata go in its table: the distinct ones in order of first use, and each row's
    start state (B,) int32 (0 for a free row; state 0 is the free row's, then each automaton's states
    follow those before it)."""
    distinct, offsets, starts, size = [], {}, [], 1
    for a in automata:
        if a is not None and id(a) not in offsets:
            offsets[id(a)] = size
            distinct.append(a)
            size += a.num_states
        starts.append(0 if a is None else offsets[id(a)])
    return tuple(distinct), np.asarray(starts, np.int32)


def stack(distinct: tuple[Automaton, ...], vocab_size: int) -> np.ndarray:
    """The table (S, V) int32 of `layout`'s distinct automata, rows padded to a power of two (a handful of
    shapes): row 0 allows every token and stays at 0, each automaton's states shifted past those before."""
    size = 1 + sum(a.num_states for a in distinct)
    table = np.full((1 << (size - 1).bit_length(), vocab_size), -1, np.int32)
    table[0] = 0
    offset = 1
    for a in distinct:
        block = table[offset : offset + a.num_states]
        np.add(a.next_state, offset, out=block, where=a.next_state >= 0)
        offset += a.num_states
    return table


class GrammarPool:
    """The engine's table: the automata of the requests in its slots, each at its own range of states (state 0
    free). A range is shared by the slots that use the same constraint and reused once none does; the table
    grows to the next power of two when full (a new shape: the engine's steps compile once more), or at once
    to a size given to `reserve`."""

    def __init__(self, vocab_size: int):
        self.table = np.zeros((1, vocab_size), np.int32)
        self.changed = False  # the table differs from the device's copy
        self._slots: dict[int, Automaton] = {}
        self._ranges: dict[int, list] = {}  # id(automaton) -> [offset, size, slots using it]

    def reserve(self, rows: int) -> None:
        """Grows the table to at least `rows` states now (a power of two): a server that knows its constraints'
        sizes compiles its steps for that table once, not once per growth."""
        if rows > self.table.shape[0]:
            self._grow(rows)

    def assign(self, slot: int, automaton: Automaton | None) -> int:
        """Slot `slot` now runs `automaton` (None: free); returns the offset of its states (0 when free)."""
        old = self._slots.pop(slot, None)
        if old is not None:
            entry = self._ranges[id(old)]
            entry[2] -= 1
            if entry[2] == 0:
                del self._ranges[id(old)]
        if automaton is None:
            return 0
        self._slots[slot] = automaton
        entry = self._ranges.get(id(automaton))
        if entry is None:
            offset = self._place(automaton.num_states)
            self.table[offset : offset + automaton.num_states] = np.where(
                automaton.next_state >= 0, automaton.next_state + offset, -1
            )
            entry = self._ranges[id(automaton)] = [offset, automaton.num_states, 0]
            self.changed = True
        entry[2] += 1
        return entry[0]

    def _place(self, n: int) -> int:
        """The first free range of `n` states, growing the table when there is none."""
        start = 1
        for offset, size, _ in sorted(self._ranges.values()):
            if offset - start >= n:
                return start
            start = max(start, offset + size)
        if start + n > self.table.shape[0]:
            self._grow(start + n)
        return start

    def _grow(self, rows: int) -> None:
        grown = np.full((1 << (rows - 1).bit_length(), self.table.shape[1]), -1, np.int32)
        grown[: self.table.shape[0]] = self.table
        self.table = grown
        self.changed = True
