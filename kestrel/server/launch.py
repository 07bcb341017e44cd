"""`kestrel serve`: build the engine, wrap it in the app, run uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path

import torch
import uvicorn

from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.keepalive import SERVER_KEEPALIVE_S
from kestrel.models.builtin import builtin_model_path
from kestrel.server.args import ServerConfig
from kestrel.server.async_engine import AsyncEngine
from kestrel.server.metrics import ServerMetrics
from kestrel.server.openai_api import build_app

log = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after the deadline's abort, how long responses get to send their error before uvicorn cancels


def default_model_name(model: str | None) -> str:
    """What clients pass as `model`: the MODEL argument as given, else the built-in model's folder name."""
    return model if model else Path(builtin_model_path()).name


def server_threads() -> int:
    """Intra-op threads for a serving engine on CPU: every core this process may use but one.

    The HTTP thread (parsing, templating, detokenized SSE) runs beside the engine thread; if torch's OpenMP pool
    also takes that core, the two contend every step (measured: batch-1 inter-token latency 32 ms vs 14 ms).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


def check_address(host: str, port: int) -> None:
    """Bind (host, port) and let go, as uvicorn will: a taken port is refused before the model loads, not after."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"host: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ValueError(f"port: cannot listen at {host}:{port}: {exc.strerror or exc}") from None


def make_server(engine_config: EngineConfig, config: ServerConfig) -> uvicorn.Server:
    """The uvicorn server for this configuration (loads the model; the engine thread starts with the app)."""
    check_address(config.host, config.port)
    if engine_config.disaggregation_mode != "null" and engine_config.disaggregation_bootstrap_host is None:
        engine_config = dataclasses.replace(engine_config, disaggregation_bootstrap_host=config.host)
    if engine_config.disaggregation_mode == "prefill" and engine_config.disaggregation_bootstrap_port:
        try:
            check_address(engine_config.disaggregation_bootstrap_host, engine_config.disaggregation_bootstrap_port)
        except ValueError as exc:
            raise ValueError(f"disaggregation_bootstrap_port: {str(exc).partition(': ')[2]}") from None
    if engine_config.num_threads == 0 and engine_config.device in ("auto", "cpu") and not torch.cuda.is_available():
        engine_config = dataclasses.replace(engine_config, num_threads=server_threads())
    engine = Engine(engine_config)
    name = config.served_model_name or default_model_name(engine_config.model)
    async_engine = AsyncEngine(engine, ServerMetrics(), config.max_queued_requests)
    app = build_app(async_engine, config, name)
    stats = engine.stats()
    log.info(
        "serving %s at http://%s:%d (capacity: %d KV tokens, %d concurrent requests, max model len %d, %d threads)",
        name,
        config.host,
        config.port,
        stats["pages_total"] * engine_config.page_size,
        engine_config.max_running_requests,
        engine.max_model_len,
        torch.get_num_threads(),
    )
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=logging.getLevelName(min(logging.getLogger("kestrel").getEffectiveLevel(), logging.INFO)).lower(),
        timeout_graceful_shutdown=config.graceful_shutdown_timeout + ABORT_GRACE_S,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
    )
    return _Server(uv, async_engine, config.graceful_shutdown_timeout)


class _Server(uvicorn.Server):
    """uvicorn, but when the graceful-shutdown timeout runs out, in-flight requests are aborted through the engine
    (pages and slots freed) so that each response ends with a 503 error: uvicorn alone would cancel the handlers
    mid-response, leaving streams without an error or `[DONE]`. uvicorn's own, later timeout stays as a backstop."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, timeout: float) -> None:
        super().__init__(config)
        self._engine, self._timeout = engine, timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self._timeout, self._engine.abort_all, "the server is shutting down", 503)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn once its graceful shutdown is over."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Run until SIGINT/SIGTERM; in-flight requests get `graceful_shutdown_timeout` seconds to finish, then are
    aborted (their pages and slots freed) before the engine thread stops.

    uvicorn handles both signals itself, then raises them again with the handlers it found installed: SIGINT as
    KeyboardInterrupt, SIGTERM (by default) as a kill. Both end here, after the clean shutdown, as a normal return.
    Both handlers are installed before the model loads, so a signal while the server is still starting (loading,
    building the CPU kernels) stops it too: a process started in the background by a non-interactive shell inherits
    SIGINT ignored, and that SIGINT was lost until uvicorn's own handlers went in, leaving the server running.
    """
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _on_sigterm),
    }
    try:
        make_server(engine_config, config).run()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
