"""Structured output (jaxgen.inference.structured): constraints compiled to token automata and enforced in the
decode loop of Generator and the engine, with and without speculative decoding."""

import dataclasses
import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig, SamplingError
from jaxgen.inference.structured import GrammarPool, Structured, Vocabulary, compile_automaton, grammar
from jaxgen.inference.structured.automaton import token_bytes
from jaxgen.inference.structured.spec import integer_regex
from jaxgen.tokenizer import Tokenizer, train_bpe

CFG = ModelConfig(vocab_size=260, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=512)

# bounded schemas: a random-weight model completes each within max_tokens
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"enum": [1, 2]}},
                "required": ["x", "y"],
            },
            "label": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "null"}]},
        },
        "required": ["point", "label"],
    },
]
# context-free grammars (structured/grammar.py): left recursion, nesting, %ignore, GBNF; each output is parsed by lark
ARITH = """
?start: expr
?expr: expr "+" term | expr "-" term | term
?term: term "*" factor | term "/" factor | factor
?factor: DIGIT | "(" expr ")" | "-" factor
DIGIT: /[1-9]/
"""
JSONISH = """
?start: object | array
?value: object | array | STRING | NUMBER | "true" | "false" | "null"
array: "[" [value ("," value)*] "]"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
STRING: /"[a-z]{0,3}"/
NUMBER: /-?[0-9]{1,2}/
%import common.WS
%ignore WS
"""
SQL_GBNF = r"""
root ::= "SELECT " cols " FROM " name where? ";"   # a comment
cols ::= "*" | name (", " name)*
name ::= [a-z] [a-z0-9_]{0,3}
where ::= " WHERE " cond
cond ::= cmp (" AND " cmp)* | "(" cond ")"
cmp ::= name (" = " | " < " | " > ") (name | [0-9]{1,3} | "'" [^'\n]{0,4} "'")
"""
SQL_LARK = r"""
start: "SELECT " cols " FROM " NAME [" WHERE " cond] ";"
cols: "*" | NAME (", " NAME)*
cond: cmp (" AND " cmp)* | "(" cond ")"
cmp: NAME (" = " | " < " | " > ") (NAME | /[0-9]{1,3}/ | /'[^'\n]{0,4}'/)
NAME: /[a-z][a-z0-9_]{0,3}/
"""  # the same language in Lark: GBNF outputs are parsed with it
GRAMMARS = {ARITH: ARITH, JSONISH: JSONISH, SQL_GBNF: SQL_LARK}  # grammar -> the Lark grammar that parses it
PARSERS = {}

REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"
CHOICES = ("positive", "negative", "neutral", "ünïcode ✓")
PROMPTS = ["Give me JSON: ", "x", "The answer is"]


@pytest.fixture(scope="module")
def parts():
    params = model.init_params(CFG, jax.random.key(3))
    params = jax.tree.map(lambda w: w * 3 if w.ndim > 1 else w, params)  # peaked: the mask has work to do
    tok = Tokenizer.byte_level()
    # spec_gate off: the speculative tests speculate whatever the gate would measure on this machine
    return params, tok, Generator(params, CFG, tok, max_batch=16, chunk_steps=16, spec_gate=False)


def _configs(**kw):
    base = dict(max_new_tokens=160, temperature=1.0)
    out = [SamplingConfig(structured=Structured(json=s), seed=i, **base, **kw) for i, s in enumerate(SCHEMAS * 2)]
    out += [SamplingConfig(structured=Structured(regex=REGEX), seed=7, **base, **kw)]
    out += [SamplingConfig(structured=Structured(choice=CHOICES), seed=8, **base, **kw)]
    return out


def _parse(grammar_text: str, text: str):
    """lark's own parse of `text` (Earley reads terminals as the grammar means them: see structured/grammar.py)."""
    import lark

    lark_text = GRAMMARS[grammar_text]
    if lark_text not in PARSERS:
        PARSERS[lark_text] = lark.Lark(lark_text, parser="earley", lexer="dynamic_complete")
    return PARSERS[lark_text].parse(text)


def _grammar_configs(**kw):
    """Constrained by each grammar: greedy and two seeds. A little bias (end, "(") so that the random model's
    arithmetic nests and ends within max_new_tokens."""
    eos = Tokenizer.byte_level().eos_id
    bias = {ARITH: ((eos, 0.5), (ord("("), 1.5)), JSONISH: (), SQL_GBNF: ()}
    runs = ((0, 0.0), (1, 1.0), (2, 1.0))  # (seed, temperature)
    return [SamplingConfig(structured=Structured(grammar=g), seed=seed, temperature=t, max_new_tokens=96,
                           logit_bias=b, **kw) for g, b in bias.items() for seed, t in runs]  # fmt: skip


