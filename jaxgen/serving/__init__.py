"""Serving: the OpenAI-compatible HTTP server and the resumable JSONL batch job, both over the engine.

server.py      the FastAPI app: routes, request models, chat templates, limits, graceful shutdown
responses.py   one request answered whole or streamed (exact deltas with logprobs; every stream ends)
errors.py      every error in OpenAI's shape; the body limit (413 before parsing)
constraints.py response_format, structured_outputs and guided_* turned into one `Structured` (HTTP and JSONL)
tools.py       tool calls: tools and tool_choice, the call constraint, Hermes and Llama 3 calls parsed
cli.py         serve.py's command line: the generate and http commands, flags taken from the config fields
batch_job.py   `serve.py generate --input ... --output ...`: every line its own result or error
"""
