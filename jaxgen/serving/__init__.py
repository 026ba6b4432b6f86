"""Serving: the OpenAI-compatible HTTP server and the resumable JSONL batch job, both over the engine.

server.py      the FastAPI app: the routes alone (each group a short function), limits, graceful shutdown
protocol.py    the request models (pydantic): completions, chat, tools, response_format, tokenizer, LoRA
handlers.py    the routes' work: a request checked, tokenized or rendered, its constraint compiled, a Job made
chat.py        chat prompts: the chat template in jinja2's sandbox, messages as templates read them
responses.py   one request answered whole or streamed; completion and chat formats as objects (COMPLETION, CHAT)
errors.py      every error in OpenAI's shape; the body limit (413 before parsing)
structured_fields.py  response_format, structured_outputs and guided_* turned into one `Structured` (HTTP, JSONL)
tools.py       tool calls: tools and tool_choice, the call constraint, one format object per family (FORMATS)
cli.py         serve.py's command line: the generate and http commands, flags taken from the config fields
batch_job.py   `serve.py generate --input ... --output ...`: every line its own result or error
"""
