"""A live HTTP server for tests: uvicorn on a free 127.0.0.1 port in a thread, over a started engine."""

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def live_server(engine, app):
    """Starts `engine` and serves `app`; yields (base url, the uvicorn server); stops both after."""
    engine.start()
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
        engine.stop()
