"""The prefill side's bootstrap server: SGLang's rank directory plus this rank's control endpoints.

SGLang's protocol: prefill ranks `PUT /route` their address and parallel layout; a decode worker first asks
`GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1` for the layout, then the
same with the rank's indices for that rank's address (`rank_ip`, `rank_port`; Kestrel adds the rank's transfer
session and pool layout). `GET /health` is the heartbeat. A Kestrel prefill worker is one rank, so its control
endpoints (`/kestrel/pd/connect|room|abort`, JSON) live on the same server. A plain threaded HTTP server: control
messages are small and rare next to the data, and its threads never touch the engine.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
RANK_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
# PUT /route fields (SGLang's): what one prefill rank reports about itself.
RANK_FIELDS = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank")
RANK_FIELDS += ("pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size")

Handler = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


class _QuietHTTPServer(ThreadingHTTPServer):
    """A peer that hangs up mid-request (a decode worker stopping or killed) is routine for a bootstrap server:
    one warning line, not the stdlib's traceback on stderr. Anything else is still logged with its traceback."""

    def handle_error(self, request, client_address) -> None:  # type: ignore[override]
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            log.warning("bootstrap: %s:%s hung up (%s)", *client_address[:2], type(error).__name__)
        else:
            log.exception("bootstrap: request from %s:%s failed", *client_address[:2])


class BootstrapServer:
    """Serves in a daemon thread from `start()` until `stop()`; `handlers` maps a POST path to a function of the
    JSON body returning (status, JSON answer)."""

    def __init__(self, host: str, port: int, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}  # (dp, cp, tp, pp) -> PUT /route body
        self.layout: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._http = _QuietHTTPServer((host, port), _handler_class(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.05,), name="kestrel-pd-bootstrap", daemon=True
        )  # a short poll interval: `stop` returns within it

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10)

    # -- SGLang's rank directory -------------------------------------------------------------------------
    def put_rank(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        missing = [k for k in RANK_FIELDS if k not in body]
        if missing:
            return 400, {"error": f"PUT /route: missing fields {missing}"}
        dp = body["attn_dp_rank"] if body["system_dp_size"] == 1 else body["system_dp_rank"]
        key = (int(dp), int(body["attn_cp_rank"]), int(body["attn_tp_rank"]), int(body["pp_rank"]))
        with self._lock:
            self.ranks[key] = body
            if self.layout is None:
                dp_size = body["attn_dp_size"] if body["system_dp_size"] == 1 else body["system_dp_size"]
                self.layout = {
                    "attn_tp_size": body["attn_tp_size"],
                    "attn_cp_size": body["attn_cp_size"],
                    "dp_size": dp_size,
                    "pp_size": body["pp_size"],
                    "page_size": body["page_size"],
                    "kv_cache_dtype": body.get("kv_cache_dtype"),
                    "follow_bootstrap_room": True,
                }
        return 200, {}

    def get_route(self, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        try:
            key = tuple(int(query[k][0]) for k in RANK_KEYS)
        except (KeyError, ValueError):
            return 400, {"error": f"GET /route needs integer query parameters {RANK_KEYS}"}
        with self._lock:
            layout = self.layout
            expected = 1
            if layout is not None:
                for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"):
                    expected *= int(layout[k])
            if layout is None or len(self.ranks) < expected:
                return 503, {"error": f"prefill ranks not all registered yet ({len(self.ranks)}/{expected})"}
            if key == (-1, -1, -1, -1):
                return 200, dict(layout)
            rank = self.ranks.get(key)
        if rank is None:
            return 404, {"error": f"no prefill rank dp={key[0]} cp={key[1]} tp={key[2]} pp={key[3]}"}
        return 200, rank


def _handler_class(server: BootstrapServer):
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.debug("bootstrap %s", format % args)

        def _answer(self, status: int, body: dict[str, Any] | str) -> None:
            raw = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _body(self) -> dict[str, Any] | None:
            size = self.headers.get("Content-Length", "")
            if not size.isdigit() or int(size) > MAX_BODY_BYTES:
                self._answer(413 if size.isdigit() else 411, {"error": f"a JSON body of at most {MAX_BODY_BYTES} B"})
                return None
            try:
                body = json.loads(self.rfile.read(int(size)) or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._answer(400, {"error": f"body is not JSON: {exc}"})
                return None
            if not isinstance(body, dict):
                self._answer(400, {"error": "body must be a JSON object"})
                return None
            return body

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            if url.path == "/health":
                return self._answer(200, "OK")
            if url.path == "/route":
                return self._answer(*server.get_route(parse_qs(url.query)))
            self._answer(404, {"error": f"no route GET {url.path}"})

        def do_PUT(self) -> None:  # noqa: N802
            if urlparse(self.path).path != "/route":
                return self._answer(404, {"error": f"no route PUT {self.path}"})
            body = self._body()
            if body is not None:
                self._answer(*server.put_rank(body))

        def do_POST(self) -> None:  # noqa: N802
            handler = server.handlers.get(urlparse(self.path).path)
            if handler is None:
                return self._answer(404, {"error": f"no route POST {self.path}"})
            body = self._body()
            if body is None:
                return
            try:
                self._answer(*handler(body))
            except Exception as exc:  # a handler bug must answer, not hang the decode worker
                log.exception("bootstrap handler %s failed", self.path)
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

    return _Handler
