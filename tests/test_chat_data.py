"""Chat SFT data (`data.source=chat`): the loss mask covers exactly the assistant's tokens for a ChatML
(Qwen-style) and a Llama-3-style template, as transformers' assistant mask says for the same templates
with `{% generation %}` marks; the loss ignores every other target; packing keeps conversations apart;
the iterator resumes; bad lines and templates that cannot mark the assistant are refused by file:line."""

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxgen import model
from jaxgen.chat_template import compile_template
from jaxgen.config import ConfigError, DataConfig, load_config
from jaxgen.tokenizer import Tokenizer
from jaxgen.training.data.chat import ChatDataError, ChatRenderer, encode_conversations, parse_line
from jaxgen.training.data.pipeline import PackedConversations, train_iterator
from jaxgen.training.data.sources import iter_documents
from jaxgen.training.data.tokens import DOC_START, NO_LOSS, load_splits
from jaxgen.training.step import loss_sum
from jaxgen.training.trainer import resolve_init_from
from tests.conftest import ROOT

# The shape of Qwen2.5's template (default system prompt, tools in the system turn, calls as <tool_call>,
# consecutive tool answers in one user turn). [[gen]] and [[end]] become transformers' generation marks
# or nothing.
CHATML = """
{%- if tools %}{{- '<|im_start|>system\\n' }}
    {{- messages[0].content + '\\n\\n' if messages[0].role == 'system' else 'You are a helpful assistant.\\n\\n' }}
    {{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nReturn each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not tools %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}[[gen]]
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}{{- '<|im_end|>\\n' }}[[end]]
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# The shape of Llama 3.1's template: a BOS, a dated system turn (tools listed there), headers, <|eot_id|>,
# a call as {"name", "parameters"}, tool answers as the ipython role, text trimmed.
LLAMA3 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}
{%- if tools %}{{- 'Answer a call as {"name": function name, "parameters": arguments}.\\n\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in rest %}
    {%- if message.role == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}[[gen]]
        {%- if message.tool_calls %}{%- set f = message.tool_calls[0].function %}
            {{- '{"name": "' + f.name + '", "parameters": ' + (f.arguments | tojson) + '}' }}
        {%- else %}{{- message.content | trim }}{%- endif %}{{- '<|eot_id|>' }}[[end]]
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

END_OF_TURN = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>"}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Zürich"}'}}
TEXT_CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "a fox?"},
                  {"role": "assistant", "content": "The quick brown fox jumps — über the lazy dog."}]},
    {"messages": [{"role": "user", "content": "what is 2+2"}, {"role": "assistant", "content": "It is 4."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Both read."}]}]},
]  # fmt: skip
TOOL_CHAT = {
    "tools": [WEATHER],
    "messages": [{"role": "user", "content": "weather in Zürich?"}, {"role": "assistant", "content": None,
                 "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                 {"role": "assistant", "content": "Sunny and 21 C in Zürich."}],
}  # fmt: skip
CHATS = [*TEXT_CHATS, TOOL_CHAT]


def _variant(template: str, marks: bool) -> str:
    return template.replace("[[gen]]", "{% generation %}" if marks else "").replace(
        "[[end]]", "{% endgeneration %}" if marks else ""
    )


def _hf_tokenizer(kind: str, template: str) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE with the family's special tokens (Llama's adds a BOS, as Llama 3's does)."""
    special = {"chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>"]}[kind]  # fmt: skip
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=special, initial_alphabet=alphabet)
    tok.train_from_iterator([json.dumps(c, ensure_ascii=False) for c in CHATS] * 4 + [template], trainer=trainer)
    extra = {}
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        special_ids = [("<|begin_of_text|>", bos)]
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=special_ids)
        extra = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    else:
        extra = {"eos_token": "<|im_end|>"}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **extra)


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def family(request, tmp_path_factory):
    """(kind, jaxgen tokenizer folder with the plain template, transformers tokenizer with the marked one)."""
    kind = request.param
    template = {"chatml": CHATML, "llama3": LLAMA3}[kind]
    folder = tmp_path_factory.mktemp(kind)
    hf = _hf_tokenizer(kind, _variant(template, False))
    hf.save_pretrained(folder)
    hf.chat_template = _variant(template, True)
    return kind, folder, hf