def _check(outs, configs):
    for o, c in zip(outs, configs, strict=True):
        s = c.structured
        assert o.finish_reason == "stop", (o.text, s)
        if s.grammar is not None:
            _parse(s.grammar, o.text)
        elif s.json is not None:
            data = json.loads(o.text)
            (schema,) = [x for x in SCHEMAS if x == json.loads(s.json)]  # as declared (== ignores the order)
            jsonschema.validate(data, schema)
            assert list(data) == [k for k in schema["properties"] if k in data], o.text  # in the declared order
        elif s.regex is not None:
            assert re.fullmatch(s.regex, o.text), o.text
        else:
            assert o.text in s.choice


def test_integer_ranges_are_exact():
    for lo, hi in [(0, 120), (5, None), (None, -3), (-15, 7), (None, None), (100, 100), (7, 2345)]:
        rx = integer_regex(lo, hi)
        got = [n for n in range(-3000, 3000) if re.fullmatch(rx, str(n))]
        assert got == [n for n in range(-3000, 3000) if (lo is None or n >= lo) and (hi is None or n <= hi)]
        assert not re.fullmatch(rx, "007") and not re.fullmatch(rx, "-0")


def test_bad_constraints_are_named_before_anything_runs(parts):
    _, _, gen = parts
    bad = [
        ({"json": {"type": "object", "patternProperties": {}}}, "keyword 'patternProperties' at #"),
        ({"json": {"type": "number", "minimum": 1}}, "on integers only"),
        ({"json": "{not json"}, "is not JSON"),
        ({"regex": "(unclosed"}, "does not compile"),
        ({"choice": []}, "1 to 1024 non-empty strings"),
        ({"grammar": "start: 'a' ("}, "structured.grammar: not a Lark grammar: Unexpected input at line 1 column 8"),
        ({"grammar": 'start: a b\na: "x"'}, "structured.grammar: not a Lark grammar: Rule 'b' used but not defined"),
        ({"grammar": 'root ::= "a" | other'}, "structured.grammar: the rule 'other' is used (in 'root') but not"),
        ({"grammar": "start: /(?<!x)y/"}, "pattern '(?<!x)y' uses a lookaround"),
        ({"grammar": 'start: "a" start'}, "the rule 'start' derives no finite text with recursion unrolled 3"),
        ({"grammar": "%import .secret.X\nstart: X"}, "%import .secret.X: only lark's own common and unicode"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"json": {"type": "string", "maxLength": 3}, "colour": 1}, "unknown structured field 'colour'"),
        ({"json": {"type": "foo"}}, "cannot be compiled: Unsupported type: foo"),
        ({"regex": "x" * 100_001}, "at most 100000"),
    ]  # fmt: skip
    before = gen.compilations
    for structured, message in bad:
        with pytest.raises(SamplingError, match=re.escape(message)) as e:
            gen.generate(["x"], SamplingConfig.from_dict({"structured": structured}))
        assert e.value.field == "structured"
    with pytest.raises(SamplingError, match="ignore_eos=true cannot be combined"):
        SamplingConfig(structured=Structured(regex="a"), ignore_eos=True)
    assert gen.compilations == before


def test_token_bytes_of_a_bpe_tokenizer_rebuild_its_text():
    text = 'naïve café ✓ 日本語 déjà vu, {"k": [1, 2]}\n' * 20
    tok = train_bpe([text], 320)
    pieces = token_bytes(tok)
    ids = tok.encode(text)
    assert any(len(pieces[i]) > 1 for i in ids)  # multi-byte tokens
    assert b"".join(pieces[i] for i in ids).decode() == tok.decode(ids)
    assert pieces[tok.eos_id] is None  # special tokens write nothing


def test_generator_outputs_satisfy_their_constraints_or_end_with_length(parts):
    _, _, gen = parts
    configs = _configs()
    too_long = SamplingConfig(structured=Structured(regex="a{50}"), max_new_tokens=10)  # cannot finish in time
    *outs, cut = gen.generate([PROMPTS[i % 3] for i in range(len(configs))] + ["x"], [*configs, too_long])
    _check(outs, configs)
    assert cut.finish_reason == "length" and cut.text == "a" * 10
    greedy = [SamplingConfig(structured=c.structured, max_new_tokens=160, temperature=0) for c in configs]
    _check(gen.generate(["x"] * len(greedy), greedy), greedy)


