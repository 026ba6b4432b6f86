"""What the HTTP routes do, for one app: a request checked, its prompts tokenized (or its chat rendered), its
constraint compiled, and a `Job` made to answer it. The routes themselves are `server.py`'s; everything
here that takes long (tokenizing, rendering, compiling) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets

from jaxgen.config import ServeConfig
from jaxgen.inference.decode import encode_prompt
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig, SamplingError, check_prompt, check_text, shown
from jaxgen.serving import chat
from jaxgen.serving.errors import APIError
from jaxgen.serving.protocol import ChatRequest, CompletionRequest, GenerationRequest, TokenizeRequest
from jaxgen.serving.responses import CHAT, COMPLETION, Job
from jaxgen.serving.structured_fields import Compiles, ConstraintError, requested
from jaxgen.serving.tools import ToolError, tools_of


class Handlers:
    """The work of one app's routes, over its engine, model name, serving limits and chat template."""

    def __init__(self, engine: Engine, model_name: str, serve: ServeConfig):
        self.engine, self.model_name, self.serve = engine, model_name, serve
        self.chat_template = chat.ChatTemplate(engine.tokenizer.chat_template)
        longest_token = max(len(t) for t in engine.tokenizer.tok.get_vocab())  # chars one token covers, at most
        self.most_chars = longest_token * engine.cfg.max_seq_len  # longer text is too long whatever it tokenizes to
        self.compiles = Compiles(engine.automaton)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` names (None: the base model); 404 model_not_found for any other name."""
        if name is None or name == self.model_name:
            return None
        if name in self.engine.lora_names():
            return name
        adapters = "".join(f", {a!r}" for a in self.engine.lora_names())
        raise APIError(404, f"the model {shown(name)} does not exist; this server serves {self.model_name!r}"
                       f"{adapters}", "model", code="model_not_found")  # fmt: skip

    async def completion_job(self, body: CompletionRequest) -> Job:
        """The Job of a /v1/completions request."""
        adapter = self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of={shown(body.best_of)} is not supported: use n (best_of may only equal n, "
                           f"here {body.n})", "best_of")  # fmt: skip
        ids = await asyncio.to_thread(self.prompt_ids, _prompt_list(body.prompt, self.serve.max_queue))
        structured, field = await asyncio.to_thread(_constraint, body)  # (a schema of 1 MB takes a while)
        sampling = sampling_config(body, body.max_tokens, body.logprobs or 0, structured=structured)
        await self.compiled(sampling, field)
        if body.echo and body.logprobs is not None:  # scores of the prompt too, with the most likely token
            top = max(body.logprobs, 1)
            sampling = dataclasses.replace(sampling, logprobs=top, prompt_logprobs=top)
        want = body.logprobs is not None
        return Job(self.engine, self.serve, ids, sampling, body, COMPLETION, adapter or self.model_name, body.echo,
                   want, lora=adapter)  # fmt: skip

    async def chat_job(self, body: ChatRequest) -> Job:
        """The Job of a /v1/chat/completions request."""
        adapter = self.check_model(body.model)
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if field == "max_completion_tokens" else body.max_tokens
        (tools, call), (structured, constraint_field) = await asyncio.to_thread(self._constraints, body)
        if call is not None:
            if structured is not None:
                raise APIError(400, "tool_choice (required, or a named function) constrains the output to a call; "
                               f"{constraint_field} cannot constrain it too", constraint_field)  # fmt: skip
            structured, constraint_field = call, "tools"
        sampling = sampling_config(body, 256 if max_tokens is None else max_tokens, top, field, structured)
        await self.compiled(sampling, constraint_field)
        ids = await asyncio.to_thread(self.chat_ids, body.messages, tools.for_template() if tools else None)
        return Job(self.engine, self.serve, [ids], sampling, body, CHAT, adapter or self.model_name, False,
                   body.logprobs, tools if tools is not None and tools.active else None, lora=adapter)  # fmt: skip

    def tokens_of(self, text: str, field: str) -> list[int]:  # (in a worker thread: long text takes a while)
        check_text(field, text)
        if len(text) > self.most_chars:
            raise APIError(400, f"{field} has {len(text)} characters, far more than the model's context of "
                           f"{self.engine.cfg.max_seq_len} tokens can hold", field)  # fmt: skip
        return encode_prompt(self.engine.tokenizer, encode(self.engine.tokenizer, text), self.engine.cfg, field)

    def prompt_ids(self, prompts: list) -> list[list[int]]:
        fields = ["prompt" if len(prompts) == 1 else f"prompt.{i}" for i in range(len(prompts))]
        return [
            self.tokens_of(p, f) if isinstance(p, str) else encode_prompt(self.engine.tokenizer, p, self.engine.cfg, f)
            for p, f in zip(prompts, fields, strict=True)
        ]

    def chat_ids(self, messages, tools: list[dict] | None) -> list[int]:  # (in a worker thread: 4 MB of messages)
        shaped = [chat.template_message(i, m) for i, m in enumerate(chat.messages(messages))]
        return self.tokens_of(self.chat_template.render(shaped, tools), "messages")

    async def compiled(self, sampling: SamplingConfig, field: str | None) -> None:
        """Compiles the request's constraint (a schema takes milliseconds, a hostile regex up to the compile time
        limit), so that a bad one is a 400 naming the client's field before anything is queued."""
        try:
            await self.compiles.check(sampling, field)
        except ConstraintError as e:
            raise APIError(400, str(e), e.field) from None

    def _constraints(self, body: ChatRequest):
        """A chat request's ((tools, the call they constrain to), (its own constraint, the field that carried it))."""
        return _tools(body, self.chat_template.source), _constraint(body)

    def tokenize_json(self, body: TokenizeRequest) -> bytes:  # text of any length the body limit lets in: a client
        check_text("prompt", body.prompt)  # (lm-eval's rolling loglikelihood) tokenizes whole documents, then splits
        ids = encode(self.engine.tokenizer, body.prompt, body.add_special_tokens)
        context = self.engine.cfg.max_seq_len
        return b'{"tokens": [%s], "count": %d, "max_model_len": %d}' % (_joined_ints(ids), len(ids), context)

    def detokenize_json(self, tokens: list[int]) -> bytes:
        cfg = self.engine.cfg
        if len(tokens) > cfg.max_seq_len:
            raise APIError(400, f"tokens has {len(tokens)} ids; at most the model's context, {cfg.max_seq_len}",
                           "tokens")  # fmt: skip
        if tokens:  # (an empty list decodes to "")
            check_prompt(tokens, cfg.vocab_size, 2**31 - 1, "tokens")
        return json.dumps({"prompt": self.engine.tokenizer.decode(tokens)}).encode()


def sampling_config(body: GenerationRequest, max_tokens: int, logprobs: int, max_field: str = "max_tokens",
                    structured=None) -> SamplingConfig:  # fmt: skip
    """The request's SamplingConfig: the one validation (bounds and messages) every door shares."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    data = dict(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=seed, n=body.n, stop=stop, logprobs=logprobs, logit_bias=body.logit_bias or {},
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
        num_speculative_tokens=body.num_speculative_tokens, structured=structured,
    )  # fmt: skip
    try:
        return SamplingConfig.from_dict(data)
    except SamplingError as e:
        if e.field == "max_new_tokens":  # the API's name for it
            raise APIError(400, str(e).replace("max_new_tokens", max_field, 1), max_field) from None
        raise


def _constraint(body: GenerationRequest):
    """(the request's Structured or None, the field that carried it); a bad one is a 400 naming that field."""
    try:
        return requested(body)
    except ConstraintError as e:
        raise APIError(400, str(e), e.field) from None


def _tools(body: ChatRequest, template: str | None):
    """(the request's `tools.Tools`, the constraint its tool_choice puts on the output): (None, None) without
    tools; a bad tools or tool_choice is a 400 naming it."""
    try:
        tools = tools_of(body.tools, body.tool_choice, template, body.parallel_tool_calls)
        return tools, tools.constraint() if tools is not None else None
    except ToolError as e:
        raise APIError(400, str(e), e.field) from None


def encode(tokenizer, text: str, special: bool = True) -> list[int]:
    """Tokenizer.encode, through encode_batch: that one lets go of the interpreter while it works (encode holds
    it: a 4 MB text stalled the event loop for 4 s, even from a worker thread)."""
    return tokenizer.tok.encode_batch([text], add_special_tokens=special)[0].ids


def _joined_ints(ids: list[int], piece: int = 65536) -> bytes:
    """The text "1, 2, 3" for a JSON list, a piece at a time: one json.dumps of millions of ids holds the interpreter
    (and so the event loop) for most of a second; between pieces the loop gets its turn."""
    return b", ".join(json.dumps(ids[i : i + piece])[1:-1].encode() for i in range(0, len(ids), piece))


def _prompt_list(prompt, most: int) -> list:
    """The prompts of a completions request: a string or a list of ids is one; a list of either, several."""
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    if len(prompts) > most:
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {most} (serve.max_queue)", "prompt")
    return prompts
