"""A real uvicorn server for tests: 127.0.0.1, a free port (port 0), a background thread."""

from __future__ import annotations

import contextlib
import threading
import time

from kestrel.engine.config import EngineConfig
from kestrel.server.args import ServerConfig
from kestrel.server.launch import make_server

MAX_MODEL_LEN = 1024


@contextlib.contextmanager
def running_server(model: str | None, engine_kwargs: dict | None = None, **server_kwargs):
    """uvicorn on 127.0.0.1 at a free port (port 0), in a background thread; yields (base URL, model name)."""
    engine_kwargs = {"max_total_tokens": 16384, "max_model_len": MAX_MODEL_LEN, **(engine_kwargs or {})}
    engine_config = EngineConfig(model=model, dtype="float32", device="cpu", **engine_kwargs)
    server = make_server(engine_config, ServerConfig(port=0, **server_kwargs))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    name = server.config.app.state.serving.model_name
    try:
        yield f"http://127.0.0.1:{port}", name
    finally:
        server.should_exit = True
        thread.join(30)