def test_grammar_outputs_parse_with_lark_greedy_sampled_and_speculative(parts):
    _, _, gen = parts
    configs = _grammar_configs()
    prompts = [PROMPTS[i % 3] for i in range(len(configs))]
    outs = gen.generate(prompts, configs)
    _check(outs, configs)
    assert max(o.text.count("(((") for o in outs[:3]) >= 1  # the arithmetic nests to the bound
    spec = gen.generate(prompts, [dataclasses.replace(c, num_speculative_tokens=4) for c in configs])
    assert [o.tokens for o in spec] == [o.tokens for o in outs]


def test_grammar_automata_write_sentences_only_and_nest_to_the_bound():
    """Random walks through each grammar's automaton (no model) parse with lark; sentences nested up to
    grammar.DEPTH are accepted, deeper ones and non-sentences are not."""
    tok = Tokenizer.byte_level()
    vocab = Vocabulary.of(tok, CFG.vocab_size)
    rng = np.random.default_rng(0)
    for text in GRAMMARS:
        a = compile_automaton(Structured(grammar=text), vocab)
        for _ in range(40):
            state, out = 0, []
            while len(out) < 200:
                allowed = a.allowed(state)
                if tok.eos_id in allowed and (len(allowed) == 1 or rng.random() < 0.15):
                    _parse(text, bytes(out).decode())
                    break
                out.append(int(rng.choice([t for t in allowed if t != tok.eos_id])))
                state = a.next_state[state, out[-1]]

    def complete(text: str, sentence: str) -> bool:
        state = compile_automaton(Structured(grammar=text), vocab).walk(tok.encode(sentence))
        return state >= 0 and tok.eos_id in compile_automaton(Structured(grammar=text), vocab).allowed(state)

    assert grammar.DEPTH == 3
    for sentence in ["1", "1+2*3-4/5", "-(-3)", "(((1)))", "((1+2)*3)-(4)", "1-2-3-4-5-6-7-8-9-1-2-3-4-5-6-7"]:
        assert complete(ARITH, sentence), sentence
    for sentence in ["((((1))))", "1+", "(1", "1 + 2", "0", ""]:
        assert not complete(ARITH, sentence), sentence
    assert complete(JSONISH, '{"a":[1,{"b":[]}],"":null}') and complete(JSONISH, '{"a":[[[[]]]]}')
    assert not complete(JSONISH, '{"a":[[[[[]]]]]}')  # value re-entered 3 times, then only empty brackets
    assert complete(SQL_GBNF, "SELECT a, b FROM t WHERE ((x = 'it' AND y < 3));")


def test_gbnf_and_lark_terminals_read_as_their_languages():
    """grammar.py's regular expressions (no automaton): GBNF classes, escapes, repetition; Lark flags and lazy
    quantifiers; Python's fullmatch reads them as outlines-core does, for these."""
    cases = [
        (r'root ::= [a\-z]{2} "\"" ([0-9] | "x")+ # ok', ['a-"1x', 'zz"0'], ['ab"1', 'a-"', 'a-"y']),
        (r'root ::= [^\]]? "a"* ("b" "c"){1,2}', ["bc", "xaabcbc", "abc"], ["]bc", "bcbcbc", ""]),
        ('start: "select"i WORD\nWORD: /[a-z]+?/', ["SELECTab", "sElEcTx"], ["select", "SELECTAB"]),
        ("start: A B\nA: /a|ab/\nB: /b?c/", ["ac", "abc", "abbc"], ["abbbc", "a"]),
        ('start: a\na: b "x" | "y"\nb: a "z"', ["y", "yzx", "yzxzxzx"], ["yz", "x", "yzxzxzxzx"]),  # indirect left
        # recursion: unrolled grammar.DEPTH levels
    ]
    for text, good, bad in cases:
        pattern = grammar.grammar_regex(text)
        assert all(re.fullmatch(pattern, g) for g in good), (pattern, good)
        assert not any(re.fullmatch(pattern, b) for b in bad), (pattern, bad)


