"""OpenAI-style errors: every refusal is a 4xx with `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error", 503: "overloaded_error"}


# Field names here are snake_case; pydantic's labels of union members are types (`str`, `list[int]`, `NamedToolChoice`).
_UNION_TAG = re.compile(r"^(str|int|float|bool)$|[^a-z0-9_]")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away while its request was running (its engine work has been aborted)."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers)


def validation_param(errors: list[dict[str, Any]]) -> str | None:
    """The first error's field path (`messages[0].role`), cut where pydantic names a union member (`list[str]`)."""
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    loc = list(errors[0].get("loc", ()))
    path = ""
    for part in loc[1:] if loc[:1] == ["body"] else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(part):
            break
        else:
            path += ("." if path else "") + part
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(APIError(400, f"malformed JSON body: {errors[0].get('msg')}", code="invalid_json"))
        # A value_error comes from a union member whose type matched, so it says more than the others' type errors.
        errors = [e for e in errors if e.get("type") == "value_error"][:1] or errors
        param = validation_param(errors)
        msg = errors[0].get("msg", "invalid request") if errors else "invalid request"
        if errors and errors[0].get("type") == "value_error":
            msg = str(errors[0].get("ctx", {}).get("error", msg))  # our own words, without pydantic's "Value error, "
        if errors and errors[0].get("type") == "missing" and param is None:
            msg = "a JSON request body is required"
        return error_response(APIError(400, f"{param}: {msg}" if param else msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return error_response(err)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path)
        return error_response(APIError(500, "internal server error"))