def _write(path, chats) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return str(path)


def _ours(folder, path) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = DataConfig(source="chat", paths=(path,), tokenizer=str(folder))
    return list(encode_conversations(cfg, Tokenizer.from_folder(folder), [path]))


def _for_template(chat: dict) -> dict:
    """What transformers is given: the messages as jaxgen passes them (parts joined, arguments as objects)."""
    conv = parse_line(json.dumps(chat), "-")
    return {"conversation": conv.messages, "tools": conv.tools}


def test_mask_is_the_assistant_text_and_its_end_of_turn(family, tmp_path):
    kind, folder, _ = family
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is not None and "{% generation %}" not in tok.chat_template
    ours = _ours(folder, _write(tmp_path / "c.jsonl", TEXT_CHATS))
    for chat, (tokens, trained) in zip(TEXT_CHATS, ours, strict=True):
        answers = [m["content"] for m in _for_template(chat)["conversation"] if m["role"] == "assistant"]
        assert tok.decode(tokens[trained]) == "".join(a + END_OF_TURN[kind] for a in answers)
        text = ChatRenderer(tok.chat_template).spans(parse_line(json.dumps(chat), "-"))[0]
        assert list(tokens) == tok.encode(text)  # the server's encoding of the same render
    if kind == "llama3":  # one BOS, added by the tokenizer as the server adds it, never trained
        assert tokens[0] == tok.tok.token_to_id("<|begin_of_text|>") and not trained[0]


def test_the_built_in_byte_chat_tokenizer_trains_the_answers_and_keeps_its_template(tmp_path):
    """data.tokenizer=byte-chat: chat SFT without a model folder; the answers and their end-of-text are trained."""
    tok = Tokenizer.from_name("byte-chat")
    path = _write(tmp_path / "c.jsonl", CHATS)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call><|endoftext|>'
    answers = [["Hi! How can I help?", "The quick brown fox jumps — über the lazy dog."], ["It is 4."],
               ["Both read."], [call[: -len("<|endoftext|>")], "Sunny and 21 C in Zürich."]]  # fmt: skip
    ours = encode_conversations(DataConfig(source="chat", paths=(path,), tokenizer="byte-chat"), tok, [path])
    for expected, (tokens, trained) in zip(answers, ours, strict=True):
        assert tok.decode(tokens[trained]) == "".join(a + "<|endoftext|>" for a in expected)
        assert tokens[-1] == tok.eos_id
    tok.save_folder(tmp_path / "run")  # the run folder serves with the same template
    assert Tokenizer.from_folder(tmp_path / "run").chat_template == tok.chat_template is not None


def test_mask_equals_transformers_assistant_mask_with_generation_marks(family, tmp_path):
    _, folder, hf = family
    ours = _ours(folder, _write(tmp_path / "c.jsonl", CHATS))
    marked = Tokenizer.from_folder(folder)
    marked.chat_template = hf.chat_template  # the marks render to nothing in jaxgen's sandbox
    for chat, (tokens, trained) in zip(CHATS, ours, strict=True):
        theirs = hf.apply_chat_template(**_for_template(chat), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)  # fmt: skip
        np.testing.assert_array_equal(tokens, theirs["input_ids"])
        np.testing.assert_array_equal(trained, np.asarray(theirs["assistant_masks"], bool))
        assert trained.sum() > 0 and (~trained).sum() > 0
        conv = parse_line(json.dumps(chat), "-")
        plain = _variant(hf.chat_template, False)
        assert ChatRenderer(marked.chat_template).spans(conv) == ChatRenderer(plain).spans(conv)
    decoded = marked.decode(ours[-1][0][ours[-1][1]])
    assert "Zürich" in decoded and "sunny, 21 C" not in decoded  # the call is trained, the tool's answer not


