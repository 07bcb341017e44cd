"""Images of OpenAI `image_url` parts → `ProcessedImage`s: base64 `data:` URLs, local files under an allowed folder,
http(s) URLs fetched with size and time limits. Every failure is a 400 naming the part.

Sizes are checked before work is spent: a data URL's length before base64 decoding, a download's Content-Length and
running byte count, a file's size on disk, an image's pixel count from its header before it is decoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from starlette.concurrency import run_in_threadpool

from kestrel.config import VisionConfig
from kestrel.models.vision.preprocess import ImageError, ProcessedImage, load_image
from kestrel.server.errors import APIError


@dataclass
class MediaLimits:
    max_image_pixels: int
    max_image_bytes: int
    fetch_timeout: float
    allowed_local_path: Path | None = None


class MediaLoader:
    def __init__(self, vision: VisionConfig, limits: MediaLimits) -> None:
        self.vision, self.limits = vision, limits
        self.allowed = limits.allowed_local_path.resolve() if limits.allowed_local_path else None

    async def load(self, url: str, param: str) -> ProcessedImage:
        data = await self._bytes(url, param)
        try:
            return await run_in_threadpool(load_image, data, self.vision, self.limits.max_image_pixels)
        except ImageError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def _too_big(self, param: str, size: int) -> APIError:
        limit = self.limits.max_image_bytes
        return APIError(400, f"{param}: the image is {size} bytes, more than the {limit} accepted", param=param)

    async def _bytes(self, url: str, param: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, param)
        if scheme == "file":
            return await run_in_threadpool(self._local_file, url, param)
        if scheme in ("http", "https"):
            return await self._download(url, param)
        raise APIError(400, f"{param}: unsupported URL scheme {scheme!r} (data:, http(s): or file:)", param=param)

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError(400, f"{param}: a data URL must be `data:<type>;base64,<data>`", param=param)
        if len(payload) * 3 // 4 > self.limits.max_image_bytes:
            raise self._too_big(param, len(payload) * 3 // 4)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{param}: invalid or truncated base64 data", param=param) from None

    def _local_file(self, url: str, param: str) -> bytes:
        if self.allowed is None:
            msg = f"{param}: local files are not served (start the server with --allowed-local-media-path)"
            raise APIError(400, msg, param=param)
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise APIError(400, f"{param}: file URLs must name a local path", param=param)
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.allowed):
            raise APIError(400, f"{param}: {path} is outside --allowed-local-media-path", param=param)
        if not path.is_file():
            raise APIError(400, f"{param}: no such file {path}", param=param)
        if path.stat().st_size > self.limits.max_image_bytes:
            raise self._too_big(param, path.stat().st_size)
        return path.read_bytes()

    async def _download(self, url: str, param: str) -> bytes:
        try:
            return await asyncio.wait_for(self._stream(url, param), self.limits.fetch_timeout)
        except asyncio.TimeoutError:
            msg = f"{param}: fetching the image took longer than {self.limits.fetch_timeout} s"
            raise APIError(400, msg, param=param) from None
        except httpx.HTTPError as exc:
            raise APIError(400, f"{param}: could not fetch the image ({type(exc).__name__})", param=param) from None

    async def _stream(self, url: str, param: str) -> bytes:
        limit = self.limits.max_image_bytes
        async with httpx.AsyncClient(follow_redirects=True, max_redirects=3) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise APIError(400, f"{param}: fetching the image answered HTTP {resp.status_code}", param=param)
                declared = resp.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise self._too_big(param, int(declared))
                chunks, size = [], 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise self._too_big(param, size)
                    chunks.append(chunk)
                return b"".join(chunks)
