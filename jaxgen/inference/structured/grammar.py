"""Context-free grammars as regular expressions, so that they run as token automata on the device (the
front end of the `grammar` kind: `Structured(grammar=...)`).

    grammar_regex(text) -> str       a Lark grammar (`start: ...`) or GBNF/EBNF (`root ::= ...`)

A grammar is read into rules (`Rules`: name -> node; a node is ("t", regex) a terminal, ("r", name) a rule,
("seq", nodes), ("alt", nodes) or ("rep", node, min, max)), then written as one regular expression:
- a rule's direct left and right recursion becomes repetition, unbounded: `expr: expr "+" term | term` is
  `term ("+" term)*`, and `a: "x" a | "y"` is `"x"* "y"`; `e: e "+" e | t` (both sides) is `t ("+" t)*`.
  Lark writes `x*` and `x+` as left-recursive rules, which come back as repetition this way;
- any other recursion (nesting: `factor: "(" expr ")"`) is unrolled DEPTH levels deep: at the last level a
  recursive alternative is dropped. Every output is then a sentence of the grammar (a sound
  under-approximation): nesting deeper than DEPTH is never generated.
Terminals stand for the strings their pattern matches whole; lazy quantifiers are greedy here (the same
language); lookarounds, backreferences, anchors and possessive repeats are refused (no finite automaton
honours them), except in Lark's common ESCAPED_STRING, written without its lookbehind. `%ignore` is dropped:
the output holds no ignored text between tokens, and a grammar that ignores whitespace reads it all the same.
Adjacent terminals are not separated: a greedy lexer may split `NAME NAME` ("ab" "cd" written "abcd")
differently, which Lark's Earley parser with `lexer="dynamic_complete"` reads as the grammar means.

This module imports neither jaxgen nor JAX: the compile worker (worker.py) runs it, under its time
and memory limits. Errors are `GrammarError`, one line saying what was wrong.
"""

from __future__ import annotations

import re
import re._constants as C  # Python's own reader of its regex syntax (Lark's terminals are Python patterns): the
import re._parser as sre  # one complete parser of it; its tree is written back in the syntax outlines-core reads

DEPTH = 3  # how deep non-tail recursion (nesting) is unrolled
MAX_PATTERN = 1_000_000  # characters of the regular expression a grammar unrolls to
LARK_IMPORTS = ("common", "unicode")  # lark's bundled grammars; no file of this machine is read
# lark's common.ESCAPED_STRING: a lexer's lazy match with a lookbehind, as the language it lexes
KNOWN = {r'".*?(?<!\\)(\\\\)*?"': r'"([^"\\\n]|\\.)*"'}


class GrammarError(ValueError):
    """A grammar that cannot be used; the message says what was wrong."""


Rules = dict  # name -> node


def grammar_regex(text: str, depth: int = DEPTH) -> str:
    """The regular expression of `text`'s language, recursion unrolled `depth` levels. GrammarError when the
    grammar does not read, names an undefined rule, derives nothing within the depth, or unrolls too big."""
    rules, start = read_gbnf(text) if is_gbnf(text) else read_lark(text)
    pattern = _Unroller(rules, depth).rule(start, depth, frozenset())
    if pattern is None:
        raise GrammarError(f"the rule {start!r} derives no finite text with recursion unrolled {depth} levels deep")
    return pattern


def is_gbnf(text: str) -> bool:
    return re.search(r"^\s*[A-Za-z_][\w-]*\s*::=", text, re.MULTILINE) is not None


# --- unrolling ------------------------------------------------------------------------------------------