@pytest.fixture(scope="module")
def chat_store(family, tmp_path_factory):
    """(kind, tokenizer, train split, its examples) of a store of 40 conversations, 256 tokens to an example."""
    kind, folder, _ = family
    tmp = tmp_path_factory.mktemp(f"store-{kind}")
    ask = [{"role": "user", "content": f"question {i}?"} for i in range(40)]
    say = [{"role": "assistant", "content": f"Answer {i}: " + "yes " * (i % 5)} for i in range(40)]
    chats = [{"messages": [q, a]} for q, a in zip(ask, say, strict=True)]
    cfg = DataConfig(source="chat", paths=(_write(tmp / "c.jsonl", chats),), tokenizer=str(folder), seq_len=256,
                     cache_dir=str(tmp / "cache"), eval_fraction=0.1)  # fmt: skip
    tok = Tokenizer.from_folder(folder)
    train = load_splits(cfg, tok)["train"]
    return kind, tok, train, PackedConversations(train["tokens"], train["flags"], 256)


def _conversations(train) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, flags) of each conversation of a split, cut where the flags say one begins."""
    starts = np.flatnonzero(np.asarray(train["flags"]) & DOC_START)
    return [(np.asarray(train["tokens"][a:b]), np.asarray(train["flags"][a:b]))
            for a, b in zip(starts, [*starts[1:], len(train["tokens"])], strict=True)]  # fmt: skip


def test_packing_keeps_whole_conversations_apart(chat_store):
    _, tok, train, src = chat_store
    convs, seen = _conversations(train), []
    assert src.cut == 0 and len(convs) > 30 and len(src) < len(convs)  # several to an example
    for i in range(len(src)):
        ex = src[i]
        tokens = np.append(ex["inputs"], ex["targets"][-1])  # the example's T + 1 tokens
        for s in np.unique(ex["segment_ids"]):
            where = np.flatnonzero(ex["segment_ids"] == s)  # contiguous, positions from 0
            np.testing.assert_array_equal(ex["positions"][where], np.arange(len(where)))
            piece = tokens[where[0] : where[-1] + 2]  # the segment's inputs and its last target
            starts_it = [c for c in convs if len(c[0]) <= len(piece) and np.array_equal(c[0], piece[: len(c[0])])]
            whole = starts_it[0] if starts_it else None
            if whole is None:  # only the padding after the last conversation is no conversation
                assert s == ex["segment_ids"].max() and not ex["loss_mask"][where].any()
                continue
            assert len(whole[0]) == len(where) or len(whole[0]) == len(where) + 1 == len(piece)
            seen.append(tok.decode(whole[0]))
            trained = (whole[1][1:] & NO_LOSS) == 0  # a token is trained as a target when it is the assistant's
            np.testing.assert_array_equal(ex["loss_mask"][where[0] : where[0] + len(whole[0]) - 1], trained)
        assert "question" not in tok.decode(ex["targets"][ex["loss_mask"] > 0])
    assert sorted(seen) == sorted(tok.decode(c[0]) for c in convs)  # each exactly once, none split


def test_a_conversation_longer_than_an_example_keeps_its_beginning():
    tokens = np.arange(1, 21, dtype=np.uint16)
    flags = np.zeros(20, np.uint8)
    flags[[0, 3, 15]] = DOC_START  # documents of 3, 12 and 5 tokens
    src = PackedConversations(tokens, flags, seq_len=7)
    assert src.cut == 1 and len(src) == 3
    np.testing.assert_array_equal(src[0]["inputs"], [1, 2, 3, 0, 0, 0, 0])  # padded: 12 tokens do not fit
    np.testing.assert_array_equal(src[0]["segment_ids"], [1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(src[0]["loss_mask"], [1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(src[1]["inputs"], [4, 5, 6, 7, 8, 9, 10])  # its first 8 (T + 1) tokens
    np.testing.assert_array_equal(src[1]["targets"], [5, 6, 7, 8, 9, 10, 11])


@pytest.mark.parametrize("family", ["chatml"], indirect=True)  # the iterator does not depend on the template
def test_resumed_iterator_gives_the_same_batches(chat_store):
    src = chat_store[3]
    it = train_iterator(src, batch_size=4, seed=1)
    [next(it) for _ in range(3)]
    state = it.get_state()
    rest = [next(it) for _ in range(len(src) // 4 + 2)]  # past an epoch's end
    again = train_iterator(src, batch_size=4, seed=1)
    again.set_state(state)
    for a in rest:
        b = next(again)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("family", ["chatml"], indirect=True)  # the loss reads only the mask
def test_loss_ignores_every_target_but_the_assistants(chat_store):
    _, tok, train, _ = chat_store
    src = PackedConversations(train["tokens"], train["flags"], 64)  # one conversation and padding per example
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["mesh.data=1", "training.loss_chunk=32"])
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = {k: np.stack([src[i][k] for i in range(4)]) for k in src[0]}
    off = batch["loss_mask"] == 0
    assert off.any() and (~off).any()
    loss = jax.jit(lambda b: loss_sum(params, b, cfg)[1][:2])
    rng = np.random.default_rng(0)
    total, count = loss(batch)
    assert int(count) == int((~off).sum())
    other = np.where(off, rng.integers(0, tok.vocab_size, off.shape), batch["targets"]).astype(np.int32)
    assert not np.array_equal(other, batch["targets"])
    np.testing.assert_array_equal(loss({**batch, "targets": other})[0], total)  # bitwise: masked out
    moved = np.where(off, batch["targets"], (batch["targets"] + 1) % tok.vocab_size).astype(np.int32)
    assert loss({**batch, "targets": moved})[0] != total  # the assistant's targets do count


def test_bad_lines_are_errors_naming_file_and_line(tmp_path):
    tok = Tokenizer.byte_level()
    tok.chat_template = _variant(CHATML, False)
    ok = json.dumps(TEXT_CHATS[1])
    cases = [
        ("{not json", "not valid JSON"),
        ('{"text": "hi"}', r"'messages' missing or not a non-empty list; got \['text'\]"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"messages\[0\]: role='robot' is not allowed"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
         r"messages\[0\]: content is int: text"),
        # what the JSON parser itself cannot take (a traceback without the line before issue 44)
        ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON that can be read .RecursionError"),
        ('{"messages": [], "n": ' + "9" * 5000 + "}", "not JSON that can be read .ValueError"),
        ('{"messages": [{"role": "assistant", "content": "\\ud800"}]}', r"messages\[0\]: content is not valid Unicode"),
    ]  # fmt: skip
    for i, (line, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.jsonl", [])
        (tmp_path / f"bad{i}.jsonl").write_text(f"{ok}\n\n{line}\n")
        cfg = DataConfig(source="chat", paths=(path,))
        with pytest.raises(ChatDataError, match=rf"bad{i}.jsonl:3: {message}"):
            list(encode_conversations(cfg, tok, [path]))
    with pytest.raises(ChatDataError, match=r"data\.tokenizer='byte' has none \(byte-chat, "):
        list(encode_conversations(DataConfig(source="chat", paths=(path,)), Tokenizer.byte_level(), [path]))
    docs = list(iter_documents(DataConfig(source="chat", paths=(_write(tmp_path / "t.jsonl", TEXT_CHATS[1:2]),))))
    assert [d.text for d in docs] == ["what is 2+2\nIt is 4."]  # what train_tokenizer.py reads


def test_a_template_without_a_generation_prompt_marks_the_answers():
    """Mistral's shape: the user turn's [/INST] is the cue, add_generation_prompt changes nothing."""
    template = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == "
                "'assistant' %}{{ m.content }}</s>{% endif %}{% endfor %}")  # fmt: skip
    text, spans = ChatRenderer(template).spans(parse_line(json.dumps(TEXT_CHATS[0]), "-"))
    answers = [m["content"] + "</s>" for m in TEXT_CHATS[0]["messages"] if m["role"] == "assistant"]
    assert [text[a:b] for a, b in spans] == answers


def test_the_server_renders_prompts_as_training_renders_them(family):
    """One sandbox: a prompt the server renders is the training render of the same messages, marks and all."""
    from jaxgen.serving.chat import ChatTemplate

    _, _, hf = family
    for chat in CHATS:
        conv = parse_line(json.dumps(chat), "-")
        upto = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
        served = ChatTemplate(hf.chat_template).render(conv.messages[:upto], conv.tools)
        assert served == ChatRenderer(hf.chat_template).render(conv, upto, True)


def test_the_documented_example_line_is_valid_chat_data():
    docs = (ROOT / "docs" / "training.md").read_text()
    example = docs.split("## Chat SFT")[1].split("```json\n")[1].split("```")[0]
    conv = parse_line(example.replace("\n", " "), "docs")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and conv.tools


@pytest.mark.parametrize(
    "template, reason",
    [
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
         "it writes a generation prompt even without add_generation_prompt"),
        ("{% for m in messages %}{{ m.role }}: {{ '<think></think>' if loop.last and m.role == 'assistant' }}"
         "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
         r"messages\[:3\] is not a prefix of the whole conversation's"),
        ("{% for m in messages %}{{ m.role }}: {{ m.content if m.role != 'assistant' else 'hidden' }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}", r"messages\[2\]'s text is not between"),
        ("{{ raise_exception('only one turn') if messages | length > 2 }}{% for m in messages %}{{ m.content }}"
         "{% endfor %}{% if add_generation_prompt %}>{% endif %}", "refused this conversation: only one turn"),
        ("{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}", r"messages\[1\]'s tool calls \['weather'\] are not"),
    ],
)  # fmt: skip
def test_templates_that_cannot_mark_the_assistant_are_refused(template, reason):
    conv = parse_line(json.dumps(TOOL_CHAT if "tool calls" in reason else TEXT_CHATS[0]), "data.jsonl:7")
    with pytest.raises(ChatDataError, match=rf"^data.jsonl:7: .*{reason}"):
        ChatRenderer(template).spans(conv)


def test_the_sandbox_reads_generation_marks_and_loop_controls_and_stops_unsafe_templates():
    assert compile_template("{% generation %}a{% endgeneration %}b").render() == "ab"
    loop = "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert compile_template(loop).render() == "1"  # transformers' loop controls
    conv = parse_line(json.dumps(TEXT_CHATS[1]), "x.jsonl:1")
    with pytest.raises(ChatDataError, match=r"x\.jsonl:1: the chat template failed: SecurityError"):
        ChatRenderer("{{ messages.append(1) }}").render(conv, 2, False)


def _hf_chat_model(folder, tmp_path) -> str:
    """A tiny random Llama saved by transformers beside a copy of `folder`'s chat tokenizer; its 512 positions
    are more than configs/tiny.yaml's model.max_seq_len=128, which its config.json replaces."""
    hf_folder = tmp_path / "hf"
    shutil.copytree(folder, hf_folder)
    shape = dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = transformers.LlamaConfig(**shape, intermediate_size=64, max_position_embeddings=512)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_folder)
    return str(hf_folder)


