"""SGLang's weight-sync API, for an RL trainer driving the engine between policy versions.

`/pause_generation` (`mode` abort | retract | in_place) and `/continue_generation` gate the engine's steps;
`/update_weights_from_disk` reloads the weights in place from a checkpoint of the same architecture;
`/get_weight_version` (and `/weight_version`) and `/update_weight_version` name the weights. Every `/generate`
result carries the `weight_version` it ran on. How in-flight requests cross a sync is `AsyncEngine`'s business:
each one finishes on the old weights or reruns whole on the new ones. Answers are SGLang's (`success`, `message`);
a refusal is a 400 that also carries the OpenAI-style `error` body naming the field.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kestrel.server.engine_events import EngineStopped
from kestrel.server.errors import error_body
from kestrel.server.protocol import (
    ContinueGenerationRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
)
from kestrel.server.serving import ServingContext

LOAD_FORMATS = (None, "auto", "safetensors")  # Kestrel reads Hugging Face safetensors folders only


def _refusal(status: int, message: str, param: str | None = None, **extra) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "overloaded_error" if status == 503 else "server_error"
    return JSONResponse({"success": False, "message": message, **extra} | error_body(message, kind, param), status)


async def update_weights_from_disk(ctx: ServingContext, body: UpdateWeightsFromDiskRequest) -> Response:
    engine = ctx.engine
    if body.load_format not in LOAD_FORMATS:
        msg = f"load_format: {body.load_format!r} is not supported; Kestrel reads safetensors (auto | safetensors)"
        return _refusal(400, msg, "load_format", num_paused_requests=0)
    if not body.flush_cache and engine.engine_config.enable_prefix_caching:
        msg = "flush_cache: must be true while prefix caching is on: the cached KV was computed by the old weights"
        return _refusal(400, msg, "flush_cache", num_paused_requests=0)
    try:
        paused = await engine.update_weights(body.model_path, body.weight_version, body.abort_all_requests)
    except EngineStopped as exc:
        return _refusal(503, str(exc), num_paused_requests=0)
    except ValueError as exc:  # CheckpointError / ConfigError name what does not match
        return _refusal(400, str(exc), "model_path", num_paused_requests=0)
    except Exception as exc:  # the load itself failed (I/O): the weights may be partly new
        return _refusal(500, f"weight update failed: {exc}", num_paused_requests=0)
    msg = f"Succeeded to update model weights from {body.model_path}."
    return JSONResponse(
        {"success": True, "message": msg, "num_paused_requests": paused, "weight_version": engine.weight_version}
    )


async def pause_generation(ctx: ServingContext, body: PauseGenerationRequest | None) -> Response:
    mode = (body or PauseGenerationRequest()).mode
    try:
        counts = await ctx.engine.pause(mode)
    except EngineStopped as exc:
        return _refusal(503, str(exc))
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok", "mode": mode, **counts})


async def continue_generation(ctx: ServingContext) -> Response:
    try:
        await ctx.engine.resume()
    except EngineStopped as exc:
        return _refusal(503, str(exc))
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def update_weight_version(ctx: ServingContext, body: UpdateWeightVersionRequest) -> Response:
    try:
        await ctx.engine.set_weight_version(body.new_version, body.abort_all_requests)
    except EngineStopped as exc:
        return _refusal(503, str(exc))
    msg = f"Weight version updated to {body.new_version}"
    return JSONResponse({"success": True, "message": msg, "new_version": body.new_version})


def add_sync_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsFromDiskRequest) -> Response:
        return await update_weights_from_disk(ctx, body)

    @app.post("/pause_generation")
    async def pause(body: PauseGenerationRequest | None = None) -> Response:
        return await pause_generation(ctx, body)

    @app.post("/continue_generation")
    async def resume(body: ContinueGenerationRequest | None = None) -> Response:
        return await continue_generation(ctx)

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version() -> Response:
        return JSONResponse({"weight_version": ctx.engine.weight_version})

    @app.post("/update_weight_version")
    async def set_weight_version(body: UpdateWeightVersionRequest) -> Response:
        return await update_weight_version(ctx, body)
