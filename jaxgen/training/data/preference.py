"""Preference data (`data.source=preference`): JSONL pairs of a prompt and a chosen and a rejected answer,
the loss on the answers' tokens only (preference tuning: jaxgen.training.preference).

A line is TRL's form, one of:
    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                                   # plain text
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": "5"}                                                                   # conversational
Plain text is the prompt's tokens (with the tokenizer's own BOS, if any), then the answer's and an
end-of-text, each tokenized alone (as TRL does). Conversational lines are rendered with the tokenizer's chat
template as chat SFT renders them (`chat.py`): the prompt's messages, then the answer as an assistant turn
(a string) or turns (a list); the trained tokens are the answer's turns. A pair is two documents, chosen
then rejected, and stays whole (never split between train and held-out; packed into rows whole:
`pipeline.PreferencePairs`).

A bad line (not JSON, a missing or empty field, a field of the wrong type, an answer with no trained token)
is skipped, counted and reported with its path:line and field (`PreferenceData.bad`); a file with no good
line stops the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxgen.tokenizer import Tokenizer
from jaxgen.training.data.chat import ChatDataError, ChatRenderer, Conversation, encode_rendered, parse_message

FIELDS = ("prompt", "chosen", "rejected")
_SHOWN = 5  # bad lines named in the report


class PreferenceDataError(ValueError):
    """Preference data that cannot be trained on."""


@dataclass
class PreferenceData:
    """(tokens (n,) uint32, trained (n,) bool) of each pair's chosen and rejected answer; the bad lines."""

    pairs: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # "path:line: field: what is wrong"


def encode_pairs(tokenizer: Tokenizer, paths: list[Path], tokenizer_name: str = "") -> PreferenceData:
    """Every good line of `paths` encoded, in file and line order; PreferenceDataError if none is good."""
    out, renderer = PreferenceData(), None
    for path in paths:
        for where, record in _records(path, out.bad):
            try:
                if isinstance(record["prompt"], list):
                    renderer = renderer or ChatRenderer(tokenizer.chat_template, tokenizer_name)
                    pair = tuple(_conversation(renderer, tokenizer, record, k, where) for k in ("chosen", "rejected"))
                else:
                    pair = tuple(_plain(tokenizer, record["prompt"], record[k], f"{where}: {k}") for k in FIELDS[1:])
            except ChatDataError as e:
                if "needs a chat template" in str(e) or "does not compile" in str(e):
                    raise PreferenceDataError(str(e)) from None  # the template's fault, not the line's
                out.bad.append(str(e))
                continue
            out.pairs.append(pair)
    if not out.pairs:
        shown = "; ".join(out.bad[:_SHOWN]) + ("; ..." if len(out.bad) > _SHOWN else "")
        raise PreferenceDataError(f"no good preference pair in {[str(p) for p in paths]}: {len(out.bad)} bad: {shown}")
    return out


def _records(path: Path, bad: list[str]) -> Iterator[tuple[str, dict]]:
    """(path:line, record) of each line whose JSON has the three fields of usable types; the rest in `bad`."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError, ValueError) as e:
                bad.append(f"{where}: not JSON that can be read ({type(e).__name__})")
                continue
            problem = _problem(record)
            if problem:
                bad.append(f"{where}: {problem}")
                continue
            yield where, record


def _problem(record) -> str | None:
    if not isinstance(record, dict):
        return f"a line is an object with {', '.join(FIELDS)}; got {type(record).__name__}"
    for key in FIELDS:
        value = record.get(key)
        if not isinstance(value, (str, list)) or not value:
            return f"{key}: missing, empty or not text or messages (got {type(value).__name__})"
        if isinstance(value, list) and not all(isinstance(m, dict) for m in value):
            return f"{key}: a list must hold messages (objects with role and content)"
        if isinstance(value, list) and key != "prompt" and any(m.get("role") != "assistant" for m in value):
            return f"{key}: its messages must be the assistant's (the answer)"
    if isinstance(record["prompt"], str) and any(isinstance(record[k], list) for k in FIELDS[1:]):
        return "chosen: messages need a conversational prompt (a list of messages), not text"
    return None


def _plain(tokenizer: Tokenizer, prompt: str, answer: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    for name, text in (("prompt", prompt), ("answer", answer)):
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise ChatDataError(f"{where}: the {name} is not valid Unicode ({e.reason})") from None
    head = tokenizer.encode_batch([prompt], special=True)[0]
    body = tokenizer.encode_batch([answer], special=False)[0] + [tokenizer.eos_id]
    tokens = np.asarray(head + body, np.uint32)
    return tokens, np.arange(len(tokens)) >= len(head)


def _conversation(renderer: ChatRenderer, tokenizer: Tokenizer, record: dict, key: str, where: str):
    answer = record[key]
    answer = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else answer
    messages = [parse_message(m, f"{where}: prompt[{i}]") for i, m in enumerate(record["prompt"])]
    messages += [parse_message(m, f"{where}: {key}[{i}]") for i, m in enumerate(answer)]
    conv = Conversation(messages, None, f"{where}: {key}")
    text, spans = renderer.spans(conv)
    in_prompt = sum(m["role"] == "assistant" for m in messages[: len(record["prompt"])])
    return next(encode_rendered([(conv, text, spans[in_prompt:])], tokenizer))