@pytest.mark.parametrize("family", ["chatml"], indirect=True)  # one template is enough for the command
def test_train_command_runs_on_chat_data(family, tmp_path):
    """The documented command: a Hugging Face folder's model and chat template, data.seq_len beyond the YAML's
    model.max_seq_len (checked against the folder's positions once its config.json is read)."""
    _, folder, _ = family
    hf_folder = _hf_chat_model(folder, tmp_path)
    chats = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} said."}]}
             for i in range(30)]  # fmt: skip
    data = _write(tmp_path / "chat.jsonl", chats)
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--run-dir", str(run), "--no-progress",
           f"training.init_from={hf_folder}", "data.source=chat", f"data.paths=[{data}]", "data.seq_len=256",
           f"data.cache_dir={tmp_path / 'c'}", "training.steps=4", "training.batch_size=2", "training.eval_every=4",
           "training.log_every=2", "checkpoint.every=4", "mesh.data=1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "are cut" not in out.stdout  # data.seq_len=256 holds each of these conversations whole
    too_long = load_config(ROOT / "configs" / "tiny.yaml", [f"training.init_from={hf_folder}", "data.seq_len=1024"])
    with pytest.raises(ConfigError, match=re.escape(f"at most model.max_seq_len=512 (from {hf_folder}/config.json)")):
        resolve_init_from(too_long)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r and np.isfinite(r["loss"]) for r in rows)
    assert Tokenizer.from_folder(run).chat_template == Tokenizer.from_folder(folder).chat_template  # served alike
