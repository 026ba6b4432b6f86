"""The HTTP server's request models (pydantic), one per body, as OpenAI and vLLM shape them. Types only: every
bound is checked once, by `SamplingConfig` (the same bounds and messages as the Python API and the batch job),
and an answer is built as JSON by `responses.py`. Strict: `true`, `4.0` or `"4"` for an integer is refused, as
SamplingConfig refuses it (a float field takes an integer: 1 is 1.0).

    CompletionRequest, ChatRequest (GenerationRequest: the fields they share), Message
    ResponseFormat, JsonSchemaFormat     OpenAI's response_format (`structured_fields.py` reads it)
    Tool, Function, NamedChoice          OpenAI's tools and a named tool_choice (`tools.py`)
    TokenizeRequest, DetokenizeRequest, LoadLoraRequest, UnloadLoraRequest
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation

NAME = r"[A-Za-z0-9_-]{1,64}"  # OpenAI's rule for a function's name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with no choices and the request's usage (as OpenAI sends it)


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema (`schema` is a pydantic name: kept under an alias)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(_Strict):
    name: str = Field(pattern=f"^{NAME}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object); none: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class _Named(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: _Named


class GenerationRequest(_Strict):
    """The fields completions and chat share (see `handlers.sampling_config` for how they become one
    SamplingConfig)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # {token id (as a string, JSON's keys): bias in [-100, 100]}
    ignore_eos: bool = False  # an extension (as in vLLM): generate max_tokens whatever the model says
    num_speculative_tokens: int = 0  # an extension: n-gram drafts checked per step (0..8; the output is the same)
    user: str | None = None
    # what the output must be (`structured_fields.py`): at most one of these
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {<a kind of structured.KINDS> | json_object: ...}
    # vLLM's older fields, guided_<kind> for each kind of structured.KINDS (a test holds them equal)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids; a list of either: one choice each
    max_tokens: int = 16  # 0 with echo: the prompt's log-probabilities only
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # not supported: accepted only equal to n (clients send best_of=1)


class Message(BaseModel):
    model_config = ConfigDict(strict=True)

    role: str
    content: str | list[dict] | None = None  # text, or OpenAI's content parts: [{"type": "text", "text": ...}, ...]
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (`tools.message_for_template`)
    tool_call_id: str | None = None  # a tool's answer: the call it answers


class ChatRequest(GenerationRequest):
    # validated in a worker thread (`chat.messages`): 125,000 small messages take most of a second to validate
    messages: Annotated[list[Message], SkipValidation]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None  # functions the model may call (`jaxgen.serving.tools`)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a constrained answer holds one call (else up to tools.MAX_CALLS)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (a BOS token for Llama; nothing for GPT-2)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(_Strict):
    lora_name: str
    lora_path: str  # a PEFT adapter folder on the server's machine
    load_inplace: bool = False  # (vLLM's) replace an adapter of that name if loaded


class UnloadLoraRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; ignored: adapters are known by name)
