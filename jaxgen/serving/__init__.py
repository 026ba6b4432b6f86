"""Serving: the OpenAI-compatible HTTP server and the resumable JSONL batch job, both over the engine.

server.py      FastAPI app, limits, errors in OpenAI's shape, streaming, graceful shutdown
batch_job.py   `serve.py generate --input ... --output ...`: every line its own result or error
"""