class _Unroller:
    """Rules to one regular expression. `rule(name, k, stack)`: k levels of nesting left; `stack` the rules
    being expanded at this level (a reference back to one of them is nesting: the next level down)."""

    def __init__(self, rules: Rules, depth: int):
        self.rules, self.depth, self.memo = rules, depth, {}

    def rule(self, name: str, k: int, stack: frozenset) -> str | None:
        if (name, k) in self.memo:
            return self.memo[name, k]
        stack = stack | {name}
        left, right, infix, base = [], [], [], []
        for alt in _alternatives(self.rules[name]):
            if alt == (("r", name),):
                continue  # r: r, which adds nothing
            first, last = bool(alt) and alt[0] == ("r", name), bool(alt) and alt[-1] == ("r", name)
            if first and last and len(alt) >= 2:
                infix.append(alt[1:-1])
            elif first:
                left.append(alt[1:])
            elif last:
                right.append(alt[:-1])
            else:
                base.append(alt)
        seqs = [[self.node(("seq", tuple(a)), k, stack) for a in group] for group in (left, right, infix, base)]
        body = _alt(seqs[3])
        if body is not None:
            if (r := _alt(seqs[1])) is not None:
                body = f"{_atom(r)}*{body}"
            if (lt := _alt(seqs[0])) is not None:
                body = f"{body}{_atom(lt)}*"
            if (i := _alt(seqs[2])) is not None:
                body = f"{body}({i}{body})*"
            self.check(body, name)
        self.memo[name, k] = body
        return body

    def check(self, pattern: str, rule: str | None = None) -> str:
        """`pattern`, or GrammarError when it is too long (checked as it grows: before it takes the memory)."""
        if len(pattern) > MAX_PATTERN:
            where = f" (rule {rule!r})" if rule else ""
            raise GrammarError(f"the grammar unrolled {self.depth} levels deep is a regular expression of more "
                               f"than {MAX_PATTERN} characters{where}: nest less")  # fmt: skip
        return pattern

    def node(self, node, k: int, stack: frozenset) -> str | None:
        kind = node[0]
        if kind == "t":
            return node[1]
        if kind == "r":
            if node[1] not in stack:
                return self.rule(node[1], k, stack)
            return self.rule(node[1], k - 1, frozenset()) if k > 0 else None
        if kind == "seq":
            parts = [self.node(n, k, stack) for n in node[1]]
            if None in parts:
                return None
            return self.check("".join(parts) if sum(map(len, parts)) <= MAX_PATTERN else "x" * (MAX_PATTERN + 1))
        if kind == "alt":
            return _alt([self.node(n, k, stack) for n in node[1]])
        _, inner, lo, hi = node
        inner = self.node(inner, k, stack)
        if inner is None:
            return "" if lo == 0 else None
        return _atom(inner) + _quantifier(lo, hi)


def _alternatives(node) -> list[tuple]:
    """A rule's top-level alternatives, each a tuple of nodes."""
    alts = node[1] if node[0] == "alt" else (node,)
    return [a[1] if a[0] == "seq" else (a,) for a in alts]


def _alt(parts: list) -> str | None:
    parts = list(dict.fromkeys(p for p in parts if p is not None))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def _atom(text: str) -> str:
    """`text` as one unit a quantifier can follow (grouped unless it is one already)."""
    if len(text) == 1 or (len(text) == 2 and text[0] == "\\") or _one_group(text, "[", "]") or _one_group(text):
        return text
    return f"({text})"


def _one_group(text: str, open_: str = "(", close: str = ")") -> bool:
    """Whether `text` is one bracketed group, from its first character to its last."""
    if not (text.startswith(open_) and text.endswith(close)):
        return False
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if open_ == "[" and c == "[" and i > 0:
            pass  # a "[" inside a class is a character
        elif c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0 and i < len(text) - 1:
                return False
        i += 1
    return True


