"""Regular expressions with ECMA-262's character classes (JavaScript's, what a JSON schema's `pattern` means),
written out for the automaton's regex engine (outlines-core: Rust's `regex`, where they are Unicode classes).

    ecma_regex(r"\\d{2}\\w")               -> "[0-9]{2}[0-9A-Za-z_]"
    ecma_regex(p, json_string=True)      the same, for text inside a JSON string: never a character that
                                         JSON must escape

What is rewritten, outside and inside character classes: `\\d` [0-9], `\\w` [0-9A-Za-z_], `\\s` ECMA's
whitespace (SPACE: Unicode's White_Space less U+0085, plus U+FEFF), their negations `\\D` `\\W` `\\S`, and `.`
(any character but the line terminators \\n \\r U+2028 U+2029). A class's `[`, `&` and `~` are characters in
ECMA but set operators in Rust: escaped. All other syntax is passed on as written.

Inside a JSON string (a schema's `pattern` and `format`, `json_string=True`) the pattern is matched against the
string's JSON text, so a negated class or `.` never writes `"`, `\\` or a control character (the output stays
JSON), and `\\s` writes no control whitespace (tab, newline: JSON escapes them): outputs are a subset of the
pattern's language, each valid JSON.
"""

from __future__ import annotations

from jaxgen.inference.errors import SamplingError

DIGIT, WORD = "0-9", "0-9A-Za-z_"
SPACE = r"\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
JSON_SPACE = SPACE.split("\\r", 1)[1]  # without the control characters: " " and the Unicode spaces
LINE_ENDS = r"\n\r\u2028\u2029"
JSON_UNSAFE = r'"\\\x00-\x1f'  # what a JSON string cannot hold as itself
_CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}


def ecma_regex(pattern: str, json_string: bool = False) -> str:
    """`pattern` with ECMA-262's classes written out (see the module docstring). Idempotent."""
    unsafe = JSON_UNSAFE if json_string else ""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(_escape(pattern[i + 1], json_string))
            i += 2
        elif c == "[":
            text, i = _char_class(pattern, i, json_string)
            out.append(text)
        else:
            out.append(f"[^{LINE_ENDS}{unsafe}]" if c == "." else c)
            i += 1
    return "".join(out)


def _escape(c: str, json_string: bool) -> str:
    """An escape outside a class: a class of its own for \\d \\w \\s and their negations, else as written."""
    if c in _CLASSES:
        return f"[{JSON_SPACE if json_string else SPACE}]" if c == "s" else f"[{_CLASSES[c]}]"
    if c.lower() in _CLASSES and c.isupper():
        return f"[^{_CLASSES[c.lower()]}{JSON_UNSAFE if json_string else ''}]"
    return "\\" + c


def _char_class(pattern: str, start: int, json_string: bool) -> tuple[str, int]:
    """The class that starts at `pattern[start]` ("["), rewritten, and where it ends. A negated escape (\\D) in
    a class becomes an alternative beside it: `[a\\D]` -> `(?:[a]|[^0-9])`."""
    i = start + 1
    negated = pattern.startswith("^", i)
    i += negated
    items, negations, expanded = [], [], False  # expanded: the last item was a class written out (\d)
    if pattern.startswith("]", i):  # a "]" first is a character (as Python and Rust read it)
        items.append("\\]")
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e.lower() in _CLASSES and e.isupper():
                negations.append(_CLASSES[e.lower()])
            elif e == "s":
                items.append(JSON_SPACE if json_string and not negated else SPACE)
            else:
                items.append(_CLASSES.get(e, "\\" + e))
            expanded = e.lower() in _CLASSES
            i += 2
        else:  # a "-" after a class is a character in ECMA ([\d-x]), a range's dash after "0-9"
            items.append("\\" + c if c in "[&~" or (c == "-" and expanded) else c)
            expanded = False
            i += 1
    if i >= len(pattern):
        return pattern[start:], len(pattern)  # unterminated: the compiler says so
    unsafe = JSON_UNSAFE if json_string else ""
    body = "".join(items)
    body += unsafe if negated and not body.endswith(unsafe) else ""  # (not twice: idempotent)
    if not negations:
        return f"[{'^' if negated else ''}{body}]", i + 1
    if negated:
        raise SamplingError(f"the pattern {pattern!r} has \\D, \\W or \\S in a negated class, which is not "
                            "supported: write the class out", "structured")  # fmt: skip
    parts = ([f"[{body}]"] if body else []) + [f"[^{n}{unsafe}]" for n in negations]
    return f"(?:{'|'.join(parts)})", i + 1