def test_free_rows_beside_constrained_ones_are_unchanged(parts):
    _, _, gen = parts
    free = [SamplingConfig(max_new_tokens=24, temperature=0.8, seed=s) for s in range(3)]
    alone = gen.generate(PROMPTS, free)
    mixed = gen.generate(PROMPTS + PROMPTS, free + _configs()[:3])
    assert [o.tokens for o in mixed[:3]] == [o.tokens for o in alone]


def test_speculative_decoding_keeps_constrained_outputs_token_for_token(parts):
    _, _, gen = parts
    configs = [*_configs()[:4], _configs()[-2]]
    for temperature in (0.0, 1.0):
        plain = [SamplingConfig(structured=c.structured, seed=c.seed, max_new_tokens=120, temperature=temperature)
                 for c in configs]  # fmt: skip
        spec = [SamplingConfig(**{**c.__dict__, "num_speculative_tokens": 4}) for c in plain]
        a, b = gen.generate(["ab" * 8] * 5, plain), gen.generate(["ab" * 8] * 5, spec)
        assert [o.tokens for o in a] == [o.tokens for o in b]
        _check(b, plain)


def test_engine_enforces_constraints_under_preemption_and_speculation_and_equals_the_generator(parts):
    params, tok, gen = parts
    configs = [dataclasses.replace(c, num_speculative_tokens=4 * (i % 2))
               for i, c in enumerate(_configs() + [_grammar_configs()[k] for k in (2, 4, 6)])]  # fmt: skip
    free = SamplingConfig(max_new_tokens=60, temperature=0.7, seed=5)
    prompts = [PROMPTS[i % 3] for i in range(len(configs))] + ["free row"]
    expected = gen.generate(prompts, [*configs, free])
    # a pool too small for every sequence at once: sequences are preempted and resume mid-constraint
    tight = Engine(params, CFG, tok, ServeConfig(slots=4, num_pages=14, page_size=16, chunk_steps=8))
    tight.grammars.reserve(1024)  # the size it grows to: its steps compile for one table, not one per growth
    got = tight.generate(prompts, [*configs, free])
    assert tight.metrics()["requests_preempted"] > 0
    assert [o.tokens for o in got] == [o.tokens for o in expected]
    _check(got[:-1], configs)
    assert tight.grammars.table.shape[0] >= 2 and np.all(tight.grammars.table[0] == 0)


def test_an_exploding_automaton_is_stopped_by_the_time_limit():
    vocab = Vocabulary.of(Tokenizer.byte_level(), CFG.vocab_size)
    with pytest.raises(SamplingError, match="did not compile in 2 s"):
        compile_automaton(Structured(regex="(a|b)*a(a|b){40}"), vocab, timeout=2.0)
    a = compile_automaton(Structured(regex="ok|no"), vocab)  # a fresh worker takes over
    assert a.walk(b"ok") > 0 and a.walk(b"x") == -1


# (constraint, texts it takes, texts it refuses): ECMA-262's \d \w \s and ".", in a regex and in a schema's
# pattern or format (there inside a JSON string: no raw control character, quote or backslash)
ECMA_CASES = [
    (Structured(regex=r"\d\w\s."), ["1a x", "9_\t\u00e9", "0Z\u00a0-", "00\ufeff\u2003"],
     ["\u06f7a x", "1\u00e9 x", "1a\u0085x", "1\U0001e2f2 x", "1a \n", "1a \r", "1a \u2028"]),
    (Structured(regex=r"[\d.]\D\W\S[^\s]"), ["..#x\u00e9", "5a-\u00e9x"],
     ["\u0661a-xx", "5a_xx", "5a- x", "5a-x\ufeff"]),
    (Structured(json={"type": "string", "pattern": r"^\d\w\s.$"}), ['"1a x"', '"1a\u00a0\u00e9"'],
     ['"\u0967a x"', '"1a\tx"', '"1a \t"', '"1a ""', '"1a \\"']),
    (Structured(json={"type": "string", "format": "date"}), ['"1987-01-31"'],
     ['"198\u06f7-01-31"', '"\U0001e2f0987-01-31"']),
    (Structured(json={"type": "string", "format": "time"}), ['"12:00:00"', '"23:59:59.25Z"'],
     ['"12:00:00\\a5"', '"1\u06f2:00:00"']),  # (outlines-core wrote a backslash and any character for ".")
    # a grammar's terminals are Python patterns (Lark lexes with `re`): \d \w \s ASCII, a subset of what that
    # lexer takes, so every output lexes; \D \W \S keep Python's Unicode meaning, as the lexer's
    (Structured(grammar="start: /\\d\\w\\s/ /\\D\\W\\S/"), ["1a x-\u00e9", "0_\ta-!"],
     ["\u06f7a xa-b", "1\u00e9 xa-b", "1a\u00a0xa-b", "1a x\u0661-b", "1a xa\u00e9b", "1a xa- "]),
]  # fmt: skip


