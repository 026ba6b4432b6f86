"""Structured output: what a constraint costs the decode loop, and what compiling one costs.

    python bench/structured.py [--config llama-small] [--layers 4] [--batches 1 8 32] [--new-tokens 96]

Decode tokens/s through Generator (random weights, float32, byte-level tokenizer over the model's
vocabulary) with every row free, every row JSON-schema constrained, and a quarter of the rows constrained
(the free rows' own tokens/s then: what sharing a batch with constrained rows costs them). The schema
forces a long output (a string of exactly N characters) so every row runs the same number of steps; rows
are greedy (the mask's own cost) and sample at temperature 1 (where a masked row's sort over the
vocabulary, mostly -inf, is cheaper than a free row's). The mask is computed on the device from the
automaton's table, so there is no host time per mask. Jump-forward (forced tokens as drafts, with
num_speculative_tokens) is measured on a schema with keys: tokens per target step and the share of
tokens that were forced. Compile times are for schemas like those of tests/test_structured.py, through
the warm compile worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxgen import model
from jaxgen.config import load_config
from jaxgen.inference import structured
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.inference.structured import Structured
from jaxgen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
COMPILE_SCHEMAS = {
    "person (string, bounded int, enum array, bool)": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "tags"],
    },
    "nested object with anyOf": {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "number"}}},
            "label": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,8}$"}, {"type": "null"}]},
        },
        "required": ["point"],
    },
    "json_object (any object)": structured.JSON_OBJECT,
    "date (format)": {"type": "string", "format": "date"},
}


def long_schema(n: int) -> dict:
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": n, "maxLength": n}},
            "required": ["text"]}  # fmt: skip


def run(gen, prompts, configs) -> tuple[float, list]:
    gen.generate(prompts, configs)  # compile (and compile the constraint)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, configs)
    return time.perf_counter() - t0, outs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-small")
    p.add_argument("--layers", type=int, default=4, help="model depth (default 4, to keep the run short)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    cfg = load_config(ROOT / "configs" / f"{args.config}.yaml").model
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
    params = model.init_params(cfg, jax.random.key(0))
    tok = Tokenizer.byte_level()
    vocab = structured.Vocabulary.of(tok, cfg.vocab_size)

    print(f"{args.config} with {args.layers} layers, vocabulary {cfg.vocab_size}, float32; {args.new_tokens} "
          "new tokens a row")  # fmt: skip
    print("grammar compile (warm worker), ms:")
    structured.compile_automaton(Structured(regex="warm"), vocab)  # starts the worker
    for name, schema in COMPILE_SCHEMAS.items():
        t0 = time.perf_counter()
        a = structured.compile_automaton(Structured(json=schema), vocab)
        print(f"  {name:<48}{(time.perf_counter() - t0) * 1e3:8.1f}  ({a.num_states} states)")

    # the forced string leaves room for the braces and the key: every constrained row runs to max_new_tokens
    schema = long_schema(args.new_tokens)
    rng = np.random.default_rng(0)
    print(f"{'batch':>6}{'temp':>6}{'free tok/s':>12}{'all JSON':>10}{'ratio':>7}{'1/4 JSON: free rows':>21}"
          f"{'ratio':>7}")  # fmt: skip
    for b in args.batches:
        gen = Generator(params, cfg, tok, max_batch=b, chunk_steps=32)
        prompts = [rng.integers(32, 127, 16).tolist() for _ in range(b)]
        for temperature in (0.0, 1.0):  # greedy skips the sort over the vocabulary: the mask's own cost shows
            row = dict(max_new_tokens=args.new_tokens, temperature=temperature)
            free = [SamplingConfig(seed=i, ignore_eos=True, **row) for i in range(b)]
            json_rows = [SamplingConfig(seed=i, structured=Structured(json=schema), **row) for i in range(b)]
            quarter = [json_rows[i] if i % 4 == 3 else free[i] for i in range(b)]
            t_free, outs = run(gen, prompts, free)
            t_json, j_outs = run(gen, prompts, json_rows)
            t_quarter, _ = run(gen, prompts, quarter)
            for o in j_outs:
                assert o.finish_reason == "length" or len(json.loads(o.text)["text"]) == args.new_tokens
            n_free, n_json = sum(len(o.tokens) for o in outs), sum(len(o.tokens) for o in j_outs)
            r_free, r_json = n_free / t_free, n_json / t_json
            r_quarter = sum(1 for i in range(b) if i % 4 != 3) * args.new_tokens / t_quarter
            # the free rows' tokens/s beside constrained rows against the same rows' in the all-free batch
            print(f"{b:>6}{temperature:>6.0f}{r_free:>12.1f}{r_json:>10.1f}{r_json / r_free:>7.2f}{r_quarter:>21.1f}"
                  f"{t_free / t_quarter:>7.2f}")  # fmt: skip
    print("host time per mask: none (the mask is read from the automaton's table on the device)")
    llguidance_row(tok)
    jump_forward(params, cfg, tok, vocab, max(args.batches))


def llguidance_row(tok) -> None:
    """What the road not taken costs: llguidance computes each row's mask on the host, token by token
    (compile time and host time per mask for the person schema, over the same tokenizer), when installed."""
    try:
        import llguidance
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("llguidance: not installed (pip install llguidance transformers) for the comparison row")
        return
    schema = COMPILE_SCHEMAS["person (string, bounded int, enum array, bool)"]
    lt = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|endoftext|>"))
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    compile_ms = (time.perf_counter() - t0) * 1e3
    text = tok.encode(json.dumps({"name": "bob", "age": 33, "tags": ["a", "b"], "ok": True}))
    t0 = time.perf_counter()
    for token in text:
        matcher.compute_bitmask()
        matcher.consume_token(token)
    per_mask = (time.perf_counter() - t0) / len(text) * 1e6
    print(f"llguidance, for comparison (person schema): compile {compile_ms:.1f} ms, host time per mask "
          f"{per_mask:.0f} us per row per token (and a host round trip every step)")  # fmt: skip


def jump_forward(params, cfg, tok, vocab, b: int) -> None:
    """The person schema at temperature 1 with and without num_speculative_tokens=4: forced tokens (one
    allowed) become drafts that verification keeps, so a run of them costs one model step."""
    schema = COMPILE_SCHEMAS["person (string, bounded int, enum array, bool)"]
    automaton = structured.compile_automaton(Structured(json=schema), vocab)
    prompts = [f"person {i}: " for i in range(b)]
    print(f"jump-forward, batch {b}, the person schema:")
    print(f"{'num_speculative_tokens':>24}{'tok/s':>8}{'tokens/target step':>20}{'forced tokens':>15}")
    for w in (0, 4):
        gen = Generator(params, cfg, tok, max_batch=b, chunk_steps=32)
        configs = [SamplingConfig(max_new_tokens=128, seed=i, structured=Structured(json=schema),
                                  num_speculative_tokens=w) for i in range(b)]  # fmt: skip
        t, outs = run(gen, prompts, configs)
        tokens = sum(len(o.tokens) for o in outs)
        forced = 0
        for o in outs:
            state = 0
            for token in o.tokens:
                forced += len(automaton.allowed(state)) == 1
                state = automaton.walk([token], state)
        per_step = gen.speculation_stats()["tokens_per_step"] if w else 1.0
        print(f"{w:>24}{tokens / t:>8.1f}{per_step:>20.2f}{forced / tokens:>15.0%}")


if __name__ == "__main__":
    main()
