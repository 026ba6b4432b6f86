"""Tokenizers: a byte-level default and any Hugging Face `tokenizer.json`, both through `tokenizers`.

The byte-level tokenizer is itself a real `tokenizers` object (byte-level BPE with no merges: one
token per byte, plus an end-of-text token), so every tokenizer saves to and loads from the same
`tokenizer.json` format and a run folder is self-describing. `byte-chat` is the same tokenizer with a
built-in chat template (BYTE_CHAT_TEMPLATE), so chat SFT (`data.source=chat`) needs no model folder.

`train_bpe(texts, vocab_size)` trains a byte-level BPE tokenizer; `python train_tokenizer.py` runs it on a corpus.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")

# `byte-chat`'s template: `<|role|>\n` before each turn, the end-of-text token after it (so a served answer
# stops there), tools listed in a first system turn and calls written as Hermes' <tool_call> (the format the
# server parses when a template names no other).
BYTE_CHAT_TEMPLATE = r"""
{%- if tools -%}
    {{- '<|system|>\nTools:' -}}
    {%- for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor -%}
    {{- '\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|endoftext|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {{- '<|' + message.role + '|>\n' -}}
    {%- if message.content is string %}{{ message.content }}{% endif -%}
    {%- for call in message.tool_calls or [] -%}
        {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": '
            + (call.function.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|endoftext|>' -}}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif -%}
"""


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` that knows its end-of-sequence ids and chat template.

    eos_ids: every id that ends a generation (Llama 3 instruct has two); `eos_id` is the first, the one
    appended to training documents. chat_template: the Jinja template of a Hugging Face folder, or None.
    """

    def __init__(self, tok: tokenizers.Tokenizer, eos_ids=None, chat_template: str | None = None):
        self.tok = tok
        if isinstance(eos_ids, int):
            eos_ids = (eos_ids,)
        if not eos_ids:
            found = next((tok.token_to_id(t) for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
            if found is None:
                raise ValueError(f"tokenizer has none of the end-of-sequence tokens {_EOS_CANDIDATES}")
            eos_ids = (found,)
        n = tok.get_vocab_size(with_added_tokens=True)
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < n for i in eos_ids):
            raise ValueError(f"eos_ids={eos_ids!r} is not allowed: token ids in [0, {n}) of this tokenizer")
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.chat_template = chat_template

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @classmethod
    def byte_level(cls) -> Tokenizer:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_to_char = _bytes_to_unicode()
        vocab = {byte_to_char[b]: b for b in range(256)}
        assert set(vocab) == set(alphabet)
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOS_TOKEN])
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (expected a tokenizer.json)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON or a missing entry
            raise ValueError(f"{path}: not a tokenizer that the tokenizers library reads ({e})") from None
        return cls(tok)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder or a jaxgen run folder.

        Reads tokenizer.json; end-of-sequence ids come from generation_config.json, else config.json,
        else tokenizer_config.json's eos_token, else a known end-of-text token; the chat template from
        tokenizer_config.json (or chat_template.jinja beside it).
        """
        folder = Path(folder)
        tok = cls.from_file(folder / "tokenizer.json").tok
        configs = {name: _read_json(folder / name) for name in _CONFIG_FILES}
        tok_cfg = configs["tokenizer_config.json"]
        eos_ids = _eos_ids(tok, folder, configs)
        template = _chosen_template(tok_cfg.get("chat_template"))
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tok, eos_ids, template if isinstance(template, str) else None)

    @classmethod
    def from_name(cls, name: str) -> Tokenizer:
        """`byte`, `byte-chat`, a tokenizer.json, or a folder holding one (the `data.tokenizer` config value)."""
        if name == "byte":
            return cls.byte_level()
        if name == "byte-chat":
            return cls(cls.byte_level().tok, chat_template=BYTE_CHAT_TEMPLATE)
        return cls.from_folder(name) if Path(name).is_dir() else cls.from_file(name)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def check_model_vocab(self, model_vocab: int, where: str) -> None:
        """ValueError when this tokenizer has ids the model cannot embed (a model's vocabulary may be
        larger, padded for speed, but not smaller); `where` names the model's config."""
        if self.vocab_size > model_vocab:
            raise ValueError(
                f"{where}: vocab_size={model_vocab} is smaller than the tokenizer's {self.vocab_size} tokens: ids "
                f"{model_vocab}..{self.vocab_size - 1} have no embedding (is tokenizer.json the model's own?)"
            )

    def info(self) -> dict:
        """What a client needs to tokenize as the server does (vLLM's /tokenizer_info): special tokens by
        their text (None when the tokenizer has none), the chat template, the vocabulary size."""
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        bos = next((t for t in ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>") if t in special), None)
        return {
            "eos_token": self.tok.id_to_token(self.eos_id), "eos_token_ids": list(self.eos_ids), "bos_token": bos,
            "pad_token": None, "chat_template": self.chat_template, "vocab_size": self.vocab_size,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }  # fmt: skip

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids; `special` applies the tokenizer's own post-processor (a BOS token for Llama or
        Gemma, nothing for GPT-2 or byte level), as transformers does by default."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=special)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    def save_folder(self, folder: str | Path) -> None:
        """tokenizer.json and a tokenizer_config.json that both jaxgen and transformers read.

        Each is written to a temporary file in `folder` and renamed over, so none is ever left half written.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.save(folder / ".tokenizer.json.tmp")
        (folder / ".tokenizer.json.tmp").replace(folder / "tokenizer.json")
        eos = self.tok.id_to_token(self.eos_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / ".tokenizer_config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
        (folder / ".tokenizer_config.json.tmp").replace(folder / "tokenizer_config.json")


_CONFIG_FILES = ("generation_config.json", "config.json", "tokenizer_config.json")


def _chosen_template(value):
    """tokenizer_config.json's chat_template: a string, or (Hugging Face's format for several) a list of
    {"name", "template"}: the one named "default", else the first."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object of settings")
    return data


def _eos_ids(tok: tokenizers.Tokenizer, folder: Path, configs: dict) -> tuple[int, ...] | None:
    """The end-of-sequence ids: generation_config.json's eos_token_id, else config.json's, else the id of
    tokenizer_config.json's eos_token; None when none says. Each value given is checked, used or not."""
    n = tok.get_vocab_size(with_added_tokens=True)
    found = []
    for name in ("generation_config.json", "config.json"):
        value = configs[name].get("eos_token_id")
        ids = [value] if isinstance(value, int) else value
        ok = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        if value is not None and not (ok and all(0 <= i < n for i in ids)):
            raise ValueError(
                f"{folder / name}: eos_token_id={value!r} is not allowed: a token id in [0, {n}) of tokenizer.json "
                "or a non-empty list of them"
            )
        found += [tuple(ids)] if value is not None else []
    token = configs["tokenizer_config.json"].get("eos_token")
    if found or not token:
        return found[0] if found else None
    text = token.get("content") if isinstance(token, dict) else token  # transformers' AddedToken form
    if not isinstance(text, str) or tok.token_to_id(text) is None:
        raise ValueError(
            f"{folder / 'tokenizer_config.json'}: eos_token={token!r} is not allowed: a token of tokenizer.json, "
            'as a string or {"content": "..."}'
        )
    return (tok.token_to_id(text),)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (used by ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with `tokenizers` on an iterator of documents."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok)