@pytest.mark.parametrize("structured, good, bad", ECMA_CASES)
def test_patterns_read_digits_words_and_spaces_as_ecma_262(structured, good, bad):
    """Issue 44: a schema's `pattern` and `format` mean what ECMA-262 says (\\d is [0-9], \\w [0-9A-Za-z_],
    \\s its whitespace: U+00A0 and U+FEFF but not U+0085), and so do regex constraints; a grammar's terminals
    read \\d \\w \\s as ASCII and their negations as Python's `re` (Lark's lexer) does."""
    tok = Tokenizer.byte_level()
    a = compile_automaton(structured, Vocabulary.of(tok, CFG.vocab_size))

    def takes(text):
        state = a.walk(tok.encode(text))
        return state >= 0 and tok.eos_id in a.allowed(state)

    assert [t for t in good if not takes(t)] == [] and [t for t in bad if takes(t)] == []


def test_grammar_pool_shares_reuses_and_grows():
    vocab = Vocabulary.of(Tokenizer.byte_level(), CFG.vocab_size)
    a, b = (compile_automaton(Structured(regex=r), vocab) for r in ("yes|no", "[0-9]{3}"))
    pool = GrammarPool(CFG.vocab_size)
    assert pool.assign(0, a) == 1 and pool.assign(1, a) == 1  # one range for both slots
    off_b = pool.assign(2, b)
    assert off_b == 1 + a.num_states and pool.table.shape[0] >= off_b + b.num_states
    assert pool.table.shape[0] & (pool.table.shape[0] - 1) == 0  # a power of two
    np.testing.assert_array_equal(pool.table[off_b : off_b + b.num_states] - off_b, np.where(
        b.next_state >= 0, b.next_state, -1 - off_b))  # fmt: skip
    pool.assign(0, None)
    pool.assign(1, None)  # a's range is free again: the next automaton of its size or less goes there
    assert pool.assign(3, compile_automaton(Structured(regex="y"), vocab)) == 1
    assert np.all(pool.table[0] == 0)  # the free row


def test_json_object_takes_objects_of_scalars_arrays_and_objects(parts):
    _, tok, gen = parts
    a = gen.automaton(SamplingConfig.from_dict({"structured": {"json_object": True}}))
    for text in ['{"a": [1, "x"], "b": {"c": null}, "d": -2.5e+3}', "{}", '{"k": true}']:
        assert tok.eos_id in a.allowed(a.walk(tok.encode(text))), text  # complete: it may end here
    assert a.walk(tok.encode('{"a": ]')) == -1


def _sentencepiece_like() -> Tokenizer:
    """A Llama-style tokenizer.json: "▁" for spaces, byte fallback (<0xNN>) for what the vocabulary lacks."""
    import tokenizers
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "é", "ab", "▁ab", "{", "}", '"', ":"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens(["</s>"])
    return Tokenizer(tok, eos_ids=2)


def test_byte_fallback_tokenizer_outputs_whole_characters():
    tok = _sentencepiece_like()
    text = 'ab abc é ✓ {"a": 1}'
    ids = tok.encode(text)
    pieces = token_bytes(tok)
    assert b"".join(pieces[i] for i in ids).decode() == " " + tok.decode(ids)  # the decoder strips one space
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size)
    params = jax.tree.map(lambda w: w * 3 if w.ndim > 1 else w, model.init_params(cfg, jax.random.key(4)))
    gen = Generator(params, cfg, tok, max_batch=8, chunk_steps=16)
    choices = ("✓ yes", "é", "ab ✓✓")
    configs = [SamplingConfig(structured=Structured(choice=choices), seed=s, max_new_tokens=40) for s in range(4)]
    configs += [SamplingConfig(structured=Structured(regex="(✓|é){2,4}"), seed=s, max_new_tokens=40) for s in range(4)]
    outs = gen.generate(["ab"] * 8, configs)
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(o.text in choices for o in outs[:4]) and all(re.fullmatch("(✓|é){2,4}", o.text) for o in outs[4:])
