"""`ServerConfig`: the HTTP server's knobs, one per `kestrel serve` flag (SGLang's names where a twin exists)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

REASONING_PARSERS = ("kimi", "none")
TOOL_CALL_PARSERS = ("kimi_k2", "none")


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0: all interfaces)"})
    port: int = field(default=30000, metadata={"help": "TCP port to listen on"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY' (default: open)"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients pass (default: MODEL as given, or the built-in's name)"}
    )
    max_queued_requests: int | None = field(
        default=None, metadata={"help": "queued requests beyond which new ones get 503 (default: unbounded)"}
    )
    reasoning_parser: str = field(
        default="kimi", metadata={"help": "split reasoning from content", "choices": REASONING_PARSERS}
    )
    tool_call_parser: str = field(
        default="kimi_k2", metadata={"help": "parse tool calls from the output", "choices": TOOL_CALL_PARSERS}
    )
    max_request_bytes: int = field(default=32 << 20, metadata={"help": "largest request body accepted (413 above)"})
    # Image input (models with a vision tower): where images may come from and how large they may be.
    allowed_local_media_path: str | None = field(
        default=None, metadata={"help": "folder whose files image_url file:// URLs may read (default: none)"}
    )
    max_image_pixels: int = field(
        default=50_000_000, metadata={"help": "largest image (width x height), checked before decoding"}
    )
    max_image_bytes: int = field(
        default=20 << 20, metadata={"help": "largest encoded image (data URL, file, download)"}
    )
    limit_mm_per_prompt: int = field(default=16, metadata={"help": "images per chat request"})
    media_fetch_timeout: float = field(default=10.0, metadata={"help": "seconds to download an http(s) image"})
    graceful_shutdown_timeout: float = field(
        default=30.0, metadata={"help": "seconds in-flight requests get to finish on SIGINT/SIGTERM"}
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        for name in ("max_image_pixels", "max_image_bytes", "limit_mm_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"media_fetch_timeout must be > 0, got {self.media_fetch_timeout}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path: {self.allowed_local_media_path} is not a folder")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServerConfig` field (`--host`, `--api-key`, `--reasoning-parser`, ...)."""
    for f in dataclasses.fields(ServerConfig):
        kind = float if "float" in str(f.type) else int if "int" in str(f.type) else str
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=f.default,
            dest=f.name,
            choices=f.metadata.get("choices"),
            help=f.metadata["help"],
        )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