def _quantifier(lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    if hi is None:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


# --- Lark -----------------------------------------------------------------------------------------------


def read_lark(text: str, start: str = "start") -> tuple[Rules, str]:
    """A Lark grammar's rules (its own loader: templates, `?`, `[]`, `~` ranges expanded) and start rule."""
    from lark.exceptions import LarkError
    from lark.load_grammar import load_grammar

    for m in re.finditer(r"^\s*%import\s+([\w.]*)", text, re.MULTILINE):
        if m.group(1).split(".")[0] not in LARK_IMPORTS:
            raise GrammarError(f"%import {m.group(1)}: only lark's own {' and '.join(LARK_IMPORTS)} can be imported")
    try:
        loaded, _ = load_grammar(text, "<grammar>", [], False)
        terminals, rules, _ignored = loaded.compile([start], set())  # %ignore dropped: see the module docstring
    except (LarkError, KeyError, ValueError, RecursionError) as e:
        raise GrammarError(f"not a Lark grammar: {_one_line(e)}") from None
    patterns = {t.name: _terminal(t.name, t.pattern.to_regexp()) for t in terminals}
    out: dict[str, list] = {}
    for r in rules:
        seq = []
        for s in r.expansion:
            if s.is_term and s.name not in patterns:
                raise GrammarError(f"the terminal {s.name} has no pattern (%declare): nothing can write it")
            seq.append(("t", patterns[s.name]) if s.is_term else ("r", s.name))
        out.setdefault(r.origin.name, []).append(("seq", tuple(seq)))
    if start not in out:
        raise GrammarError(f"a Lark grammar needs a rule named {start!r}")
    return {name: ("alt", tuple(alts)) for name, alts in out.items()}, start


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def _terminal(name: str, pattern: str) -> str:
    """A terminal's Python regular expression in the syntax outlines-core reads (greedy, no lookarounds)."""
    pattern = KNOWN.get(pattern, pattern)
    try:
        parsed = sre.parse(pattern)
    except re.error as e:
        raise GrammarError(f"the terminal {name}'s pattern {pattern!r} does not compile: {e}") from None
    try:
        return _Emit().seq(parsed, ignorecase=False)
    except GrammarError as e:
        raise GrammarError(f"the terminal {name}'s pattern {pattern!r} {e}") from None


META = set("\\.+*?()|[]{}^$#&-~")  # the characters outlines-core's regex syntax (Rust's) gives a meaning


def _char(c: int) -> str:
    """One character as a regular expression matches it literally (`\\<` would be a word boundary: only the
    meta characters are escaped)."""
    ch = chr(c)
    if ch in META:
        return "\\" + ch
    if (32 <= c < 127) or (c > 127 and ch.isprintable()):
        return ch
    return f"\\x{{{c:X}}}"


ASCII = {C.CATEGORY_DIGIT: "0-9", C.CATEGORY_WORD: "0-9A-Za-z_", C.CATEGORY_SPACE: " \\t\\n\\r\\x{C}\\x{B}"}
UNICODE = {C.CATEGORY_NOT_DIGIT: "\\D", C.CATEGORY_NOT_WORD: "\\W", C.CATEGORY_NOT_SPACE: "\\S"}
NEGATED_IN_CLASS = {C.CATEGORY_DIGIT: "\\d", C.CATEGORY_WORD: "\\w", C.CATEGORY_SPACE: "\\s"}


class _Emit:
    """Python's parsed regular expression (re._parser) written back. A positive \\d, \\w, \\s is its ASCII
    class (what a Python lexer also matches: sound); a negated one keeps Unicode's meaning, as Python's."""

    def seq(self, items, ignorecase: bool) -> str:
        return "".join(self.item(op, av, ignorecase) for op, av in items)

    def item(self, op, av, ic: bool) -> str:
        if op is C.LITERAL:
            ch = chr(av)
            if ic and ch.lower() != ch.upper():
                return f"[{_char(ord(ch.lower()))}{_char(ord(ch.upper()))}]"
            return _char(av)
        if op is C.NOT_LITERAL:
            return f"[^{_char(av)}]"
        if op is C.ANY:
            return "."
        if op is C.IN:
            return self.cls(av, ic)
        if op is C.CATEGORY:
            return f"[{ASCII[av]}]" if av in ASCII else UNICODE[av]
        if op is C.BRANCH:
            return "(" + "|".join(self.seq(b, ic) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            _, add, remove, p = av
            ic = (ic or bool(add & re.IGNORECASE)) and not remove & re.IGNORECASE
            dotall = "(?s:" if add & re.DOTALL else "("
            return f"{dotall}{self.seq(p, ic)})"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, p = av
            return _atom(self.seq(p, ic)) + _quantifier(lo, None if hi is C.MAXREPEAT else hi)
        what = {C.ASSERT: "a lookaround", C.ASSERT_NOT: "a lookaround", C.AT: "an anchor",
                C.GROUPREF: "a backreference", C.GROUPREF_EXISTS: "a conditional"}.get(op, str(op).lower())  # fmt: skip
        raise GrammarError(f"uses {what}, which no finite automaton honours")

    def cls(self, items, ic: bool) -> str:
        negate = items and items[0][0] is C.NEGATE
        parts = []
        for op, av in items[1:] if negate else items:
            if op is C.LITERAL:
                chars = {chr(av).lower(), chr(av).upper()} if ic else {chr(av)}
                parts += [_char(ord(c)) for c in sorted(chars)]
            elif op is C.RANGE:
                parts.append(f"{_char(av[0])}-{_char(av[1])}")
                if ic:
                    lo, hi = chr(av[0]), chr(av[1])
                    for a, b in ((lo.lower(), hi.lower()), (lo.upper(), hi.upper())):
                        if a.isalpha() and b.isalpha() and a <= b:
                            parts.append(f"{_char(ord(a))}-{_char(ord(b))}")
            elif op is C.CATEGORY:
                parts.append(NEGATED_IN_CLASS.get(av) if negate else ASCII.get(av, UNICODE.get(av)))
            else:
                raise GrammarError(f"uses {str(op).lower()} in a character class, which is not supported")
        return ("[^" if negate else "[") + "".join(parts) + "]"


# --- GBNF / EBNF ----------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<space>\s+|\#[^\n]*)|(?P<define>::=)|(?P<name>[A-Za-z_][\w-]*)|(?P<string>"(?:[^"\\]|\\.)*")
    |(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<rep>\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<op>[()|*+?.])""",
    re.VERBOSE | re.DOTALL,
)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}


def read_gbnf(text: str, start: str = "root") -> tuple[Rules, str]:
    """GBNF (llama.cpp) and the EBNF xgrammar reads: `name ::= ...`, "literals", [classes], (groups), |, *,
    +, ?, {m,n} and `.`; `#` comments. Rules split where a `name ::=` begins."""
    tokens, at = [], 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise GrammarError(f"not a GBNF grammar: unexpected {text[at : at + 20]!r} at character {at}")
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
        at = m.end()
    rules, heads = {}, [i for i in range(len(tokens) - 1) if tokens[i][0] == "name" and tokens[i + 1][0] == "define"]
    if not heads or heads[0] != 0:
        raise GrammarError("not a GBNF grammar: it must begin with `name ::= ...`")
    for h, end in zip(heads, [*heads[1:], len(tokens)], strict=True):
        name = tokens[h][1]
        if name in rules:
            raise GrammarError(f"the rule {name!r} is defined twice")
        parser = _GbnfRule(tokens[h + 2 : end], name)
        rules[name] = parser.alternatives()
        if parser.at < len(parser.tokens):
            raise GrammarError(f"rule {name!r}: unexpected {parser.tokens[parser.at][1]!r}")
    for name, node in rules.items():
        for ref in _references(node):
            if ref not in rules:
                raise GrammarError(f"the rule {ref!r} is used (in {name!r}) but not defined")
    if start not in rules:
        raise GrammarError(f"a GBNF grammar needs a rule named {start!r}")
    return rules, start


def _references(node):
    if node[0] == "r":
        yield node[1]
    elif node[0] in ("seq", "alt"):
        for n in node[1]:
            yield from _references(n)
    elif node[0] == "rep":
        yield from _references(node[1])


class _GbnfRule:
    def __init__(self, tokens, name):
        self.tokens, self.name, self.at = tokens, name, 0

    def peek(self):
        return self.tokens[self.at] if self.at < len(self.tokens) else (None, None)

    def alternatives(self):
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.at += 1
            alts.append(self.sequence())
        return ("alt", tuple(alts))

    def sequence(self):
        items = []
        while True:
            kind, value = self.peek()
            if kind is None or (kind == "op" and value in "|)"):
                return ("seq", tuple(items))
            if kind == "rep" or (kind == "op" and value in "*+?"):
                if not items:
                    raise GrammarError(f"rule {self.name!r}: {value!r} repeats nothing")
                items[-1] = ("rep", items[-1], *_repeat(value))
                self.at += 1
                continue
            items.append(self.atom(kind, value))

    def atom(self, kind, value):
        self.at += 1
        if kind == "name":
            return ("r", value)
        if kind == "string":
            return ("t", "".join(_char(ord(c)) for c in _unescape(value[1:-1], self.name)))
        if kind == "cls":
            return ("t", _gbnf_class(value, self.name))
        if value == ".":
            return ("t", "[^\\n]")
        if value == "(":
            inner = self.alternatives()
            if self.peek() != ("op", ")"):
                raise GrammarError(f"rule {self.name!r}: a '(' is not closed")
            self.at += 1
            return inner
        raise GrammarError(f"rule {self.name!r}: unexpected {value!r}")


def _repeat(value: str) -> tuple[int, int | None]:
    if value in "*+?":
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[value]
    lo, _, hi = value.strip("{} ").partition(",")
    lo = int(lo)
    hi = lo if "," not in value else (int(hi) if hi.strip() else None)
    if hi is not None and hi < lo:
        raise GrammarError(f"the repetition {value} has its maximum below its minimum")
    return lo, hi


def _unescape(body: str, rule: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            digits = body[i + 2 : i + 2 + width]
            if not re.fullmatch(r"[0-9A-Fa-f]+", digits) or len(digits) != width or int(digits, 16) > 0x10FFFF:
                raise GrammarError(f"rule {rule!r}: a bad escape \\{e}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:
            raise GrammarError(f"rule {rule!r}: an unknown escape \\{e}")
    return "".join(out)


def _gbnf_class(value: str, rule: str) -> str:
    """A GBNF class `[...]` (`^` negates; `a-z` ranges; escapes as in literals, `\\-` and `\\]` literal)."""
    body = value[1:-1]
    negate = body.startswith("^")
    chars, i = [], 1 if negate else 0  # (character, escaped)
    while i < len(body):
        if body[i] == "\\":
            width = {"x": 2, "u": 4, "U": 8}.get(body[i + 1 : i + 2], 0)
            chars.append((_unescape(body[i : i + 2 + width], rule), True))
            i += 2 + width
        else:
            chars.append((body[i], False))
            i += 1
    if not chars:
        raise GrammarError(f"rule {rule!r}: the class {value} is empty")
    parts, i = [], 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == ("-", False):
            lo, hi = chars[i][0], chars[i + 2][0]
            if lo > hi:
                raise GrammarError(f"rule {rule!r}: the range {lo}-{hi} in {value} is reversed")
            parts.append(f"{_char(ord(lo))}-{_char(ord(hi))}")
            i += 3
        else:
            parts.append(_char(ord(chars[i][0])))
            i += 1
    return ("[^" if negate else "[") + "".join(parts) + "]"
