"""A live HTTP server for tests: uvicorn on a free 127.0.0.1 port in a thread, over a started engine."""

import contextlib
import socket
import threading
import time

import jax
import uvicorn

from jaxgen import model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def tiny_engine():
    """(an unstarted Engine over a random byte-level model of CFG with TEMPLATE, its params). The weights are
    scaled up so that sampled text is not near-uniform."""
    params = model.init_params(CFG, jax.random.key(1))
    params = jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, params)
    tok = Tokenizer.byte_level()
    tok.chat_template = TEMPLATE
    return Engine(
        params, CFG, tok, ServeConfig(slots=8, num_pages=128, chunk_steps=4, prefill_chunk=64, spec_gate=False)
    ), params


@contextlib.contextmanager
def live_server(engine, app):
    """Starts `engine` and serves `app`; yields (base url, the uvicorn server); stops both after."""
    engine.start()
    try:
        with serving(app) as (url, server):
            yield url, server
    finally:
        engine.stop()


@contextlib.contextmanager
def serving(app):
    """Serves `app` (over an engine already started) on a free port; yields (base url, the uvicorn server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
