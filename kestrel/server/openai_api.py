"""The FastAPI app: routes, the API-key and body-size gates, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel.server.args import ServerConfig
from kestrel.server.async_engine import AsyncEngine
from kestrel.server.chat import create_chat_completion
from kestrel.server.completions import create_completion
from kestrel.server.errors import error_body, install_error_handlers
from kestrel.server.generate import abort_request, generate
from kestrel.server.media import MediaLimits, MediaLoader
from kestrel.server.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest
from kestrel.server.serving import ServingContext
from kestrel.server.sglang_api import add_sglang_routes
from kestrel.server.sync_api import add_sync_routes

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key (probes and scrapers)


async def _send_error(send: Send, status: int, message: str, type: str, code: str, headers=()) -> None:
    body = json.dumps(error_body(message, type, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGate:
    """Bearer-token check on every route but the open ones, before the body is even read."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            msg = "Missing or incorrect API key (send `Authorization: Bearer <key>`)."
            hdr = [(b"www-authenticate", b"Bearer")]
            return await _send_error(send, 401, msg, "authentication_error", "invalid_api_key", hdr)
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for bodies over the limit: read (at most limit + 1 bytes) up front, then replay to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        msg = f"request body is larger than {self.max_bytes} bytes"
        await _send_error(send, 413, msg, "invalid_request_error", "request_too_large")


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    """The app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    media = None
    if engine.vision is not None:
        local = Path(config.allowed_local_media_path) if config.allowed_local_media_path else None
        limits = MediaLimits(config.max_image_pixels, config.max_image_bytes, config.media_fetch_timeout, local)
        media = MediaLoader(engine.vision, limits)
    ctx = ServingContext(
        engine,
        model_name,
        reasoning_parser=None if config.reasoning_parser == "none" else config.reasoning_parser,
        tool_call_parser=None if config.tool_call_parser == "none" else config.tool_call_parser,
        media=media,
        max_images=config.limit_mm_per_prompt,
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="Kestrel", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(ApiKeyGate, api_key=config.api_key)  # added last = runs first

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({}) if engine.alive else JSONResponse(error_body("engine stopped", "server_error"), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "kestrel",
            "max_model_len": engine.max_model_len,
            "input_modalities": ["text", "image"] if media is not None else ["text"],
        }
        adapters = [  # SGLang's cards of LoRA adapters: root is the folder, parent the base model
            card | {"id": name, "root": path, "parent": model_name} for name, path in engine.lora_adapters.items()
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await create_completion(body, request, ctx)

    @app.post("/generate")
    async def generate_tokens(body: GenerateRequest, request: HTTPRequest) -> Response:
        return await generate(body, request, ctx)

    @app.post("/abort_request")
    async def abort(body: AbortRequest) -> Response:
        return await abort_request(body, ctx)

    add_sglang_routes(app, ctx, config)
    add_sync_routes(app, ctx)
    app.state.serving = ctx
    return app
