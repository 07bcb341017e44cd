"""SGLang's worker API, the part its router and tooling call: model and server info, cache flush, deep health check.

Field names follow SGLang's `http_server.py` so that its clients read Kestrel's answers unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import Request as HTTPRequest

from kestrel.disagg.role import FAKE_BOOTSTRAP_HOST, BootstrapTarget
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.builtin import builtin_model_path
from kestrel.server.args import ServerConfig
from kestrel.server.engine_events import EngineStopped
from kestrel.server.errors import APIError
from kestrel.server.protocol import LoadLoRARequest, UnloadLoRARequest
from kestrel.server.serving import Generation, ServingContext

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default: a 1-token generation slower than this means a stuck engine


def kestrel_version() -> str:
    try:
        return version("kestrel")
    except PackageNotFoundError:
        return "unknown"


def model_path(ctx: ServingContext) -> str:
    return ctx.engine.engine_config.model or str(builtin_model_path())


def model_info(ctx: ServingContext) -> dict[str, Any]:
    path = model_path(ctx)
    return {
        "model_path": path,
        "tokenizer_path": path,  # the tokenizer is always read from the checkpoint folder
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": ctx.engine.weight_version,
    }


def server_info(ctx: ServingContext, config: ServerConfig) -> dict[str, Any]:
    """Every engine and server setting (the key masked), the version, and the engine's counters per DP rank."""
    engine = ctx.engine
    server = dataclasses.asdict(config) | {"served_model_name": ctx.model_name}
    if server["api_key"] is not None:
        server["api_key"] = "<hidden>"
    stats = engine.stats()
    states = stats | {
        "max_total_num_tokens": stats["pages_total"] * engine.engine_config.page_size,
        "num_queued_reqs": engine.num_queued(),
    }
    return {
        **dataclasses.asdict(engine.engine_config),
        **server,
        "model_path": model_path(ctx),
        "tokenizer_path": model_path(ctx),
        "max_model_len": engine.max_model_len,
        "weight_version": engine.weight_version,
        "paused": engine.paused,  # the pause_generation mode, None while generating
        "lora_adapters": dict(engine.lora_versions),  # name -> path, version tag, checksum
        "version": kestrel_version(),
        "internal_states": [states],  # one entry per data-parallel rank; Kestrel runs one
    }


async def flush_cache(ctx: ServingContext) -> Response:
    try:
        flushed = await ctx.engine.flush_cache()
    except EngineStopped as exc:
        raise APIError(503, str(exc)) from None
    if not flushed:
        raise APIError(
            400, "cannot flush the cache while requests are running; retry when idle or after pause_generation(retract)"
        )
    return PlainTextResponse("Cache flushed.\n")


async def change_lora(ctx: ServingContext, change) -> Response:
    """Await a load or unload on the engine thread; SGLang's answer (plus, for a load, the version now serving
    under the name), or a 400 naming the problem."""
    try:
        loaded = await change
    except EngineStopped as exc:
        raise APIError(503, str(exc)) from None
    except ValueError as exc:
        field = str(exc).partition(":")[0]
        raise APIError(400, str(exc), param=field if field in ("checksum", "lora_name") else "lora_path") from None
    except Exception as exc:
        raise APIError(500, f"adapter change failed: {exc}") from None
    out = {"success": True, "error_message": "", "loaded_adapters": dict(ctx.engine.lora_adapters)}
    return JSONResponse(out | ({"adapter": loaded} if loaded is not None else {}))


async def health_generate(ctx: ServingContext, client: HTTPRequest) -> Response:
    """200 once a 1-token generation has gone through the engine; 503 if it cannot or takes too long."""
    if not ctx.engine.alive:
        raise APIError(503, "the engine is not running")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # A disaggregated worker checks itself alone, as SGLang's: the fake transfer stands in for the other half.
    boot = None
    if ctx.engine.engine_config.disaggregation_mode != "null":
        boot = BootstrapTarget(FAKE_BOOTSTRAP_HOST, 0, uuid.uuid4().int >> 65)
    try:
        gen = Generation(ctx, [f"HEALTH_CHECK_{uuid.uuid4().hex}"], [[0]], params, deltas=False, bootstraps=[boot])
    except APIError as exc:
        raise APIError(503, f"health check generation refused: {exc.message}") from None
    try:
        await asyncio.wait_for(gen.outputs(client), HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"no token generated within {HEALTH_CHECK_TIMEOUT_S:g} s") from None
    except APIError as exc:
        raise APIError(503, f"health check generation failed: {exc.message}") from None
    finally:
        gen.close()
    return Response(status_code=200)


def add_sglang_routes(app: FastAPI, ctx: ServingContext, config: ServerConfig) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(model_info(ctx))

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return JSONResponse(server_info(ctx, config))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> Response:
        return await flush_cache(ctx)

    @app.post("/load_lora_adapter")
    async def load_lora(body: LoadLoRARequest) -> Response:
        load = ctx.engine.load_lora_adapter(
            body.lora_name, body.lora_path, body.replace, body.lora_version, body.checksum
        )
        return await change_lora(ctx, load)

    @app.post("/unload_lora_adapter")
    async def unload_lora(body: UnloadLoRARequest) -> Response:
        return await change_lora(ctx, ctx.engine.unload_lora_adapter(body.lora_name))

    @app.get("/health_generate")
    async def health_gen(request: HTTPRequest) -> Response:
        return await health_generate(ctx, request)
